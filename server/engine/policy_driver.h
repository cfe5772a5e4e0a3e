#pragma once
// PolicyDriver: runs a sequence's policy on checked signals (input_checks.h) and applies its
// decision. The scores live in the sequence's SlotState only (Sequence::slots). Host
// policy code reads the committed scores and stages the next in place in a host slot state
// (a device one's are copied over for the call: a Compress of a kernel-step sequence); they
// become the sequence's only when the whole call applies (DecisionApplier's commit hook). A
// policy with a kernel step scores and selects in the SlotState itself (device memory on a
// GPU), which stages the step until its commit. Runs under the sequence's lock.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu) {
    return Step(seq, step, nullptr);
  }

  // The slot-state half of the steps of sequences whose policy steps in its slot state
  // (kernel_step()), for several sequences at once (StepBatch): scores and selection staged
  // in each slot state, as store::StepSlotStates runs them (one batch per CUDA device).
  // Step(seq, step, &staged[i]) then finishes each. Every sequence is locked by the caller.
  struct Staged {
    policy::KernelStep plan;  // the policy's, planned once for both halves
    absl::Status status;
    store::KeepSets keep;
  };
  std::vector<Staged> StageKernelSteps(absl::Span<Sequence* const> seqs,
                                       absl::Span<const CheckedStep* const> steps);
  // A step whose slot-state half `staged` holds (null: runs it here): BeginStep,
  // ExecuteSteps and EndStep in one.
  absl::StatusOr<StepResult> Step(Sequence& seq, const CheckedStep& step, Staged* staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  // A step between its plan and the execution of its op batch, so that StepBatch runs the
  // batches of several sequences together. Ended by EndStep; destroyed without it (an
  // exception), it is undone, or past its point of no return its sequence is poisoned.
  class PendingStep {
   public:
    PendingStep(const PendingStep&) = delete;
    PendingStep& operator=(const PendingStep&) = delete;
    ~PendingStep();

   private:
    friend class PolicyDriver;
    PendingStep(PolicyDriver* driver, Sequence* seq, const CheckedStep* step)
        : driver_(driver), seq_(seq), step_(step) {}
    PolicyDriver* const driver_;
    Sequence* const seq_;
    const CheckedStep* const step_;
    std::chrono::steady_clock::time_point started_;
    uint64_t kv_bytes_before_ = 0;
    double quantized_mass_ = 0;
    policy::Decision decision_;
    std::optional<DecisionApplier::Applied> applied_;    // a host policy's step, whole
    std::unique_ptr<DecisionApplier::Pending> pending_;  // a kernel step's decision
    bool ended_ = false;
  };
  // The step up to its op batch: its scores and selection (or `staged`'s), the decision
  // planned and, when it changes anything, its write section open. A host policy's step
  // applies whole here. An error changes nothing.
  absl::StatusOr<std::unique_ptr<PendingStep>> BeginStep(Sequence& seq, const CheckedStep& step,
                                                         Staged* staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Runs the op batches of pending steps (DecisionApplier::ExecuteMany); every sequence is
  // locked by the caller. Its status goes to each EndStep.
  absl::Status ExecuteSteps(absl::Span<PendingStep* const> steps);
  // Commits the step (or poisons its sequence when `executed` failed) and answers it.
  absl::StatusOr<StepResult> EndStep(PendingStep& step, const absl::Status& executed);
  // An explicit compression by the policy's rule (`target_tokens` > 0: to that many per
  // stream), on the host also for a sequence whose scores live in a SlotState.
  absl::StatusOr<CompressResult> Compress(Sequence& seq, const CheckedCompress& signals,
                                          uint32_t target_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

 private:
  using Applied = DecisionApplier::Applied;
  policy::CallContext Context(const Sequence& seq) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // The scores a host policy call reads and stages: in place in a host slot state, or
  // copies of a device one's (taken back at the commit). Empty for a policy that keeps none.
  class HostScoreCall;
  // StreamStates over the committed state, with the scores and their staging from `scores`
  // and the history of the policy's width.
  std::vector<policy::StreamState> StagedStreamStates(Sequence& seq, HostScoreCall& scores)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The commit hook of a host policy call: takes the staged scores (and compacts the slot
  // state to the decision), the mark, and (Step) records `rows` in the history.
  DecisionApplier::CommitHook CommitPolicyState(Sequence& seq, const policy::Decision& decision,
                                                HostScoreCall& scores,
                                                const std::vector<absl::Span<const float>>* rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // After a host call applied: the slot state holds as many slots as each stream, else the
  // sequence is poisoned.
  absl::Status CheckSlotLengths(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // A step of a policy with a kernel step: scores and selection in the SlotState (or
  // `staged`), then the decision planned as for any (its K/V rows move when the plan runs).
  absl::StatusOr<std::unique_ptr<DecisionApplier::Pending>> PlanKernelStep(
      Sequence& seq, const policy::CallContext& ctx, absl::Span<const absl::Span<const float>> rows,
      Staged* staged, policy::Decision* decision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Its end: the decision committed, or the step undone (the scores as before it) where its
  // point of no return was not passed.
  absl::StatusOr<Applied> FinishKernelStep(Sequence& seq, DecisionApplier::Pending& pending,
                                           const absl::Status& executed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // A kernel step that fails before its point of no return: the slot state's scores put
  // back (AbortStep); if they cannot be, a retry would apply the row twice: poisoned.
  absl::Status AbortKernelStep(Sequence& seq, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The call context of a step (Context, with the step's logit statistics).
  policy::CallContext StepContext(const Sequence& seq, const CheckedStep& step) const
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
    policy::CallContext ctx = Context(seq);
    ctx.logits = step.logits;
    return ctx;
  }
  // Per stream, the SelectTop budget of the plan's layer.
  static std::vector<uint32_t> StreamBudgets(const Sequence& seq, const policy::KernelStep& plan)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
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
