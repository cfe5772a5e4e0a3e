#pragma once
// BatchRunner: a StepBatch, the decode loop's call. Each entry appends its new token(s) and
// steps, on one locked sequence, and answers the update of the client's held table under
// that lock. Entries name different sequences (a sequence named twice fails the whole batch
// and nothing runs) and run across cores; one entry's error never affects another's. An
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
  // `parallel`: entries run on every core oneTBB has; else one after another.
  BatchRunner(const AppendRooms* rooms, SequenceRegistry* registry, PolicyDriver* driver,
              bool parallel)
      : rooms_(rooms), registry_(registry), driver_(driver), parallel_(parallel) {}

  absl::StatusOr<std::vector<StepOutcome>> Run(absl::Span<const StepCall> calls);

 private:
  StepOutcome RunOne(const StepCall& call);

  const AppendRooms* const rooms_;
  SequenceRegistry* const registry_;
  PolicyDriver* const driver_;
  const bool parallel_;
};

}  // namespace kvmem::engine
