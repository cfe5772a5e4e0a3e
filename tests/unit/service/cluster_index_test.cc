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
  FleetAnswer first = (*index)->Lookup("ns", {h});
  EXPECT_FALSE(first.available);
  EXPECT_TRUE(absl::StrContains(first.unavailable, "did not answer")) << first.unavailable;
  // The next one within a second does not even try.
  FleetAnswer second = (*index)->Lookup("ns", {h});
  EXPECT_FALSE(second.available);
  EXPECT_TRUE(absl::StrContains(second.unavailable, "less than a second ago"))
      << second.unavailable;
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  EXPECT_TRUE((*index)->Lookup("ns", {}).available);  // nothing to ask
  metrics::ClusterIndexTotals t = (*index)->counters();
  EXPECT_EQ(t.lookups, 3u);
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

// Writers (the prefix index's events, from several threads as sequences publish and the
// reclaimer drops) and lookups at once; what Redis ends up naming is what was published and
// not removed, and a stopped node's claims are gone.
TEST(ClusterIndex, ClaimsFollowTheEventsUnderConcurrentLookups) {
  testing::RedisServer redis;
  if (!redis.Start()) {
    if (std::getenv("KVMEM_CI") != nullptr) FAIL() << "redis-server did not start";
    GTEST_SKIP() << "no redis-server";
  }
  ClusterIndexConfig c;
  c.url = redis.url();
  c.node = "a:1";
  c.timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<ClusterIndex>> a = ClusterIndex::Start(c);
  ASSERT_TRUE(a.ok()) << a.status();
  c.node = "b:1";
  absl::StatusOr<std::unique_ptr<ClusterIndex>> b = ClusterIndex::Start(c);
  ASSERT_TRUE(b.ok()) << b.status();
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
  for (int i = 0; i < 1000 && (*a)->counters().added + (*a)->counters().removed < 6 * kPerThread;
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
TEST(ClusterIndex, AuthenticatesWithThePasswordFromTheEnvironment) {
  testing::RedisServer redis;
  if (!redis.Start({"--requirepass", "p4ss"})) {
    if (std::getenv("KVMEM_CI") != nullptr) FAIL() << "redis-server did not start";
    GTEST_SKIP() << "no redis-server";
  }
  ClusterIndexConfig c;
  c.url = redis.url();
  c.node = "a:1";
  c.timeout = absl::Seconds(2);
  const prefix::BlockHash h = HashOf(1);
  {
    absl::StatusOr<std::unique_ptr<ClusterIndex>> index = ClusterIndex::Start(c);
    ASSERT_TRUE(index.ok()) << index.status();
    const FleetAnswer answer = (*index)->Lookup("ns", {h});
    EXPECT_FALSE(answer.available);
    EXPECT_TRUE(absl::StrContains(answer.unavailable, "NOAUTH")) << answer.unavailable;
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

}  // namespace
}  // namespace kvmem::service
