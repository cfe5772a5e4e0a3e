#pragma once
// ClusterIndex: the prefix blocks this kvmemd holds, announced in a Redis/Valkey index the
// fleet shares (--cluster-index), so that Lookup can say which nodes hold the longest
// prefix of a prompt across machines (a router sends the request there).
//
// Data model (one sorted set per block, its members the nodes that hold it):
//   key    <prefix>:<namespace tag>:<block hash, hex>   (tag: 16 hex digits of the
//          namespace's sha256; the namespace names model, layout and precision)
//   member the node's address (--cluster-node-address), score the time in ms, by Redis's
//          clock (TIME, read at each connection: nodes' clocks may disagree, Redis's is
//          one), at which the node's claim lapses unless renewed.
// A node adds a member when the prefix index publishes a block (IndexEvents::Stored),
// removes it when the block is reclaimed, and renews every claim it holds every third of
// the TTL; a node that dies stops renewing and its claims lapse within the TTL (readers
// ignore lapsed members, renewals trim them, the key expires a TTL after its last renewal:
// every node of a fleet must use the same TTL).
// Tenants: a chain's first block hashes the tenant-scoped cache salt, so two tenants'
// blocks of the same tokens have different keys, and a tenant's Lookup only ever names
// hashes of its own chains (the service hashes the prompt with the caller's salt, and a
// daemon without tokens refuses salts that begin as tenants' do).
//
// Failure: the index never blocks a request. Events are queued under the prefix index's
// lock as fixed-size records and written by a thread of the index's own, which also opens
// every connection (name resolution included); while Redis is unreachable they are applied
// to this node's own claims (the mirror) and counted as dropped, and on reconnect the mirror
// is written whole (a renewal). Removals missed meanwhile lapse within the TTL. A full
// queue loses events: the mirror is then rebuilt from the prefix index itself (the
// snapshot) and Redis told the difference. Lookup uses a connection the writer opened (one
// call at a time each), waits at most `timeout` for the whole answer, and else answers
// "unavailable"; an error reply makes it unavailable too, never "nobody holds it".
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/telemetry.h"
#include "server/metrics/exporter.h"
#include "server/prefix/index_events.h"

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
  // Blocks this node claims at most (the mirror, 48 bytes each; a renewal of a million
  // takes about 3.5 s on a unix socket, a ninth of the default TTL).
  size_t max_entries = size_t{1} << 20;
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
  // Every block the prefix index holds now, by namespace (a loss of events rebuilds the
  // claims from it). Called on the writer's thread, never under the cluster index's lock.
  using Snapshot =
      std::function<std::vector<std::pair<std::string, std::vector<prefix::BlockHash>>>()>;

  // Checks the configuration (an error names the flag) and starts the writer thread; Redis
  // need not be up yet (the writer connects, and reconnects, by itself).
  static absl::StatusOr<std::unique_ptr<ClusterIndex>> Start(ClusterIndexConfig config,
                                                             Snapshot snapshot = nullptr);
  // Withdraws this node's claims when connected (bounded by the writer's timeout).
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
  using Clock = std::chrono::steady_clock;
  using Tag = std::array<uint8_t, 8>;
  // A claim as queued and kept: the namespace's tag and the block's hash (no allocation).
  struct Claim {
    Tag tag{};
    prefix::BlockHash hash{};
    bool operator==(const Claim& o) const { return tag == o.tag && hash == o.hash; }
    template <typename H>
    friend H AbslHashValue(H h, const Claim& c) {
      return H::combine(std::move(h), c.tag, c.hash);
    }
  };
  struct Op {
    bool add = false;
    Claim claim;
  };
  struct Connection;  // one Redis connection and the offset of Redis's clock
  struct LookupSlot;

  ClusterIndex(ClusterIndexConfig config, RedisAddress address, Snapshot snapshot);
  static bool TagOf(absl::string_view ns, Tag* tag);
  std::string KeyOf(const Claim& claim) const;
  // Queues a claim (add) or its withdrawal; never blocks on Redis, never throws.
  void Note(bool add, absl::string_view ns, const prefix::BlockHash& hash) noexcept;
  // Events lost (a full queue, no memory): the writer rebuilds the claims from the snapshot.
  void LoseLocked(size_t events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  // The writer's connection, opened if missing and due; false while Redis is unreachable.
  bool Connected(Clock::time_point now);
  // Opens the lookups' missing connections (while the writer's works).
  void OpenLookupConnections();
  // The claims rebuilt from the snapshot after a loss; Redis told the difference in `ops`.
  bool Rebuild(std::vector<Op>* ops);
  // Sends `ops` (pipelined); false (and the connection dropped) on an I/O failure; an
  // error reply fails its own claim only (counted).
  bool Write(absl::Span<const Op> ops);
  bool Renew();
  void Fail(std::unique_ptr<Connection>& connection, absl::string_view what);

  const ClusterIndexConfig config_;
  const RedisAddress address_;
  const Snapshot snapshot_;
  mutable absl::Mutex mu_;
  std::vector<Op> queue_ ABSL_GUARDED_BY(mu_);
  bool lost_ ABSL_GUARDED_BY(mu_) = false;  // events were lost: rebuild the claims
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);  // the writer's, for lookups' answers
  absl::CondVar wake_;
  // Namespace tags already computed (a daemon serves a few namespaces).
  absl::flat_hash_map<std::string, Tag> tags_ ABSL_GUARDED_BY(mu_);
  // The writer thread's own.
  std::unique_ptr<Connection> writer_;
  Clock::time_point retry_at_{};
  Clock::time_point renew_at_{};
  bool rebuild_ = false;               // a loss seen, not yet rebuilt
  absl::flat_hash_set<Claim> mirror_;  // what this node claims
  // Lookups'.
  std::vector<std::unique_ptr<LookupSlot>> slots_;
  // Counters.
  std::atomic<uint64_t> added_{0}, removed_{0}, renewed_{0}, dropped_{0}, errors_{0};
  std::atomic<uint64_t> lookups_answered_{0}, lookups_unavailable_{0}, entries_{0};
  std::atomic<bool> connected_{false};
  std::atomic<double> last_renewal_seconds_{0};
  engine::Histogram write_seconds_, lookup_seconds_;
  std::thread thread_;
};

}  // namespace kvmem::service
