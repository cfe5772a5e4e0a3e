// ClusterIndex: the URL forms, the key of a block, the flags it refuses, a lookup that never
// waits on an index that is not there, and on a redis-server of the test's own, claims that
// follow the events under concurrent lookups and a password from the environment (two
// daemons sharing one index: tests/python/test_cluster_index.py).
#include "server/service/cluster_index.h"

#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hiredis/hiredis.h"
#include "tests/testing/redis_server.h"

namespace kvmem::service {
namespace {

TEST(ParseRedisUrl, TakesTheFormsRedisClientsTake) {
  absl::StatusOr<RedisAddress> a = ParseRedisUrl("redis://cache.local");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "cache.local");
  EXPECT_EQ(a->port, 6379);
  EXPECT_EQ(a->db, 0);
  EXPECT_TRUE(a->password.empty());
  a = ParseRedisUrl("redis://user:s3cret@10.0.0.2:7000/3");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "10.0.0.2");
  EXPECT_EQ(a->port, 7000);
  EXPECT_EQ(a->password, "s3cret");
  EXPECT_EQ(a->db, 3);
  a = ParseRedisUrl("redis://[::1]:7001");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 7001);
  a = ParseRedisUrl("unix:///run/redis/redis.sock?db=2");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->unix_path, "/run/redis/redis.sock");
  EXPECT_EQ(a->db, 2);
}

TEST(ParseRedisUrl, RefusesWhatItCannotReach) {
  for (const char* bad :
       {"http://h", "cache.local:6379", "redis://", "redis://h:99999", "redis://h:x",
        "redis://h/db", "redis://[::1", "unix://relative", "unix:///s?timeout=1"}) {
    absl::StatusOr<RedisAddress> a = ParseRedisUrl(bad);
    EXPECT_FALSE(a.ok()) << bad;
    EXPECT_TRUE(absl::StartsWith(a.status().message(), "cluster_index: ")) << a.status();
  }
}

TEST(ClusterIndexKey, NamesTheNamespaceAndTheWholeHash) {
  prefix::BlockHash h{};
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(i);
  const std::string key = ClusterIndex::Key("kvmem", "2x2x8 f16 b8", h);
  // prefix, 16 hex digits of the namespace's sha256, the 64 of the hash.
  ASSERT_EQ(key.size(), 5 + 1 + 16 + 1 + 64) << key;
  EXPECT_TRUE(absl::StartsWith(key, "kvmem:")) << key;
  EXPECT_TRUE(absl::EndsWith(key, ":" + prefix::ToHex(h))) << key;
  EXPECT_EQ(key, ClusterIndex::Key("kvmem", "2x2x8 f16 b8", h));
  EXPECT_NE(key, ClusterIndex::Key("kvmem", "2x2x8 f16 b16", h));
  EXPECT_NE(key, ClusterIndex::Key("other", "2x2x8 f16 b8", h));
}

TEST(ClusterIndex, RefusesAConfigurationItCannotServe) {
  ClusterIndexConfig c;
  c.url = "redis://127.0.0.1:1";
  EXPECT_TRUE(absl::StrContains(ClusterIndex::Start(c).status().message(), "cluster_node_address"));
  c.node = "has space:1";
  EXPECT_FALSE(ClusterIndex::Start(c).ok());
  c.node = "n:1";
  c.ttl = absl::Milliseconds(500);
  EXPECT_TRUE(absl::StrContains(ClusterIndex::Start(c).status().message(), "ttl"));
  c.ttl = absl::Seconds(30);
  c.timeout = absl::ZeroDuration();
  EXPECT_FALSE(ClusterIndex::Start(c).ok());
  c.timeout = absl::Milliseconds(50);
  c.lookup_connections = 0;
  EXPECT_FALSE(ClusterIndex::Start(c).ok());
}

