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
#include "session.h"
#include "tests/testing/scoped_env.h"
#include "tokenizer.h"

namespace kvmem::worker {
namespace {

// Live slots of a stream, from its blocks (the worker's tables hold no positions).
uint64_t Slots(const client::StreamTable& stream) {
  uint64_t n = 0;
  for (const client::TableBlock& b : stream.blocks) n += b.count;
  return n;
}

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
    config_.listen = "127.0.0.1:0";
    config_.engine.pool_bytes = 256ull << 20;
    config_.engine.page_bytes = 256 * 1024;
    Restart();
  }
  // A daemon with config_ (in place of the one running).
  void Restart() {
    client_.reset();
    server_.reset();
    server_ = *service::Server::Start(config_);
    client_ = *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()));
  }

  // Prefill `ids` then feed `more` one at a time through `session`; returns the logits
  // after each call.
  static std::vector<std::vector<float>> Run(Session& session, const std::vector<int32_t>& ids,
                                             const std::vector<int32_t>& more) {
    std::vector<std::vector<float>> out;
    auto logits = session.Feed(ids, true);
    EXPECT_TRUE(logits.ok()) << logits.status();
    out.push_back(*logits);
    for (int32_t t : more) {
      logits = session.Feed({t}, false);
      EXPECT_TRUE(logits.ok()) << logits.status();
      out.push_back(*logits);
    }
    return out;
  }

  std::vector<std::vector<float>> RunLocal(const std::vector<int32_t>& ids,
                                           const std::vector<int32_t>& more) {
    LocalKvStore local(model_->config());
    Session session(*model_, local, nullptr);
    return Run(session, ids, more);
  }

  // The table a store kept from the daemon's updates is the one GetBlockTable returns now.
  void ExpectTableCurrent(const KvmemKvStore& store) {
    const client::BlockTable& kept = store.table();
    auto fresh = client_->GetBlockTable(store.sequence_id(), kept.positions);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    EXPECT_EQ(kept.version, fresh->version);
    EXPECT_EQ(kept.epoch, fresh->epoch);
    ASSERT_EQ(kept.streams.size(), fresh->streams.size());
    for (size_t s = 0; s < kept.streams.size(); ++s) {
      EXPECT_EQ(kept.streams[s].positions, fresh->streams[s].positions) << "stream " << s;
      ASSERT_EQ(kept.streams[s].blocks.size(), fresh->streams[s].blocks.size()) << "stream " << s;
      for (size_t b = 0; b < kept.streams[s].blocks.size(); ++b) {
        const client::TableBlock &x = kept.streams[s].blocks[b], &y = fresh->streams[s].blocks[b];
        EXPECT_EQ(x.id, y.id);
        EXPECT_EQ(x.offset, y.offset);
        EXPECT_EQ(x.start, y.start);
        EXPECT_EQ(x.count, y.count);
        EXPECT_EQ(x.precision, y.precision);
      }
    }
  }

  std::unique_ptr<KvmemKvStore> Store(const client::PolicySpec& policy, client::KvTransport path) {
    auto store = KvmemKvStore::Create(client_.get(), model_->config(), policy, path);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  static GgufFile* file_;
  static Tokenizer* tokenizer_;
  static LlamaModel* model_;
  service::ServerConfig config_;
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
  Session session(*model_, local, nullptr);
  auto logits = Run(session, ids, {});
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

// The worker's decode path (one StepBatch per token, the table kept by deltas) under `full`
// gives the in-process cache's logits to the bit, on every transport (UCX over TCP, as from
// another host: the prompt's K/V as a message, every forward's reads by RMA gets), and the
// table it kept is the daemon's.
TEST_F(WorkerTest, FullPolicyThroughKvmemdMatchesTheInProcessCache) {
  std::vector<client::KvTransport> transports = {client::KvTransport::kAttach,
                                                 client::KvTransport::kGrpc};
#if KVMEM_WITH_UCX
  // The daemon's worker and the store's read it when made.
  const testing::ScopedEnv tcp("UCX_TLS", "tcp");
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  config_.ucx = true;
  config_.ucx_trusted_network = true;
  Restart();
  transports.push_back(client::KvTransport::kUcx);
#endif
  const std::vector<int32_t> ids =
      tokenizer_->Encode(tokenizer_->ChatPrompt("Name three colors."), true);
  const std::vector<int32_t> more = {9546, 30, 1743, 28, 3737};
  const auto want = RunLocal(ids, more);
  for (auto path : transports) {
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(client::KvTransportName(path));
      auto daemon = Store({"full", {}}, path);
      ASSERT_NE(daemon, nullptr);
      EXPECT_EQ(daemon->path().reads(), path) << daemon->path().reason();
      Session session(*model_, *daemon, daemon.get(), {32, f16});
      const auto got = Run(session, ids, more);
      ASSERT_EQ(got.size(), want.size());
      // f32 storage, the same order, the same arithmetic: bit-exact.
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "call " << i;
      ExpectTableCurrent(*daemon);
      auto stats = client_->GetStats(true);
      ASSERT_TRUE(stats.ok());
      for (const client::SequenceStats& seq : stats->sequences) {
        if (seq.sequence_id != daemon->sequence_id()) continue;
        EXPECT_EQ(seq.steps, more.size());  // one step per decoded token
        EXPECT_EQ(seq.appended_tokens, ids.size() + more.size());
      }
      if (path == client::KvTransport::kUcx) {
        // The prompt went as one message; every forward read the pool by gets.
        const ModelConfig& m = model_->config();
        EXPECT_EQ(daemon->path().ucx_bytes_sent(),
                  2ull * ids.size() * m.num_layers * m.num_kv_heads * m.head_dim * sizeof(float));
        EXPECT_GT(daemon->path().ucx_bytes_read(), 0u);
      }
    }
  }
#if KVMEM_WITH_UCX
#endif
}

