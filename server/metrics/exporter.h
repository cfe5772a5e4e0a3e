#pragma once
// /metrics for Prometheus: every figure is read from its one source when scraped (the
// engine's Stats and Telemetry, the service's RpcTelemetry), so kvmemctl stats and /metrics
// never disagree. Names follow Prometheus's conventions: kvmem_ prefix, base units,
// _total on counters, counters instead of ratios; labels are bounded (policies, methods,
// codes, precisions, states; never sequence ids).
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/engine/engine.h"
#include "server/metrics/rpc_telemetry.h"

namespace prometheus {
class Exposer;
}

namespace kvmem::metrics {

struct BuildInfo {
  std::string version;
  std::string backend;  // cpu | cuda
  std::string device;
};

// The families, built from the sources at each call.
// What kvmemd's KV events publisher (service/kv_events.h) has done, when one runs.
struct KvEventTotals {
  uint64_t batches = 0, events = 0, dropped = 0, replay_requests = 0;
};

// What kvmemd's share of the fleet's prefix index (service/cluster_index.h) has done.
struct ClusterIndexTotals {
  uint64_t added = 0;    // claims written (new blocks)
  uint64_t removed = 0;  // claims withdrawn
  uint64_t renewed = 0;  // claims renewed
  uint64_t dropped = 0;  // updates not written: Redis unreachable, a full queue, the bound
  uint64_t errors = 0;   // Redis connections lost or refused, error replies
  uint64_t lookups_answered = 0;
  uint64_t lookups_unavailable = 0;
  uint64_t entries = 0;  // blocks this node announces now
  bool connected = false;
  double last_renewal_seconds = 0;             // the last renewal of every claim, sent and answered
  engine::Histogram::Snapshot write_seconds;   // a pipeline of updates, sent and answered
  engine::Histogram::Snapshot lookup_seconds;  // a fleet lookup, answered or not
};

// Bytes a transfer from another kvmemd read, by how they came: copied out of the peer's
// pool mapped here (the same host), UCX gets, gRPC messages.
struct PeerBytes {
  uint64_t attach = 0, ucx = 0, grpc = 0;
};

// PeerBytes as the transfers add to them, from any thread.
class PeerByteCounter {
 public:
  // `transport`: "attach", "ucx", else gRPC's.
  void Add(absl::string_view transport, uint64_t bytes) {
    (transport == "attach" ? attach_ : (transport == "ucx" ? ucx_ : grpc_))
        .fetch_add(bytes, std::memory_order_relaxed);
  }
  PeerBytes Read() const {
    return {attach_.load(std::memory_order_relaxed), ucx_.load(std::memory_order_relaxed),
            grpc_.load(std::memory_order_relaxed)};
  }

 private:
  std::atomic<uint64_t> attach_{0}, ucx_{0}, grpc_{0};
};

// What PullPrefix (service/prefix_pull.h) has done.
struct PullTotals {
  uint64_t pulled = 0;                  // pulls that added a prefix here
  uint64_t nothing = 0;                 // pulls that found nothing more to pull
  uint64_t failed = 0;                  // pulls that failed (the holder, the index, limits)
  uint64_t tokens = 0;                  // tokens pulled and published here
  PeerBytes bytes;                      // K+V bytes read from holders
  engine::Histogram::Snapshot seconds;  // a pull, whatever its end
};

// What MoveSequence has done (service/sequence_move.h): moves into this node.
struct MoveTotals {
  uint64_t moved = 0;                   // sequences moved here
  uint64_t failed = 0;                  // moves that failed (the holder, a check, a limit)
  uint64_t unreleased = 0;              // moved, but the holder's answer to its release was lost
  PeerBytes bytes;                      // block bytes moved here
  engine::Histogram::Snapshot seconds;  // a move, whatever its end
};

// What kvmemd's UCX worker (transport/ucx_plane.h) has taken in: remote appends' payloads.
// (Remote reads are one-sided RMA gets that kvmemd does not see.)
struct UcxTotals {
  uint64_t landed = 0, landed_bytes = 0;
  uint64_t dropped = 0;                 // messages no call took
  uint64_t failed = 0;                  // announced payloads that did not land
  uint64_t receiving = 0, held = 0;     // now: receives in flight, messages held
  engine::Histogram::Snapshot seconds;  // announcement to landed
};

class Collector final : public prometheus::Collectable {
 public:
  Collector(engine::Engine* engine, const RpcTelemetry* rpc, BuildInfo build)
      : engine_(engine), rpc_(rpc), build_(std::move(build)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;
  // Where the KV events' counters are read at each scrape (unset: all 0). Set before the
  // collector is shared.
  void set_kv_events(std::function<KvEventTotals()> read) { kv_events_ = std::move(read); }
  // The same for PullPrefix (unset: all 0).
  void set_pulls(std::function<PullTotals()> read) { pulls_ = std::move(read); }
  // The same for MoveSequence (unset: all 0).
  void set_moves(std::function<MoveTotals()> read) { moves_ = std::move(read); }
  // The same for the UCX worker (unset: all 0).
  void set_ucx(std::function<UcxTotals()> read) { ucx_ = std::move(read); }
  // The same for the cluster index (unset: all 0).
  void set_cluster_index(std::function<ClusterIndexTotals()> read) {
    cluster_index_ = std::move(read);
  }

 private:
  engine::Engine* const engine_;
  const RpcTelemetry* const rpc_;
  const BuildInfo build_;
  std::function<KvEventTotals()> kv_events_;
  std::function<ClusterIndexTotals()> cluster_index_;
  std::function<PullTotals()> pulls_;
  std::function<MoveTotals()> moves_;
  std::function<UcxTotals()> ucx_;
};

// The text a scrape returns (for tests and kvmemctl-free checks).
std::string Render(const Collector& collector);

class Exporter {
 public:
  // Serves /metrics on `listen` ("host:port"; port 0 picks one).
  static absl::StatusOr<std::unique_ptr<Exporter>> Start(const std::string& listen,
                                                         std::shared_ptr<Collector> collector);
  ~Exporter();
  int port() const { return port_; }

 private:
  Exporter() = default;
  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace kvmem::metrics
