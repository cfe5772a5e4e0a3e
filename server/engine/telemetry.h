#pragma once
// What the engine counts and times as it works, per policy: the one source of the figures
// that Stats (kvmemctl) and /metrics (server/metrics) both report. Fixed at construction
// (one entry per registered policy, so labels stay bounded), then lock-free: counters and
// histogram buckets are atomics that calls on any thread add to.
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "server/common/keep_set.h"

namespace kvmem::engine {

// A histogram with fixed upper bounds (Prometheus's `le`, +Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // per bucket, not cumulative; one more than bounds (+Inf)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<uint64_t> sum_bits_{0};  // a double, added by compare-and-swap
};

// A counter of fractional units (tokens evicted: stream slots over a sequence's streams).
class FractionalCounter {
 public:
  void Add(double value);
  double Read() const;

 private:
  std::atomic<uint64_t> bits_{0};
};

// Bucket bounds shared by Stats readers and tests.
std::vector<double> LatencyBounds();  // seconds, 10 us .. 10 s
std::vector<double> UnitBounds();     // 0..1 in 0.05 steps (confidence)
std::vector<double> MassBounds();     // 0..1, fine near 0 (attention mass)
std::vector<double> BudgetBounds();   // tokens, powers of two 16 .. 1M

// Where a step's scoring and selection ran.
enum class StepSite { kHost = 0, kDevice = 1 };

struct PolicyTelemetry {
  PolicyTelemetry();
  std::string policy;
  std::atomic<uint64_t> tokens_appended{0};  // positions, whatever the stream count
  std::atomic<uint64_t> stream_slots_evicted{0};
  std::atomic<uint64_t> stream_slots_quantized{0};
  FractionalCounter tokens_evicted;       // stream slots / the sequence's streams
  FractionalCounter tokens_quantized;     // likewise
  std::array<Histogram, 2> step_seconds;  // by StepSite
  Histogram append_seconds;
  Histogram compress_seconds;
  Histogram confidence;
  Histogram budget_tokens;
  // Per step: the current attention row's weight over the slots the step evicted, and
  // over the slots held quantized, each summed per stream and averaged over the streams.
  Histogram evicted_attention_mass;
  Histogram quantized_attention_mass;
};

class Telemetry {
 public:
  explicit Telemetry(const std::vector<std::string>& policies);
  // The policy's entry; null for a name that was not registered.
  PolicyTelemetry* For(std::string_view policy) const;
  const std::vector<std::unique_ptr<PolicyTelemetry>>& policies() const { return policies_; }

  // Engine-wide counts, every policy together.
  std::atomic<uint64_t> sequences_created{0};
  std::atomic<uint64_t> tokens_appended{0};
  std::atomic<uint64_t> stream_slots_evicted{0};
  std::atomic<uint64_t> stream_slots_quantized{0};
  std::atomic<uint64_t> bytes_moved{0};  // compaction, merges, copy-on-write
  std::atomic<uint64_t> steps{0};
  std::atomic<uint64_t> leases_expired{0};
  std::atomic<uint64_t> sequences_poisoned{0};
  // Blocks a move's receiver kept out of circulation for good (a get abandoned in flight
  // might still write into them: SequenceImport::Forsake), and their pool bytes.
  std::atomic<uint64_t> blocks_forsaken{0};
  std::atomic<uint64_t> bytes_forsaken{0};

 private:
  std::vector<std::unique_ptr<PolicyTelemetry>> policies_;      // in registration order
  absl::flat_hash_map<std::string, PolicyTelemetry*> by_name_;  // every call looks one up
};

// Attention mass of a step for one stream: the weight `row` puts on the slots `keep` (the
// slots that stay) leaves out. Slots past the row are ignored. Costs the slots left out and
// one step per run of kept slots.
double EvictedMass(absl::Span<const float> row, const KeepSet& keep);

}  // namespace kvmem::engine