// kvmemd going away in the middle of a generation does not stop it: the rest runs on an
// in-process cache rebuilt from the same passes, and under `full` every logit is the one
// the in-process cache alone gives (kvmemd's were the same bits before it went).
TEST_F(WorkerTest, AGenerationOutlivesItsDaemon) {
  const std::vector<int32_t> ids =
      tokenizer_->Encode(tokenizer_->ChatPrompt("Name three colors."), true);
  const std::vector<int32_t> more = {9546, 30, 1743, 28, 3737};
  const auto want = RunLocal(ids, more);
  auto daemon = Store({"full", {}}, client::KvTransport::kGrpc);
  ASSERT_NE(daemon, nullptr);
  Session session(*model_, *daemon, daemon.get());
  FallbackSession feeder(*model_, &session, {});
  std::vector<std::vector<float>> got;
  auto logits = feeder.Feed(ids, true);
  ASSERT_TRUE(logits.ok()) << logits.status();
  got.push_back(*logits);
  for (size_t i = 0; i < more.size(); ++i) {
    if (i == 2) server_.reset();  // kvmemd is gone: its sequence with it
    logits = feeder.Feed({more[i]}, false);
    ASSERT_TRUE(logits.ok()) << logits.status();
    got.push_back(*logits);
  }
  EXPECT_TRUE(absl::IsUnavailable(feeder.fell_back()) ||
              absl::IsDeadlineExceeded(feeder.fell_back()))
      << feeder.fell_back();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "call " << i;
}