TEST(ClusterIndex, ALookupNeverWaitsForAnIndexThatIsNotThere) {
  ClusterIndexConfig c;
  c.url = "unix:///nonexistent/kvmem-test-redis.sock";
  c.node = "n:1";
  absl::StatusOr<std::unique_ptr<ClusterIndex>> index = ClusterIndex::Start(c);
  ASSERT_TRUE(index.ok()) << index.status();
  prefix::BlockHash h{};
  (*index)->Stored({"ns", nullptr, &h, {}, nullptr});  // queued; dropped, never blocking
  const absl::Time start = absl::Now();
  // Lookups never connect (the writer's thread does): without a connection, no wait.
  for (int i = 0; i < 2; ++i) {
    const FleetAnswer answer = (*index)->Lookup("ns", {h});
    EXPECT_FALSE(answer.available);
    EXPECT_TRUE(absl::StrContains(answer.unavailable, "not connected")) << answer.unavailable;
  }
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_TRUE((*index)->Lookup("ns", {}).available);  // nothing to ask
  metrics::ClusterIndexTotals t = (*index)->counters();
  EXPECT_EQ(t.lookups_answered, 1u);
  EXPECT_EQ(t.lookups_unavailable, 2u);
  EXPECT_FALSE(t.connected);
  // The mirror follows the prefix index while Redis is away (the writer's thread applies it).
  for (int i = 0; i < 200 && (t.entries == 0 || t.dropped == 0); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    t = (*index)->counters();
  }
  EXPECT_EQ(t.entries, 1u);
  EXPECT_GE(t.dropped, 1u);
}

prefix::BlockHash HashOf(uint32_t n) {
  prefix::BlockHash h{};
  for (size_t i = 0; i < 4; ++i) h[i] = static_cast<uint8_t>(n >> (8 * i));
  return h;
}

// A redis-server of the test's own (none installed: skipped, except in CI, where
// scripts/deps.sh installs it), and a node's configuration for it.
class ClusterIndexOnRedis : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> more = {}) {
    if (!redis_.Start(std::move(more))) {
      if (std::getenv("KVMEM_CI") != nullptr) FAIL() << "redis-server did not start";
      GTEST_SKIP() << "no redis-server";
    }
  }
  ClusterIndexConfig Config(std::string node) const {
    ClusterIndexConfig c;
    c.url = redis_.url();
    c.node = std::move(node);
    c.timeout = absl::Seconds(2);
    return c;
  }
  // Each node's writer connects (and opens the lookups' connections) on its own thread:
  // until then its events are dropped and its lookups unavailable. A loaded machine may take
  // a while to get there; 10 s is the most a test waits.
  static void WaitConnected(ClusterIndex& index) {
    for (int i = 0; i < 1000; ++i) {
      if (index.counters().connected && index.Lookup("ns", {HashOf(~0u)}).available) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    FAIL() << "the cluster index did not connect in 10 s";
  }
  testing::RedisServer redis_;
};

