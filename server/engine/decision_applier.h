#pragma once
// DecisionApplier: turns a policy's keep-sets into an op batch (compaction, merges,
// quantization of blocks that left the recent window), runs it on the backend inside a
// write section and commits it. It owns the point of no return: an error before it changes
// nothing (scores included), one after it poisons the sequence. Runs under the sequence's
// lock.
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/engine/failpoints.h"
#include "server/engine/sequence.h"
#include "server/engine/stream_planner.h"
#include "server/engine/table_versions.h"
#include "server/engine/telemetry.h"
#include "server/policy/policy.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// After a commit interrupted past its point of no return: moves the references the
// sequence holds but no stream names (old blocks of committed streams, new blocks of the
// rest) to the sequence's orphans, which Release drops. Streams [0, swapped) hold their new
// entries in [from[s], to[s]) (the whole list when `from`/`to` are empty) and
// other_lists[s] the old ones; the rest still hold the old list.
void KeepOrphans(Sequence& seq, const OpBatch& batch,
                 const std::vector<std::vector<StreamBlock>>& other_lists, size_t swapped,
                 const std::vector<size_t>& from = {}, const std::vector<size_t>& to = {})
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

class DecisionApplier {
 public:
  DecisionApplier(store::BlockPool* pool, store::Backend* backend, TableVersions* versions,
                  Telemetry* telemetry, Failpoints* failpoints)
      : pool_(pool),
        backend_(backend),
        versions_(versions),
        telemetry_(telemetry),
        failpoints_(failpoints) {}

  struct Applied {
    uint64_t evicted = 0;    // stream slots
    uint64_t quantized = 0;  // stream slots
  };
  // Runs at the commit point, before the keep-sets compact the per-slot vectors: applies
  // the policy's staged state. Must not fail for a reason a retry could fix.
  using CommitHook = std::function<absl::Status()>;

  // Applies `decision` and bumps the epoch if anything changed; `commit` runs at the commit
  // point, also when nothing else changes.
  absl::StatusOr<Applied> Apply(Sequence& seq, const policy::Decision& decision,
                                const CommitHook& commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Runs a planned batch on the backend; gives its allocations back if it fails.
  absl::Status Execute(const Sequence& seq, OpBatch& batch) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

 private:
  store::BlockPool* const pool_;
  store::Backend* const backend_;
  TableVersions* const versions_;
  Telemetry* const telemetry_;
  Failpoints* const failpoints_;
};

}  // namespace kvmem::engine