// The same when kvmemd restarts under the worker: the new daemon does not know the
// sequence (NOT_FOUND: its ids start elsewhere; before, its first sequence, another
// request's, took the worker's id and the worker's next step went to it).
TEST_F(WorkerTest, AGenerationOutlivesARestartOfItsDaemon) {
  config_.listen = "unix:" + ::testing::TempDir() + "/kvmem_worker_restart_" +
                   std::to_string(getpid()) + ".sock";
  Restart();
  client_ = *client::Client::Connect(config_.listen);
  const std::vector<int32_t> ids =
      tokenizer_->Encode(tokenizer_->ChatPrompt("Name three colors."), true);
  const std::vector<int32_t> more = {9546, 30, 1743};
  const auto want = RunLocal(ids, more);
  auto daemon = Store({"full", {}}, client::KvTransport::kGrpc);
  ASSERT_NE(daemon, nullptr);
  Session session(*model_, *daemon, daemon.get());
  FallbackSession feeder(*model_, &session, {});
  std::unique_ptr<KvmemKvStore> other;  // the new daemon's first sequence
  std::vector<std::vector<float>> got;
  auto logits = feeder.Feed(ids, true);
  ASSERT_TRUE(logits.ok()) << logits.status();
  got.push_back(*logits);
  for (size_t i = 0; i < more.size(); ++i) {
    if (i == 1) {  // a new kvmemd on the same socket, where another request starts
      server_.reset();
      server_ = *service::Server::Start(config_);
      other = Store({"full", {}}, client::KvTransport::kGrpc);
      ASSERT_NE(other, nullptr);
    }
    logits = feeder.Feed({more[i]}, false);
    ASSERT_TRUE(logits.ok()) << logits.status();
    got.push_back(*logits);
  }
  EXPECT_TRUE(absl::IsNotFound(feeder.fell_back())) << feeder.fell_back();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "call " << i;
}

// Several sequences stepped by one StepBatch per token decode exactly as each alone: full
// (the in-process cache's logits), window (evicting every step) and h2o with f16 attention
// rows; every kept table is the daemon's.
TEST_F(WorkerTest, DecodeBatchStepsEachSequenceAsAlone) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
      "children were playing by the fountain while their parents talked.",
      false);
  const std::vector<int32_t> more = {100, 200, 300, 400, 500, 600};
  const std::vector<std::pair<client::PolicySpec, bool>> policies = {
      {{"full", {}}, false},
      {{"window", {{"window", 16}}}, false},
      {{"h2o", {{"budget", 16}}}, true}};
  std::vector<std::vector<std::vector<float>>> alone;
  for (const auto& [policy, f16] : policies) {
    auto store = Store(policy, client::KvTransport::kAttach);
    ASSERT_NE(store, nullptr);
    Session session(*model_, *store, store.get(), {32, f16});
    alone.push_back(Run(session, ids, more));
  }
  std::vector<std::unique_ptr<KvmemKvStore>> stores;
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<std::vector<std::vector<float>>> batched(policies.size());
  for (size_t p = 0; p < policies.size(); ++p) {
    stores.push_back(Store(policies[p].first, client::KvTransport::kAttach));
    ASSERT_NE(stores.back(), nullptr);
    sessions.push_back(std::make_unique<Session>(*model_, *stores.back(), stores.back().get(),
                                                 SessionOptions{32, policies[p].second}));
    auto logits = sessions.back()->Feed(ids, true);
    ASSERT_TRUE(logits.ok()) << logits.status();
    batched[p].push_back(*logits);
  }
  const std::vector<Session*> all = {sessions[0].get(), sessions[1].get(), sessions[2].get()};
  for (int32_t t : more) {
    std::vector<std::vector<float>> logits;
    ASSERT_TRUE(DecodeBatch(all, std::vector<int32_t>(all.size(), t), &logits).ok());
    for (size_t p = 0; p < policies.size(); ++p) batched[p].push_back(logits[p]);
  }
  const auto local = RunLocal(ids, more);
  for (size_t p = 0; p < policies.size(); ++p) {
    ASSERT_EQ(batched[p].size(), alone[p].size());
    for (size_t i = 0; i < alone[p].size(); ++i) {
      EXPECT_EQ(batched[p][i], alone[p][i]) << "policy " << p << " call " << i;
    }
    ExpectTableCurrent(*stores[p]);
  }
  for (size_t i = 0; i < local.size(); ++i) EXPECT_EQ(batched[0][i], local[i]) << "call " << i;
  // window and h2o hold 16 tokens per stream (window: at most; h2o: its budget).
  for (size_t p = 1; p < policies.size(); ++p) {
    EXPECT_EQ(Slots(stores[p]->table().streams[0]), 16u) << "policy " << p;
    EXPECT_GT(sessions[p]->evicted(), 0u);
  }
  EXPECT_NE(batched[1].back(), local.back());  // eviction changed what the model saw
}

