// The reference worker on the real model (KVMEM_MODEL, set by scripts/test.sh): tokenizer
// round trips, the full policy through kvmemd gives the in-process cache's logits, and the
// shared-memory and gRPC read paths agree.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "gtest/gtest.h"
#include "kv_stores.h"
#include "model.h"
#include "server/service/server.h"
#include "tokenizer.h"

namespace kvmem::worker {
namespace {

class WorkerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* path = std::getenv("KVMEM_MODEL");
    if (path == nullptr) return;
    file_ = GgufFile::Open(path)->release();
    tokenizer_ = Tokenizer::FromGguf(*file_)->release();
    model_ = LlamaModel::Load(*file_)->release();
  }
  void SetUp() override {
    if (model_ == nullptr) GTEST_SKIP() << "KVMEM_MODEL is not set (bash scripts/fetch_model.sh)";
    service::ServerConfig config;
    config.listen = "127.0.0.1:0";
    config.engine.pool_bytes = 256ull << 20;
    config.engine.page_bytes = 256 * 1024;
    server_ = *service::Server::Start(config);
    client_ = *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()));
  }

  // Prefill `ids` then feed `more` one at a time; returns the logits after each call.
  std::vector<std::vector<float>> Run(KvStore& store, KvmemKvStore* daemon, LocalKvStore* local,
                                      const std::vector<int32_t>& ids,
                                      const std::vector<int32_t>& more) {
    std::vector<std::vector<float>> out;
    int64_t pos = 0;
    auto feed = [&](const std::vector<int32_t>& tokens) {
      std::vector<int64_t> positions;
      for (size_t i = 0; i < tokens.size(); ++i) positions.push_back(pos++);
      ForwardOptions options;
      options.layer_distance = true;
      auto r = model_->Forward(tokens, positions, store, options);
      EXPECT_TRUE(r.ok()) << r.status();
      if (local) local->Append(positions, *r);
      if (daemon) {
        std::vector<float> entropy(tokens.size(), 1.0f);
        EXPECT_TRUE(daemon->Append(positions, tokens, *r, entropy).ok());
        EXPECT_TRUE(client_->Step(daemon->sequence_id(), {}).ok());
      }
      out.emplace_back(r->logits.end() - model_->config().vocab, r->logits.end());
    };
    feed(ids);
    for (int32_t t : more) feed({t});
    return out;
  }

  static GgufFile* file_;
  static Tokenizer* tokenizer_;
  static LlamaModel* model_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<client::Client> client_;
};

GgufFile* WorkerTest::file_ = nullptr;
Tokenizer* WorkerTest::tokenizer_ = nullptr;
LlamaModel* WorkerTest::model_ = nullptr;

TEST_F(WorkerTest, TokenizerRoundTripsTextIncludingNonAscii) {
  for (const std::string text : {"Hello, world!", "Größe über 5€ — naïve café", "日本語のテキスト",
                                 "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\nlines  "}) {
    const std::vector<int32_t> ids = tokenizer_->Encode(text, true);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tokenizer_->Decode(ids), text);
  }
  // Special tokens are single ids only when parsed as such.
  EXPECT_EQ(tokenizer_->Encode("<|im_end|>", true).size(), 1u);
  EXPECT_GT(tokenizer_->Encode("<|im_end|>", false).size(), 1u);
}

TEST_F(WorkerTest, GreedyAnswerIsSensible) {
  LocalKvStore local(model_->config());
  const std::vector<int32_t> ids =
      tokenizer_->Encode(tokenizer_->ChatPrompt("What is the capital of France?"), true);
  auto logits = Run(local, nullptr, &local, ids, {});
  std::vector<int32_t> answer;
  std::vector<float> last = logits.back();
  int64_t pos = static_cast<int64_t>(ids.size());
  for (int i = 0; i < 8; ++i) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    answer.push_back(next);
    ForwardOptions options;
    auto r = model_->Forward({next}, {pos}, local, options);
    ASSERT_TRUE(r.ok());
    local.Append(std::vector<int64_t>{pos++}, *r);
    last.assign(r->logits.end() - model_->config().vocab, r->logits.end());
  }
  EXPECT_NE(tokenizer_->Decode(answer).find("Paris"), std::string::npos)
      << tokenizer_->Decode(answer);
}

