#pragma once
// ClusterIndex: the prefix blocks this kvmemd holds, announced in a Redis/Valkey index the
// fleet shares (--cluster-index), so that Lookup can say which nodes hold the longest
// prefix of a prompt across machines (a router sends the request there).
//
// Data model (one sorted set per block, its members the nodes that hold it):
//   key    <prefix>:<namespace tag>:<block hash, hex>   (tag: 16 hex digits of the
//          namespace's sha256; the namespace names model, layout and precision)
//   member the node's address (--cluster-node-address), score the Unix time in ms at which
//          the node's claim lapses unless renewed.
// A node adds a member when the prefix index publishes a block (IndexEvents::Stored),
// removes it when the block is reclaimed, and renews every claim it holds every third of
// the TTL; a node that dies stops renewing and its claims lapse within the TTL (readers
// ignore lapsed members, renewals trim them, the key expires with its last claim).
// Tenants: a chain's first block hashes the tenant-scoped cache salt, so two tenants'
// blocks of the same tokens have different keys, and a tenant's Lookup only ever names
// hashes of its own chains (the service hashes the prompt with the caller's salt).
//
// Failure: the index never blocks a request. Events are queued under the prefix index's
// lock and written by a thread of the index's own; while Redis is unreachable they are
// applied to this node's own list (the mirror) and counted as dropped, and on reconnect
// the mirror is written whole (a renewal). Removals missed meanwhile lapse within the TTL.
// A full queue loses events: the mirror is then withdrawn from Redis and forgotten (a
// router forgets rather than believes blocks that may be gone). Lookup waits at most
// `timeout` on a connection of its own (a few, each used by one call at a time; one that
// failed is retried after a second), else answers "unavailable".
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/telemetry.h"
#include "server/metrics/exporter.h"
#include "server/prefix/index_events.h"

struct redisContext;

namespace kvmem::service {

// redis://[:password@]host[:port][/db] or unix://path (a socket, ?db=N allowed).
struct RedisAddress {
  std::string host;
  int port = 6379;
  std::string unix_path;  // set: a unix socket instead of host:port
  std::string password;
  int db = 0;
};
absl::StatusOr<RedisAddress> ParseRedisUrl(absl::string_view url);

struct ClusterIndexConfig {
  std::string url;   // --cluster-index
  std::string node;  // --cluster-node-address: how routers and peers reach this kvmemd
  absl::Duration ttl = absl::Seconds(30);
  absl::Duration timeout = absl::Milliseconds(50);  // a Lookup's wait for the index
  std::string key_prefix = "kvmem";
  size_t max_queued_events = 100000;
  size_t max_entries = size_t{1} << 22;  // blocks this node announces at most (the mirror)
  size_t lookup_connections = 4;
};

struct FleetHolder {
  std::string node;
  uint64_t blocks = 0;  // the longest prefix of the chain the node holds, in blocks
};

struct FleetAnswer {
  bool available = false;
  std::string unavailable;           // why not, when not
  std::vector<FleetHolder> holders;  // longest first, then by node
};

class ClusterIndex final : public prefix::IndexEvents {
 public:
  // Checks the configuration (an error names the flag) and starts the writer thread; Redis
  // need not be up yet (the writer connects, and reconnects, by itself).
  static absl::StatusOr<std::unique_ptr<ClusterIndex>> Start(ClusterIndexConfig config);
  // Withdraws this node's claims (best effort, bounded by the writer's timeout).
  ~ClusterIndex() override;
  ClusterIndex(const ClusterIndex&) = delete;
  ClusterIndex& operator=(const ClusterIndex&) = delete;

  void Stored(const prefix::StoredBlock& block) noexcept override;
  void Removed(absl::string_view ns, const prefix::BlockHash& hash) noexcept override;

  // Which nodes hold how much of `chain` (a prompt's block hashes in `ns`, in order).
  FleetAnswer Lookup(absl::string_view ns, absl::Span<const prefix::BlockHash> chain);

  metrics::ClusterIndexTotals counters() const;
  // The key of a block (exposed for tests).
  static std::string Key(absl::string_view key_prefix, absl::string_view ns,
                         const prefix::BlockHash& hash);
  // Blocks a Lookup asks about at most (a longer chain is cut there).
  static constexpr size_t kMaxLookupBlocks = 8192;
  // Holders a lookup reads of each block at most (a fleet's nodes; bounds a reply).
  static constexpr size_t kMaxHolders = 1024;

 private:
  struct Op {
    bool add = false;
    std::string key;
  };
  struct Connection;  // one Redis connection and what it was told (AUTH, SELECT)
  struct LookupSlot;

  ClusterIndex(ClusterIndexConfig config, RedisAddress address);
  // Queues a claim (add) or its withdrawal; never blocks, never throws.
  void Note(bool add, absl::string_view ns, const prefix::BlockHash& hash) noexcept;
  // Events lost (a full queue, no memory): the queue goes too, and the writer forgets.
  void LoseLocked(size_t events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  // The writer's connection, made if missing and due; false while Redis is unreachable.
  bool Connected(absl::Time now);
  // Sends `ops` (pipelined); false (and the connection dropped) on any failure.
  bool Write(absl::Span<const Op> ops, uint64_t* added, uint64_t* removed);
  bool Renew();
  void Fail(std::unique_ptr<Connection>& connection, absl::string_view what);

  const ClusterIndexConfig config_;
  const RedisAddress address_;
  mutable absl::Mutex mu_;
  std::vector<Op> queue_ ABSL_GUARDED_BY(mu_);
  bool lost_ ABSL_GUARDED_BY(mu_) = false;  // events were lost: forget the mirror
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar wake_;
  // The writer thread's own.
  std::unique_ptr<Connection> writer_;
  absl::Time retry_at_ = absl::InfinitePast();
  absl::Time renew_at_ = absl::InfinitePast();
  absl::flat_hash_set<std::string> mirror_;  // the keys this node claims
  // Lookups'.
  std::vector<std::unique_ptr<LookupSlot>> slots_;
  std::atomic<int64_t> lookup_retry_at_ns_{0};  // before it, lookups do not try
  // Counters.
  std::atomic<uint64_t> added_{0}, removed_{0}, renewed_{0}, dropped_{0}, errors_{0};
  std::atomic<uint64_t> lookups_{0}, lookups_unavailable_{0}, entries_{0};
  std::atomic<bool> connected_{false};
  std::atomic<double> last_renewal_seconds_{0};
  engine::Histogram write_seconds_, lookup_seconds_;
  std::thread thread_;
};

}  // namespace kvmem::service