// In place (kvmemd --in_place_writes): each decode step's K/V written into the pool where
// the last step's plan said, its rows in the step channel's signal area; the logits are the
// message path's to the bit (full: the in-process cache's), one sequence alone and several
// in one batch, and the kept tables are the daemon's. The tables come from the table area
// (the answers name only their versions).
TEST_F(WorkerTest, InPlaceStepsGiveTheMessagePathsLogits) {
  config_.engine.in_place_writes = true;
  config_.engine.table_area_bytes = 8 << 20;
  Restart();
  ASSERT_TRUE(client_->OpenStepChannel(std::nullopt, 4 << 20).ok());
  ASSERT_TRUE(client_->AttachTableArea().ok());
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.", false);
  const std::vector<int32_t> more = {100, 200, 300, 400, 500, 600, 700, 800};
  const std::vector<std::pair<client::PolicySpec, bool>> policies = {
      {{"full", {}}, false}, {{"h2o", {{"budget", 16}}}, true}, {{"confkv", {}}, false}};
  const auto local = RunLocal(ids, more);
  for (const auto& [policy, f16] : policies) {
    std::vector<std::vector<float>> want, got;
    for (bool in_place : {false, true}) {
      auto store = KvmemKvStore::Create(client_.get(), model_->config(), policy,
                                        client::KvTransport::kAttach, nullptr, in_place);
      ASSERT_TRUE(store.ok()) << store.status();
      ASSERT_EQ((*store)->in_place(), in_place);
      Session session(*model_, **store, store->get(), {32, f16});
      (in_place ? got : want) = Run(session, ids, more);
      ExpectTableCurrent(**store);
      if (in_place) {
        // The first step has no plan yet; every later one writes in place.
        EXPECT_EQ((*store)->in_place_steps(), more.size() - 1) << *policy.name;
        if (policy.name != "full") EXPECT_EQ((*store)->area_row_steps(), more.size());
      }
    }
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << *policy.name << " call " << i;
    }
    if (policy.name == "full") {
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], local[i]) << "call " << i;
    }
  }
  // Several in one batch, in place, as each alone.
  std::vector<std::unique_ptr<KvmemKvStore>> stores;
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<Session*> all;
  for (const auto& [policy, f16] : policies) {
    stores.push_back(*KvmemKvStore::Create(client_.get(), model_->config(), policy,
                                           client::KvTransport::kAttach, nullptr, true));
    sessions.push_back(std::make_unique<Session>(*model_, *stores.back(), stores.back().get(),
                                                 SessionOptions{32, f16}));
    ASSERT_TRUE(sessions.back()->Feed(ids, true).ok());
    all.push_back(sessions.back().get());
  }
  std::vector<std::vector<float>> last;
  for (int32_t t : more) {
    ASSERT_TRUE(DecodeBatch(all, std::vector<int32_t>(all.size(), t), &last).ok());
  }
  EXPECT_EQ(last[0], local.back());
  for (const auto& store : stores) {
    EXPECT_EQ(store->in_place_steps(), more.size() - 1);
    ExpectTableCurrent(*store);
  }
  EXPECT_GT(client_->table_area_reads(), 3 * more.size()) << "the tables came from the area";
  EXPECT_EQ(client_->table_refetches(), 0u);
}

