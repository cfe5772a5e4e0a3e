#pragma once
// PolicyDriver: runs a sequence's policy on checked signals (input_checks.h) and applies its
// decision. Host policies read the committed state and stage the next, which becomes the
// sequence's only when the whole call applies (DecisionApplier's commit hook); a policy
// with a kernel step scores and selects in the sequence's SlotState (device memory on a
// GPU), which stages the step until its commit. Runs under the sequence's lock.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/engine/decision_applier.h"
#include "server/engine/engine_types.h"
#include "server/engine/failpoints.h"
#include "server/engine/host_budget.h"
#include "server/engine/input_checks.h"
#include "server/engine/sequence.h"
#include "server/engine/sequence_registry.h"
#include "server/engine/table_versions.h"
#include "server/engine/telemetry.h"
#include "server/policy/policy.h"

namespace kvmem::engine {

class PolicyDriver {
 public:
  PolicyDriver(DecisionApplier* applier, TableVersions* versions, HostBudget* budget,
               const SequenceRegistry* registry, Telemetry* telemetry, Failpoints* failpoints)
      : applier_(applier),
        versions_(versions),
        budget_(budget),
        registry_(registry),
        telemetry_(telemetry),
        failpoints_(failpoints) {}

  // One decode step: scores, selection, eviction and quantization, whole or not at all
  // (past the point of no return: poisoned). Counts the step and renews the lease.
  absl::StatusOr<StepResult> Step(Sequence& seq, const CheckedStep& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // An explicit compression by the policy's rule (`target_tokens` > 0: to that many per
  // stream), on the host also for a sequence whose scores live in a SlotState.
  absl::StatusOr<CompressResult> Compress(Sequence& seq, const CheckedCompress& signals,
                                          uint32_t target_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

 private:
  using Applied = DecisionApplier::Applied;
  policy::CallContext Context(const Sequence& seq) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // StreamStates over the committed state, with next_scores staged per stream and the
  // history of the policy's width.
  std::vector<policy::StreamState> StagedStreamStates(Sequence& seq)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The commit hook of a host policy call: takes the staged scores, the mark, and (Step)
  // records `rows` in the history.
  DecisionApplier::CommitHook CommitPolicyState(Sequence& seq, const policy::Decision& decision,
                                                const std::vector<absl::Span<const float>>* rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // A step of a policy with a kernel step: scores and selection in the SlotState, then the
  // K/V rows move as for any decision.
  absl::StatusOr<Applied> KernelStep(Sequence& seq, const policy::CallContext& ctx,
                                     absl::Span<const absl::Span<const float>> rows,
                                     policy::Decision* decision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The mean over streams of the weight the step's rows put on quantized slots; NaN
  // without rows.
  static double QuantizedMass(const Sequence& seq, absl::Span<const absl::Span<const float>> rows)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

  DecisionApplier* const applier_;
  TableVersions* const versions_;
  HostBudget* const budget_;
  const SequenceRegistry* const registry_;
  Telemetry* const telemetry_;
  Failpoints* const failpoints_;
};

}  // namespace kvmem::engine
