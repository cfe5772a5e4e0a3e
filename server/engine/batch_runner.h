#pragma once
// BatchRunner: a StepBatch, the decode loop's call. Each entry appends its new token(s) and
// steps, on one locked sequence, and answers the update of the client's held table under
// that lock. Entries name different sequences (a sequence named twice fails the whole batch
// and nothing runs) and run across cores, or, on a backend whose slot states step together,
// with their kernel steps batched; one entry's error never affects another's. An
// entry's append and step are each atomic: a step that fails after its append applied
// leaves the append applied.
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/engine/append_session.h"
#include "server/engine/engine_types.h"
#include "server/engine/policy_driver.h"
#include "server/engine/sequence_registry.h"
#include "server/engine/table_versions.h"

namespace kvmem::engine {

class BatchRunner {
 public:
  // `parallel`: entries run on every core oneTBB has; else one after another. `batched`:
  // the slot-state halves of the entries' kernel steps run as one batch (PolicyDriver::
  // StageKernelSteps: one upload, two launches, one download and one wait per CUDA
  // device), the rest of each entry on the calling thread, with every entry's sequence
  // locked from its append to its update (the locks taken in the order of sequence ids).
  BatchRunner(const AppendRooms* rooms, SequenceRegistry* registry, PolicyDriver* driver,
              bool parallel, bool batched)
      : rooms_(rooms),
        registry_(registry),
        driver_(driver),
        parallel_(parallel),
        batched_(batched) {}

  absl::StatusOr<std::vector<StepOutcome>> Run(absl::Span<const StepCall> calls);

 private:
  struct Entry;  // one StepCall on its way through the phases below
  StepOutcome RunOne(const StepCall& call);
  std::vector<StepOutcome> RunBatched(absl::Span<const StepCall> calls);
  // The checks that need no sequence: false when the entry is answered already.
  bool Admit(const StepCall& call, StepOutcome* out) const;
  // On the locked sequence: the append's session opened (on the thread that took the lock:
  // a session that cannot begin drops it; e.seq is set when the entry goes on).
  void Open(Entry& e);
  // Then the append staged, the step's signals checked, the append committed (in a batch:
  // prepared, its commit left to RunBatched).
  void Begin(Entry& e);
  void CommitAppend(Entry& e);
  // The step up to its op batch (its slot-state half run here, or `staged`), for a batch.
  void BeginStep(Entry& e, PolicyDriver::Staged* staged);
  // The step (whole, or its end given how the batch's op batches ran: `executed`), the next
  // plan, the update.
  void Finish(Entry& e, const absl::Status* executed);

  const AppendRooms* const rooms_;
  SequenceRegistry* const registry_;
  PolicyDriver* const driver_;
  const bool parallel_;
  const bool batched_;
};

}  // namespace kvmem::engine