// A second request with the same prompt maps the published blocks (auto_publish by the
// first) and computes only the rest. Both prefill in block-sized chunks (prefill_chunk 16,
// what generate --prefix_cache does), so the second computes exactly the chunks the first
// computed after the prefix and its logits are the first's to the bit. Against a one-pass
// prefill they differ only in rounding (OpenBLAS's sgemm rounds a row differently when the
// matrix has a different number of rows; measured on Debian's 0.3.21), and the greedy
// tokens agree. The two tables name the same leading blocks.
TEST_F(WorkerTest, ReusedPrefixGivesTheColdLogits) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      tokenizer_->ChatPrompt(
          "The committee met on Tuesday to discuss the budget for the new library, and after "
          "a long debate about the roof, the windows and the parking lot, it approved the "
          "plan with two changes that the mayor had asked for. What did the committee do?"),
      true);
  ASSERT_GE(ids.size(), 64u);
  const uint64_t reusable = (ids.size() - 1) / 16 * 16;  // whole blocks, never the last token
  const std::vector<int32_t> rest(ids.begin() + static_cast<ptrdiff_t>(reusable), ids.end());
  const std::vector<int32_t> more = {504, 3884, 3255};
  const client::Prompt prompt{ids, "", "smollm2-135m", /*auto_publish=*/true};
  auto Create = [&] {
    auto store = KvmemKvStore::Create(client_.get(), model_->config(), {"full", {}},
                                      client::KvTransport::kAttach, &prompt);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  };
  const SessionOptions chunked{32, false, /*prefill_chunk=*/16};
  auto cold = Create();
  ASSERT_NE(cold, nullptr);
  EXPECT_EQ(cold->reused_tokens(), 0u);
  Session cold_session(*model_, *cold, cold.get(), chunked);
  const auto want = Run(cold_session, ids, more);
  const auto one_pass = RunLocal(ids, more);

  auto warm = Create();
  ASSERT_NE(warm, nullptr);
  ASSERT_EQ(warm->reused_tokens(), reusable);
  Session warm_session(*model_, *warm, warm.get(), chunked);
  warm_session.SkipMapped(static_cast<int64_t>(reusable));
  const auto got = Run(warm_session, rest, more);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "call " << i;
    const auto argmax = [](const std::vector<float>& l) {
      return std::max_element(l.begin(), l.end()) - l.begin();
    };
    EXPECT_EQ(argmax(got[i]), argmax(one_pass[i])) << "call " << i;
    for (size_t j = 0; j < got[i].size(); ++j) {
      ASSERT_NEAR(got[i][j], one_pass[i][j], 1e-3) << "call " << i << " logit " << j;
    }
  }
  ExpectTableCurrent(*warm);
  const auto& a = cold->table().streams[0].blocks;
  const auto& b = warm->table().streams[0].blocks;
  ASSERT_GE(b.size(), reusable / 16);
  for (size_t i = 0; i < reusable / 16; ++i) EXPECT_EQ(a[i].id, b[i].id) << "block " << i;
}

// A table another client changed (here: compressed to 8 tokens) is fetched again before
// the next forward pass reads the pool; the forward then sees the 8 tokens.
TEST_F(WorkerTest, TableChangedElsewhereIsFetchedAgain) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "One two three four five six seven "
      "eight nine ten eleven twelve",
      false);
  auto store = Store({"window", {{"window", 64}}}, client::KvTransport::kAttach);
  ASSERT_NE(store, nullptr);
  Session session(*model_, *store, store.get());
  ASSERT_TRUE(session.Feed(ids, true).ok());
  auto fresh = client_->GetBlockTable(store->sequence_id());
  ASSERT_TRUE(fresh.ok());
  client::CompressArgs args;
  args.epoch = fresh->epoch;
  args.target_tokens = 8;
  ASSERT_TRUE(client_->Compress(store->sequence_id(), args).ok());
  auto logits = session.Feed({100}, false);
  ASSERT_TRUE(logits.ok()) << logits.status();
  ExpectTableCurrent(*store);
  EXPECT_EQ(Slots(store->table().streams[0]), 9u);
}

TEST_F(WorkerTest, Int8CacheStaysCloseAndWindowEvicts) {
  const std::vector<int32_t> ids = tokenizer_->Encode(
      "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
      "children were playing by the fountain while their parents talked.",
      false);
  const auto want = RunLocal(ids, {});
  client::PolicySpec int8{"full", {}, client::Precision::kInt8, 16};
  auto daemon = Store(int8, client::KvTransport::kAttach);
  ASSERT_NE(daemon, nullptr);
  Session session(*model_, *daemon, daemon.get());
  const auto got = Run(session, ids, {100, 200});
  // The prefill logits never see quantized blocks (they are computed before the append).
  EXPECT_EQ(got[0], want[0]);
  ExpectTableCurrent(*daemon);
  bool any_int8 = false;
  for (const auto& b : daemon->table().streams[0].blocks) {
    any_int8 |= b.precision == client::Precision::kInt8;
  }
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