TEST_F(WorkerTest, FullPolicyThroughKvmemdMatchesTheInProcessCache) {
  const std::vector<int32_t> ids =
      tokenizer_->Encode(tokenizer_->ChatPrompt("Name three colors."), true);
  const std::vector<int32_t> more = {9546, 30, 1743, 28, 3737};
  LocalKvStore local(model_->config());
  const auto want = Run(local, nullptr, &local, ids, more);
  for (auto path : {KvmemKvStore::ReadPath::kSharedMemory, KvmemKvStore::ReadPath::kGrpc}) {
    auto daemon = *KvmemKvStore::Create(client_.get(), model_->config(), {"full", {}}, path);
    const auto got = Run(*daemon, daemon.get(), nullptr, ids, more);
    ASSERT_EQ(got.size(), want.size());
    // f32 storage, the same order, the same arithmetic: bit-exact.
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "call " << i;
  }
}

TEST_F(WorkerTest, Int8CacheStaysCloseAndWindowEvicts) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
      "children were playing by the fountain while their parents talked.",
      false);
  LocalKvStore local(model_->config());
  const auto want = Run(local, nullptr, &local, ids, {});
  client::PolicySpec int8{"full", {}, client::Precision::kInt8, 16};
  auto daemon = *KvmemKvStore::Create(client_.get(), model_->config(), int8,
                                      KvmemKvStore::ReadPath::kSharedMemory);
  const auto got = Run(*daemon, daemon.get(), nullptr, ids, {100, 200});
  // The prefill logits never see quantized blocks (quantization happens at Step).
  EXPECT_EQ(got[0], want[0]);
  auto table = *client_->GetBlockTable(daemon->sequence_id());
  bool any_int8 = false;
  for (const auto& b : table.streams[0].blocks) any_int8 |= b.precision == client::Precision::kInt8;
  EXPECT_TRUE(any_int8);
}

// A prompt attends through matrix products (BlockedAttention); one token at a time through
// the row-by-row path. Both must give the same logits and the same signals.
TEST_F(WorkerTest, BlockedPrefillMatchesTokenByToken) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "The committee met on Tuesday to discuss the budget for the new library, and after a "
      "long debate about the roof, the windows and the parking lot, it approved the plan with "
      "two changes that the mayor had asked for in her letter of March.",
      true);
  ASSERT_GE(ids.size(), 48u);
  std::vector<int64_t> positions(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) positions[i] = static_cast<int64_t>(i);
  ForwardOptions options;
  options.attention_rows = true;
  options.windows = {8, 1000};
  LocalKvStore empty(model_->config());
  auto blocked = model_->Forward(ids, positions, empty, options);
  ASSERT_TRUE(blocked.ok()) << blocked.status();

  LocalKvStore local(model_->config());
  ForwardOptions one;
  one.attention_rows = true;
  std::vector<std::vector<float>> window8(blocked->attention_rows.size());
  std::vector<std::vector<float>> all(blocked->attention_rows.size());
  absl::StatusOr<ForwardResult> r;
  for (size_t i = 0; i < ids.size(); ++i) {
    r = model_->Forward({ids[i]}, {positions[i]}, local, one);
    ASSERT_TRUE(r.ok()) << r.status();
    local.Append(std::vector<int64_t>{positions[i]}, *r);
    // Column sums of every query (window 1000 >= T) and of the last 8, from the rows.
    for (size_t s = 0; s < r->attention_rows.size(); ++s) {
      all[s].resize(ids.size(), 0.0f);
      window8[s].resize(ids.size(), 0.0f);
      for (size_t j = 0; j < r->attention_rows[s].size(); ++j) {
        all[s][j] += r->attention_rows[s][j];
        if (i + 8 >= ids.size()) window8[s][j] += r->attention_rows[s][j];
      }
    }
  }
  const uint32_t V = model_->config().vocab;
  const std::vector<float> last(blocked->logits.end() - V, blocked->logits.end());
  double max_diff = 0;
  for (uint32_t i = 0; i < V; ++i)
    max_diff = std::max(max_diff, double(std::fabs(last[i] - r->logits[i])));
  EXPECT_LT(max_diff, 2e-3);  // f32, different summation order
  ASSERT_EQ(blocked->window_scores.size(), 2u);
  for (size_t s = 0; s < all.size(); ++s) {
    for (size_t j = 0; j < ids.size(); ++j) {
      EXPECT_NEAR(blocked->attention_rows[s][j], r->attention_rows[s][j], 1e-4) << s << " " << j;
      EXPECT_NEAR(blocked->window_scores[0].streams[s][j], window8[s][j], 1e-4) << s << " " << j;
      EXPECT_NEAR(blocked->window_scores[1].streams[s][j], all[s][j], 1e-3) << s << " " << j;
    }
  }
}

}  // namespace
}  // namespace kvmem::worker