// Writers (the prefix index's events, from several threads as sequences publish and the
// reclaimer drops) and lookups at once; what Redis ends up naming is what was published and
// not removed, and a stopped node's claims are gone.
TEST_F(ClusterIndexOnRedis, ClaimsFollowTheEventsUnderConcurrentLookups) {
  Start();
  if (IsSkipped() || HasFatalFailure()) return;
  ClusterIndexConfig c = Config("a:1");
  absl::StatusOr<std::unique_ptr<ClusterIndex>> a = ClusterIndex::Start(c);
  ASSERT_TRUE(a.ok()) << a.status();
  c.node = "b:1";
  absl::StatusOr<std::unique_ptr<ClusterIndex>> b = ClusterIndex::Start(c);
  ASSERT_TRUE(b.ok()) << b.status();
  WaitConnected(**a);
  WaitConnected(**b);
  if (HasFatalFailure()) return;
  constexpr uint32_t kPerThread = 300;
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 4; ++t) {
    // Thread t publishes hashes [t * kPerThread, (t + 1) * kPerThread) and removes the odd ones.
    threads.emplace_back([&, t] {
      for (uint32_t i = t * kPerThread; i < (t + 1) * kPerThread; ++i) {
        const prefix::BlockHash h = HashOf(i);
        (*a)->Stored({"ns", nullptr, &h, {}, nullptr});
        if (i % 2 == 1) (*a)->Removed("ns", h);
      }
    });
  }
  std::atomic<bool> done{false};
  std::atomic<uint64_t> answered{0};
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!done.load()) {
        std::vector<prefix::BlockHash> chain = {HashOf(rng() % (4 * kPerThread)),
                                                HashOf(rng() % (4 * kPerThread))};
        if ((*b)->Lookup("ns", chain).available) answered.fetch_add(1);
      }
    });
  }
  for (size_t i = 0; i < 4; ++i) threads[i].join();
  for (int i = 0; i < 1000 && ((*a)->counters().added + (*a)->counters().removed < 6 * kPerThread ||
                               answered.load() == 0);
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  done = true;
  for (size_t i = 4; i < threads.size(); ++i) threads[i].join();
  EXPECT_GT(answered.load(), 0u);
  const metrics::ClusterIndexTotals t = (*a)->counters();
  EXPECT_EQ(t.added, 4 * kPerThread);
  EXPECT_EQ(t.removed, 2 * kPerThread);
  EXPECT_EQ(t.entries, 2 * kPerThread);
  EXPECT_EQ(t.dropped, 0u);
  for (uint32_t i = 0; i < 4 * kPerThread; i += 7) {
    FleetAnswer answer = (*b)->Lookup("ns", {HashOf(i)});
    ASSERT_TRUE(answer.available) << answer.unavailable;
    if (i % 2 == 0) {
      ASSERT_EQ(answer.holders.size(), 1u) << i;
      EXPECT_EQ(answer.holders[0].node, "a:1");
      EXPECT_EQ(answer.holders[0].blocks, 1u);
    } else {
      EXPECT_TRUE(answer.holders.empty()) << i;
    }
  }
  // Another namespace is another key space.
  EXPECT_TRUE((*b)->Lookup("other", {HashOf(0)}).holders.empty());
  a->reset();  // stopped: its claims withdrawn
  EXPECT_TRUE((*b)->Lookup("ns", {HashOf(0)}).holders.empty());
}

// A password-protected Redis: without the password lookups answer "unavailable" naming
// the refusal; with it (from the environment, off the command line) they are answered.
TEST_F(ClusterIndexOnRedis, AuthenticatesWithThePasswordFromTheEnvironment) {
  Start({"--requirepass", "p4ss"});
  if (IsSkipped() || HasFatalFailure()) return;
  ClusterIndexConfig c = Config("a:1");
  const prefix::BlockHash h = HashOf(1);
  {
    absl::StatusOr<std::unique_ptr<ClusterIndex>> index = ClusterIndex::Start(c);
    ASSERT_TRUE(index.ok()) << index.status();
    // The writer's connection is refused; lookups say why.
    FleetAnswer answer;
    for (int i = 0; i < 300 && !absl::StrContains(answer.unavailable, "NOAUTH"); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
      answer = (*index)->Lookup("ns", {h});
    }
    EXPECT_FALSE(answer.available);
    EXPECT_TRUE(absl::StrContains(answer.unavailable, "NOAUTH")) << answer.unavailable;
    EXPECT_FALSE((*index)->counters().connected);
  }
  setenv("KVMEM_CLUSTER_INDEX_PASSWORD", "p4ss", 1);
  absl::StatusOr<std::unique_ptr<ClusterIndex>> index = ClusterIndex::Start(c);
  unsetenv("KVMEM_CLUSTER_INDEX_PASSWORD");
  ASSERT_TRUE(index.ok()) << index.status();
  (*index)->Stored({"ns", nullptr, &h, {}, nullptr});
  std::vector<FleetHolder> holders;
  for (int i = 0; i < 300 && holders.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    const FleetAnswer answer = (*index)->Lookup("ns", {h});
    ASSERT_TRUE(answer.available) << answer.unavailable;
    holders = answer.holders;
  }
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_EQ(holders[0].node, "a:1");
}

