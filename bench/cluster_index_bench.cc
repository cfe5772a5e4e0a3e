// The fleet's shared prefix index (service/cluster_index.h) against a redis-server of its
// own on a unix socket: how fast one node announces blocks, how long renewing all of its
// claims takes, and what a fleet Lookup costs for prompts of 8 to 512 blocks (the blocks a
// 128- to 8,192-token prompt has at 16 tokens a block), with the same lookups answered by
// the node's own prefix index in the same run for scale.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "server/prefix/prefix_index.h"
#include "server/service/cluster_index.h"
#include "server/store/block_pool.h"
#include "tests/testing/redis_server.h"

ABSL_FLAG(uint32_t, blocks, 100000, "blocks the node announces");
ABSL_FLAG(uint32_t, lookups, 2000, "lookups per prompt length");

namespace {

using kvmem::prefix::BlockHash;

BlockHash HashOf(uint32_t n) {
  BlockHash h{};
  for (size_t i = 0; i < 4; ++i) h[i] = static_cast<uint8_t>(n >> (8 * i));
  h[31] = 0x5a;
  return h;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint32_t n = absl::GetFlag(FLAGS_blocks);
  const uint32_t lookups = absl::GetFlag(FLAGS_lookups);
  kvmem::testing::RedisServer redis;
  if (!redis.Start()) {
    std::fprintf(stderr, "cluster_index_bench: no redis-server (scripts/deps.sh installs it)\n");
    return 1;
  }
  kvmem::service::ClusterIndexConfig config;
  config.url = redis.url();
  config.node = "bench-node:7000";
  config.timeout = absl::Seconds(5);
  config.ttl = absl::Seconds(3);  // a renewal every second: one to time
  absl::StatusOr<std::unique_ptr<kvmem::service::ClusterIndex>> index =
      kvmem::service::ClusterIndex::Start(config);
  if (!index.ok()) {
    std::fprintf(stderr, "%s\n", std::string(index.status().message()).c_str());
    return 1;
  }
  kvmem::service::ClusterIndex& fleet = **index;
  // The node's own index holds the same blocks (one pool block each), for scale.
  std::unique_ptr<kvmem::store::BlockPool> pool =
      *kvmem::store::BlockPool::Create(uint64_t{n + 64} * 4096, 4096);
  kvmem::prefix::PrefixIndex local(pool.get());
  std::vector<BlockHash> hashes(n);
  for (uint32_t i = 0; i < n; ++i) hashes[i] = HashOf(i);

  const absl::Time start = absl::Now();
  for (uint32_t i = 0; i < n; ++i) {
    fleet.Stored({"bench", i == 0 ? nullptr : &hashes[i - 1], &hashes[i], {}, nullptr});
  }
  while (fleet.counters().added + fleet.counters().dropped < n) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const double announce = absl::ToDoubleSeconds(absl::Now() - start);
  // A renewal of all n claims starts within a second of the last; wait for one to finish.
  const uint64_t renewed_before = fleet.counters().renewed;
  while (fleet.counters().renewed < renewed_before + n) absl::SleepFor(absl::Milliseconds(5));
  const kvmem::metrics::ClusterIndexTotals t = fleet.counters();
  std::printf("cluster index on redis-server (unix socket), one node, %u blocks\n", n);
  std::printf("announce: %.3f s (%.0f claims/s, %llu dropped); renewal of all claims: %.3f s\n",
              announce, n / announce, static_cast<unsigned long long>(t.dropped),
              t.last_renewal_seconds);

  for (uint32_t i = 0; i < n; ++i) {
    std::vector<kvmem::store::BlockId> block;
    if (pool->AllocateMany(4096, 1, &block).ok()) {
      local.Publish("bench", i == 0 ? nullptr : &hashes[i - 1], hashes[i], block);
      pool->Unref(block);
    }
  }
  std::printf(
      "| prompt blocks | fleet lookup p50 (us) | p99 (us) | holders found | local Match p50 "
      "(us) |\n|---|---|---|---|---|\n");
  for (size_t length : {8, 64, 512}) {
    std::vector<double> remote, own;
    size_t found = 0;
    for (uint32_t q = 0; q < lookups; ++q) {
      const size_t first = (q * 7919u) % (n - length);
      const absl::Span<const BlockHash> chain(hashes.data() + first, length);
      absl::Time t0 = absl::Now();
      const kvmem::service::FleetAnswer answer = fleet.Lookup("bench", chain);
      remote.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (answer.available && !answer.holders.empty() && answer.holders[0].blocks == length) {
        ++found;
      }
      t0 = absl::Now();
      (void)local.Match("bench", chain);
      own.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    std::printf("| %zu | %.1f | %.1f | %zu / %u | %.2f |\n", length, Percentile(remote, 0.5),
                Percentile(remote, 0.99), found, lookups, Percentile(own, 0.5));
  }
  // A long prompt the fleet holds only the start of (a shared system prompt, then the
  // user's own text): the rounds stop after the last block anybody holds.
  std::vector<double> partial;
  for (uint32_t q = 0; q < lookups; ++q) {
    const size_t first = (q * 7919u) % (n - 16);
    std::vector<BlockHash> chain(hashes.begin() + first, hashes.begin() + first + 16);
    for (uint32_t i = 0; i < 496; ++i) chain.push_back(HashOf(n + 1 + i));
    const absl::Time t0 = absl::Now();
    (void)fleet.Lookup("bench", chain);
    partial.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  std::printf("512 blocks, the first 16 held: fleet lookup p50 %.1f us, p99 %.1f us\n",
              Percentile(partial, 0.5), Percentile(partial, 0.99));
  return 0;
}
