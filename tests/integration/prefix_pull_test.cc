// PullPrefix between two kvmemd in this process and a redis-server of the test's own (the
// fleet's index): what a node pulls from a holder on this host is the holder's K/V byte for
// byte (these tests run under TSan and ASan in CI; tests/python/test_cluster_index.py has
// the rest: transports, restarts, tenants, a holder killed).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvmem/client.h"
#include "server/service/server.h"
#include "tests/testing/payload.h"
#include "tests/testing/redis_server.h"

namespace kvmem {
namespace {

constexpr uint32_t kL = 2, kH = 2, kD = 64;
constexpr char kPeer[] = "fleet-peer-token-0123456789";

client::Layout TestLayout() { return client::Layout{kL, kH, kD, client::DType::kF16, 16, 49152}; }

// PullPrefix from a holder on this host maps its pool and reads the blocks this node lacks
// straight into the append's chunks (run under the sanitizers in CI): the node holds the
// prompt's first block already, appends at most 12 tokens a chunk (blocks of 16 span two),
// and ends up with the holder's K/V byte for byte, having read only what it lacked.
TEST(PrefixPullTest, AHoldersPoolIsMappedAndOnlyWhatIsMissingIsReadByteForByte) {
  testing::RedisServer redis;
  if (!redis.Start()) {
    if (std::getenv("KVMEM_CI") != nullptr) FAIL() << "redis-server did not start";
    GTEST_SKIP() << "no redis-server";
  }
  const std::string dir = ::testing::TempDir();
  const std::string peer_token = absl::StrCat(dir, "/kvmem_pull_test_peer.", getpid());
  std::ofstream(peer_token) << kPeer << "\n";
  absl::Cleanup remove_token = [&] { std::remove(peer_token.c_str()); };
  const auto node = [&](const char* name) {
    return absl::StrCat("unix:", dir, "/kvmem-pull-test-", name, ".", getpid());
  };
  const auto start = [&](const char* name, bool puller) {
    service::ServerConfig config;
    config.listen = node(name);
    config.engine.pool_bytes = 32ull << 20;
    config.reaper_period = absl::Hours(1);
    config.cluster_index.url = redis.url();
    config.cluster_index.node = node(name);
    config.cluster_index.timeout = absl::Seconds(5);  // a sanitizer build answers slowly
    if (puller) {
      config.cluster_peers = {node("a")};
      config.cluster_peer_token_file = peer_token;
      config.engine.max_append_bytes = 12 * 2 * kL * kH * kD * 2;  // 12 tokens
    }
    auto server = service::Server::Start(config);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  };
  std::unique_ptr<service::Server> a = start("a", false), b = start("b", true);
  ASSERT_TRUE(a && b);
  client::ClientOptions options;
  options.deadline = absl::Seconds(20);
  auto on_a = *client::Client::Connect(node("a"), options);
  auto on_b = *client::Client::Connect(node("b"), options);
  client::Prompt prompt;
  for (int32_t t = 0; t < 65; ++t) prompt.token_ids.push_back(1000 + 7 * t);
  prompt.model = "m";
  // A publishes the whole prompt (64 tokens mapped by a CreateSequence: 4 blocks), B its
  // first 17 tokens (1 block), each in appends of at most 8 tokens.
  for (const auto& [c, n] : {std::pair{on_a.get(), 65}, std::pair{on_b.get(), 17}}) {
    client::Prompt part = prompt;
    part.token_ids.resize(n);
    auto seq = c->CreateSequence(TestLayout(), client::PolicySpec(), std::nullopt, &part);
    ASSERT_TRUE(seq.ok()) << seq.status();
    for (int64_t t = 0; t < n; t += 8) {
      const uint32_t m = static_cast<uint32_t>(std::min<int64_t>(8, n - t));
      const std::vector<int64_t> positions = testing::Range(t, m);
      const std::string k = testing::Payload16(kL * kH, t, m, kD, 0);
      const std::string v = testing::Payload16(kL * kH, t, m, kD, 1);
      ASSERT_TRUE(
          c->Append(seq->id,
                    {positions, absl::MakeConstSpan(part.token_ids).subspan(t, m), k, v, {}, {}})
              .ok());
    }
    ASSERT_TRUE(c->Publish(seq->id).ok());
    ASSERT_TRUE(c->Release(seq->id).ok());
  }
  // Pulled once the index names A (its claims reach Redis a moment after the publication,
  // and its connections open a moment after each daemon starts: UNAVAILABLE until then).
  absl::StatusOr<client::Pulled> pulled;
  for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
    pulled = on_b->PullPrefix(TestLayout(), prompt);
    if (pulled.ok() ? pulled->pulled_tokens > 0 : !absl::IsUnavailable(pulled.status())) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  const uint64_t per_token = 2 * kL * kH * kD * 2;
  EXPECT_EQ(pulled->local_tokens, 16u);
  EXPECT_EQ(pulled->pulled_tokens, 48u);
  EXPECT_EQ(pulled->transport, "attach");
  EXPECT_EQ(pulled->bytes, 48 * per_token);  // only what B lacked
  auto seq = on_b->CreateSequence(TestLayout(), client::PolicySpec(), std::nullopt, &prompt);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->reused_prefix_tokens, 64u);
  auto read = on_b->ReadKv(seq->id);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), size_t{kL * kH});
  const std::vector<int64_t> positions = testing::Range(0, 64);
  for (const client::StreamKv& s : *read) {
    const uint32_t stream = s.layer * kH + s.kv_head;
    EXPECT_EQ(s.positions, positions);
    EXPECT_TRUE(s.k == testing::Expected16(stream, positions, kD, 0)) << "K of stream " << stream;
    EXPECT_TRUE(s.v == testing::Expected16(stream, positions, kD, 1)) << "V of stream " << stream;
  }
}

}  // namespace
}  // namespace kvmem