// Claims of `node` in Redis for hashes [0, n) of namespace "ns".
size_t ClaimsIn(ClusterIndex& reader, const std::string& node, uint32_t n) {
  size_t claimed = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const FleetAnswer a = reader.Lookup("ns", {HashOf(i)});
    if (a.available && !a.holders.empty() && a.holders[0].node == node) ++claimed;
  }
  return claimed;
}

// A queue too small for a burst of events loses them; the claims come back whole from the
// prefix index's snapshot (without it, the node would vanish from the fleet's index).
TEST_F(ClusterIndexOnRedis, LostEventsAreRebuiltFromTheSnapshot) {
  Start();
  if (IsSkipped() || HasFatalFailure()) return;
  constexpr uint32_t kBlocks = 500;
  ClusterIndexConfig c = Config("a:1");
  c.max_queued_events = 4;
  absl::StatusOr<std::unique_ptr<ClusterIndex>> a = ClusterIndex::Start(c, [] {
    std::vector<std::pair<std::string, std::vector<prefix::BlockHash>>> blocks(1);
    blocks[0].first = "ns";
    for (uint32_t i = 0; i < kBlocks; ++i) blocks[0].second.push_back(HashOf(i));
    return blocks;
  });
  ASSERT_TRUE(a.ok()) << a.status();
  c.node = "reader:1";
  c.max_queued_events = 100000;
  absl::StatusOr<std::unique_ptr<ClusterIndex>> reader = ClusterIndex::Start(c);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (uint32_t i = 0; i < kBlocks; ++i) {
    const prefix::BlockHash h = HashOf(i);
    (*a)->Stored({"ns", nullptr, &h, {}, nullptr});
  }
  metrics::ClusterIndexTotals t = (*a)->counters();
  for (int i = 0; i < 500 && (t.entries < kBlocks || t.added < kBlocks); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    t = (*a)->counters();
  }
  EXPECT_GT(t.dropped, 0u) << "the queue never overflowed: the test proves nothing";
  EXPECT_EQ(t.entries, kBlocks);
  for (int i = 0; i < 300 && ClaimsIn(**reader, "a:1", 1) == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ClaimsIn(**reader, "a:1", kBlocks), kBlocks);
}

// A key of another type where one claim goes (another program's, a collision) fails that
// claim only: the others are written, the writer stays connected.
TEST_F(ClusterIndexOnRedis, AnErrorReplyFailsOneClaimNotTheWriter) {
  Start();
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string foreign = ClusterIndex::Key("kvmem", "ns", HashOf(0));
  redisContext* raw = redisConnectUnix(redis_.url().substr(7).c_str());
  ASSERT_TRUE(raw != nullptr && raw->err == 0);
  redisReply* r =
      static_cast<redisReply*>(redisCommand(raw, "SET %b x", foreign.data(), foreign.size()));
  ASSERT_NE(r, nullptr);
  freeReplyObject(r);
  redisFree(raw);
  ClusterIndexConfig c = Config("a:1");
  absl::StatusOr<std::unique_ptr<ClusterIndex>> a = ClusterIndex::Start(c);
  ASSERT_TRUE(a.ok()) << a.status();
  WaitConnected(**a);
  if (HasFatalFailure()) return;
  for (uint32_t i = 0; i < 3; ++i) {
    const prefix::BlockHash h = HashOf(i);
    (*a)->Stored({"ns", nullptr, &h, {}, nullptr});
  }
  metrics::ClusterIndexTotals t = (*a)->counters();
  for (int i = 0; i < 300 && t.added + t.dropped < 3; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    t = (*a)->counters();
  }
  EXPECT_EQ(t.added, 2u);
  EXPECT_GE(t.errors, 1u);
  EXPECT_TRUE(t.connected);
  // The lookup that meets the foreign key says so rather than "nobody".
  for (int i = 0; i < 300 && !(*a)->Lookup("ns", {HashOf(1)}).available; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE((*a)->Lookup("ns", {HashOf(0)}).available);
  const FleetAnswer other = (*a)->Lookup("ns", {HashOf(1)});
  ASSERT_TRUE(other.available) << other.unavailable;
  ASSERT_EQ(other.holders.size(), 1u);
}

}  // namespace
}  // namespace kvmem::service
