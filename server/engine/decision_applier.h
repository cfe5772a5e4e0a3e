#pragma once
// DecisionApplier: turns a policy's keep-sets into an op batch (compaction, merges,
// quantization of blocks that left the recent window), runs it on the backend inside a
// write section and commits it. It owns the point of no return: an error before it changes
// nothing (scores included), one after it poisons the sequence. Runs under the sequence's
// lock.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
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
  // point, also when nothing else changes. Plan, ExecuteMany and Finish in one.
  absl::StatusOr<Applied> Apply(Sequence& seq, const policy::Decision& decision, CommitHook commit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  // One decision between its plan and its commit. When it changes anything, its op batch is
  // planned (its allocations held) and the sequence's write section is open: the point of no
  // return is passed. Destroyed unfinished (an exception), it gives the allocations back and
  // its section poisons the sequence. Lives inside the sequence's lock.
  class Pending {
   public:
    Pending(const Pending&) = delete;
    Pending& operator=(const Pending&) = delete;
    ~Pending();
    // Whether there is a batch to run (else nothing changes but the commit hook's state).
    bool executes() const { return section_.has_value(); }
    const OpBatch& batch() const { return batch_; }

   private:
    friend class DecisionApplier;
    Pending(DecisionApplier* applier, Sequence* seq, const policy::Decision* decision,
            CommitHook commit);
    DecisionApplier* const applier_;
    Sequence* const seq_;
    const policy::Decision* const decision_;
    const CommitHook commit_;
    OpBatch batch_;
    bool settled_ = false;  // the allocations are given back, or the streams own them
    Applied applied_;
    // Stream s replaces its entries [from[s], old_to[s]) by its spare list, which ends up at
    // [from[s], to[s]).
    std::vector<bool> changed_;
    std::vector<size_t> from_, old_to_, to_;
    std::optional<TableVersions::WriteSection> section_;
  };
  // Apply's first half: checks and plans `decision` (which must outlive the Pending) and,
  // when anything changes, opens the write section. An error changes nothing.
  absl::StatusOr<std::unique_ptr<Pending>> Plan(Sequence& seq, const policy::Decision& decision,
                                                CommitHook commit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Runs the batches of pending decisions (several sequences' at once in a StepBatch): all
  // their moves in one backend call, all writes in one, the quantizations in one per
  // format, one synchronization. If anything fails, every batch's allocations are given
  // back (Finish then poisons each sequence). Every sequence is locked by the caller.
  absl::Status ExecuteMany(absl::Span<Pending* const> pending);
  // Apply's second half, given how the batch ran (ExecuteMany's status): commits, or
  // poisons the sequence.
  absl::StatusOr<Applied> Finish(Pending& pending, const absl::Status& executed);

 private:
  store::BlockPool* const pool_;
  store::Backend* const backend_;
  TableVersions* const versions_;
  Telemetry* const telemetry_;
  Failpoints* const failpoints_;
};

}  // namespace kvmem::engine
