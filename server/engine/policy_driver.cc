#include "server/engine/policy_driver.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace kvmem::engine {

policy::CallContext PolicyDriver::Context(const Sequence& seq) const {
  policy::CallContext ctx;
  ctx.step = seq.steps();
  ctx.num_layers = seq.layout().num_layers;
  ctx.num_kv_heads = seq.layout().num_kv_heads;
  ctx.vocab_size = seq.layout().vocab_size;
  ctx.history_rows = seq.policy().history_rows();
  ctx.mark = seq.policy_mark();
  return ctx;
}

class PolicyDriver::HostScoreCall {
 public:
  HostScoreCall() = default;
  HostScoreCall(const HostScoreCall&) = delete;
  HostScoreCall& operator=(const HostScoreCall&) = delete;
  ~HostScoreCall() {
    if (reserved_) slots_->EndCommit();
  }

  // Before anything changes: staging room in a host slot state, or copies of a device
  // one's (and what its commit needs, reserved: its host memory from `budget`, as much as
  // the state holds on the device, which bounds the copies and the pinned staging). May
  // throw std::bad_alloc.
  absl::Status Begin(Sequence& seq, HostBudget* budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu) {
    slots_ = seq.slots();
    if (slots_ == nullptr) return absl::OkStatus();
    host_ = slots_->host_scores();
    if (host_ != nullptr) {
      host_->PrepareStage();
      return absl::OkStatus();
    }
    absl::StatusOr<HostReservation> copies =
        budget->Reserve(slots_->bytes(), "host policy call", seq.shared_host_share());
    if (!copies.ok()) return copies.status();
    copies_reserved_ = *std::move(copies);
    // Keep and WriteScores run past the point of no return: what they need is taken now.
    if (absl::Status s = slots_->ReserveCommit(); !s.ok()) return s;
    reserved_ = true;
    if (absl::Status s = slots_->ReadScores(&copies_); !s.ok()) return s;
    next_.resize(copies_.size());
    for (size_t i = 0; i < copies_.size(); ++i) next_[i].resize(copies_[i].size());
    return absl::OkStatus();
  }
  bool empty() const { return slots_ == nullptr; }
  bool copied() const { return slots_ != nullptr && host_ == nullptr; }
  absl::Span<const float> scores(uint32_t s) const {
    return host_ != nullptr ? host_->scores(s) : absl::MakeConstSpan(copies_[s]);
  }
  absl::Span<float> next(uint32_t s) {
    return host_ != nullptr ? host_->staged(s) : absl::MakeSpan(next_[s]);
  }

  // At the commit point: the staged scores (when the decision wrote them) become the
  // scores, and the slot state keeps what the decision keeps. Allocates nothing.
  absl::Status Commit(const policy::Decision& decision) {
    if (slots_ == nullptr) return absl::OkStatus();
    bool keeps = false;
    for (size_t s = 0; s < decision.keep.size(); ++s) {
      keeps = keeps || (decision.keep[s] &&
                        decision.keep[s]->size() < slots_->length(static_cast<uint32_t>(s)));
    }
    if (host_ != nullptr) {
      if (decision.scores_written) host_->CommitStaged();
      return keeps ? slots_->Keep(decision.keep) : absl::OkStatus();
    }
    if (keeps) {
      if (absl::Status s = slots_->Keep(decision.keep); !s.ok()) return s;
    }
    if (!decision.scores_written) return absl::OkStatus();
    // The kept slots' next scores, closed up as the slot state's were.
    for (size_t s = 0; s < next_.size() && s < decision.keep.size(); ++s) {
      if (!decision.keep[s]) continue;
      size_t at = 0;
      for (const SlotRun& r : decision.keep[s]->runs()) {
        for (uint32_t j = r.begin; j < r.end; ++j) next_[s][at++] = next_[s][j];
      }
      next_[s].resize(at);
    }
    return slots_->WriteScores(next_);
  }

 private:
  store::SlotState* slots_ = nullptr;
  store::HostScores* host_ = nullptr;
  std::vector<std::vector<float>> copies_, next_;  // a device slot state's, for the call
  HostReservation copies_reserved_;
  bool reserved_ = false;
};

std::vector<policy::StreamState> PolicyDriver::StagedStreamStates(Sequence& seq,
                                                                  HostScoreCall& scores) {
  std::vector<policy::StreamState> states(seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const Stream& st = seq.streams()[s];
    policy::StreamState& state = states[s];
    state.layer = static_cast<uint32_t>(s / seq.layout().num_kv_heads);
    state.kv_head = static_cast<uint32_t>(s % seq.layout().num_kv_heads);
    state.positions = st.positions();
    if (!scores.empty()) {  // empty when the policy keeps no scores
      state.scores = scores.scores(static_cast<uint32_t>(s));
      state.next_scores = scores.next(static_cast<uint32_t>(s));
    }
    state.history = st.history();
    state.token_entropy = st.token_entropy();
    state.layer_distance = st.layer_distance();
    state.arrival_step = st.arrival_step();
  }
  return states;
}

DecisionApplier::CommitHook PolicyDriver::CommitPolicyState(
    Sequence& seq, const policy::Decision& decision, HostScoreCall& scores,
    const std::vector<absl::Span<const float>>* rows) {
  return [&seq, &decision, &scores, rows] {
    seq.mu.AssertHeld();  // run by DecisionApplier::Apply, under the call's lock
    if (absl::Status s = scores.Commit(decision); !s.ok()) return s;
    const uint32_t R = seq.policy().history_rows();
    if (R > 0 && rows != nullptr) {
      for (size_t s = 0; s < seq.streams().size(); ++s) {
        // This step's row goes where the row of step - R was (policy.h).
        seq.stream(s).RecordHistory((*rows)[s], seq.steps() % R, R);
      }
    }
    if (decision.mark) seq.set_policy_mark(*decision.mark);
    return absl::OkStatus();
  };
}

absl::Status PolicyDriver::CheckSlotLengths(Sequence& seq) {
  if (seq.slots() == nullptr) return absl::OkStatus();
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    if (seq.slots()->length(static_cast<uint32_t>(s)) != seq.streams()[s].size()) {
      return versions_->Poison(
          seq, absl::InternalError(absl::StrCat("slot state of stream ", s, " holds ",
                                                seq.slots()->length(static_cast<uint32_t>(s)),
                                                " slots, the table ", seq.streams()[s].size())));
    }
  }
  return absl::OkStatus();
}

std::vector<uint32_t> PolicyDriver::StreamBudgets(const Sequence& seq,
                                                  const policy::KernelStep& plan) {
  const uint32_t H = seq.layout().num_kv_heads;
  std::vector<uint32_t> budget(seq.streams().size());
  for (size_t s = 0; s < budget.size(); ++s) budget[s] = plan.layer_budget[s / H];
  return budget;
}

std::vector<PolicyDriver::Staged> PolicyDriver::StageKernelSteps(
    absl::Span<Sequence* const> seqs, absl::Span<const CheckedStep* const> steps) {
  std::vector<Staged> staged(seqs.size());
  std::vector<std::vector<uint32_t>> budgets(seqs.size());
  std::vector<store::SlotStepCall> calls(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& seq = *seqs[i];
    seq.mu.AssertHeld();  // by the caller, as Step's
    const policy::KernelStep& plan = staged[i].plan =
        seq.policy().PlanKernelStep(StepContext(seq, *steps[i]));
    budgets[i] = StreamBudgets(seq, plan);
    calls[i] = {seq.slots(),  plan.op,         steps[i]->rows,  budgets[i],
                plan.protect, &staged[i].keep, absl::OkStatus()};
  }
  try {
    store::StepSlotStates(absl::MakeSpan(calls));
  } catch (const std::bad_alloc&) {
    // Every step fails and is aborted (those that stepped have their scores put back).
    for (store::SlotStepCall& call : calls) {
      call.status = absl::ResourceExhaustedError("StepBatch: out of host memory");
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) staged[i].status = calls[i].status;
  return staged;
}

absl::Status PolicyDriver::AbortKernelStep(Sequence& seq, const absl::Status& why) {
  if (seq.poisoned()) return why;
  absl::Status restored = seq.slots()->AbortStep();
  return restored.ok() ? why : versions_->Poison(seq, restored);
}

absl::StatusOr<std::unique_ptr<DecisionApplier::Pending>> PolicyDriver::PlanKernelStep(
    Sequence& seq, const policy::CallContext& ctx, absl::Span<const absl::Span<const float>> rows,
    Staged* staged, policy::Decision* decision) {
  // The slot state stages the step (new scores, keep flags) until CommitStep; AbortStep
  // puts the scores back when the step fails before its point of no return. An exception
  // (host memory) from here on must not leave the scores stepped either (`staged`'s are
  // stepped already).
  absl::Cleanup abort_on_unwind = [&] {
    seq.mu.AssertHeld();
    AbortKernelStep(seq, absl::ResourceExhaustedError("")).IgnoreError();
  };
  const policy::KernelStep plan =
      staged != nullptr ? std::move(staged->plan) : seq.policy().PlanKernelStep(ctx);
  decision->confidence = plan.confidence;
  decision->budget_tokens = plan.budget_tokens;
  absl::Status stepped = absl::OkStatus();
  if (staged != nullptr) {
    stepped = staged->status;
    decision->keep = std::move(staged->keep);
  } else {
    stepped =
        seq.slots()->Step(plan.op, rows, StreamBudgets(seq, plan), plan.protect, &decision->keep);
  }
  if (!stepped.ok()) {
    std::move(abort_on_unwind).Cancel();
    return AbortKernelStep(seq, stepped);
  }
  absl::StatusOr<std::unique_ptr<DecisionApplier::Pending>> pending =
      applier_->Plan(seq, *decision, [&seq] {
        seq.mu.AssertHeld();
        return seq.slots()->CommitStep();
      });
  std::move(abort_on_unwind).Cancel();
  if (!pending.ok()) return AbortKernelStep(seq, pending.status());
  return pending;
}

absl::StatusOr<DecisionApplier::Applied> PolicyDriver::FinishKernelStep(
    Sequence& seq, DecisionApplier::Pending& pending, const absl::Status& executed) {
  absl::StatusOr<Applied> done = applier_->Finish(pending, executed);
  if (!done.ok()) return AbortKernelStep(seq, done.status());
  if (absl::Status s = CheckSlotLengths(seq); !s.ok()) return s;
  return done;
}

namespace {

// The mean over streams of the weight each row puts on slots the decision drops.
double EvictedMassOf(absl::Span<const absl::Span<const float>> rows,
                     const policy::Decision& decision) {
  double mass = 0;
  for (size_t s = 0; s < rows.size(); ++s) {
    if (s < decision.keep.size() && decision.keep[s]) {
      mass += EvictedMass(rows[s], *decision.keep[s]);
    }
  }
  return rows.empty() ? 0.0 : mass / static_cast<double>(rows.size());
}

}  // namespace

// The mean over streams of the weight each row puts on slots held in quantized blocks; NaN
// when the step carries no rows (nothing to measure with).
double PolicyDriver::QuantizedMass(const Sequence& seq,
                                   absl::Span<const absl::Span<const float>> rows) {
  if (rows.empty() || rows[0].empty()) return std::nan("");
  if (!seq.quant().type) return 0.0;  // never quantizes: no block to walk
  double mass = 0;
  for (size_t s = 0; s < rows.size(); ++s) {
    size_t at = 0;
    for (const StreamBlock& b : seq.streams()[s].blocks()) {
      const size_t end = std::min(rows[s].size(), at + b.count);
      if (b.precision != Precision::kLayout) {
        for (size_t i = at; i < end; ++i) mass += rows[s][i];
      }
      at += b.count;
    }
  }
  return mass / static_cast<double>(rows.size());
}

PolicyDriver::PendingStep::~PendingStep() {
  if (ended_ || pending_ == nullptr) return;
  Sequence& seq = *seq_;
  seq.mu.AssertHeld();  // a PendingStep lives inside its sequence's lock
  pending_.reset();     // an open write section poisons the sequence as it goes
  driver_->AbortKernelStep(seq, absl::ResourceExhaustedError("")).IgnoreError();
}

absl::StatusOr<std::unique_ptr<PolicyDriver::PendingStep>> PolicyDriver::BeginStep(
    Sequence& seq, const CheckedStep& step, Staged* staged) {
  // A staged step is undone if this throws before PlanKernelStep takes it over.
  absl::Cleanup abort_staged = [&] {
    seq.mu.AssertHeld();
    if (staged != nullptr) AbortKernelStep(seq, absl::ResourceExhaustedError("")).IgnoreError();
  };
  std::unique_ptr<PendingStep> p(new PendingStep(this, &seq, &step));
  p->started_ = std::chrono::steady_clock::now();  // latency: monotonic
  const policy::CallContext ctx = StepContext(seq, step);
  p->kv_bytes_before_ = seq.kv_bytes();
  // The attention mass quantized slots hold, from the rows over the table as it is now.
  p->quantized_mass_ = QuantizedMass(seq, step.rows);
  std::move(abort_staged).Cancel();
  if (seq.kernel_step()) {
    absl::StatusOr<std::unique_ptr<DecisionApplier::Pending>> planned =
        PlanKernelStep(seq, ctx, step.rows, staged, &p->decision_);
    if (!planned.ok()) return planned.status();
    p->pending_ = *std::move(planned);
    return p;
  }
  // The policy reads the committed state and stages the next (policy.h); it becomes the
  // sequence's only if the whole step applies.
  HostScoreCall scores;
  if (absl::Status s = scores.Begin(seq, budget_); !s.ok()) return s;
  std::vector<policy::StreamState> states = StagedStreamStates(seq, scores);
  for (size_t s = 0; s < states.size(); ++s) states[s].attention = step.rows[s];
  p->decision_ = seq.policy().Step(ctx, absl::MakeSpan(states));
  absl::StatusOr<Applied> applied =
      applier_->Apply(seq, p->decision_, CommitPolicyState(seq, p->decision_, scores, &step.rows));
  if (!applied.ok()) return applied.status();
  if (absl::Status s = CheckSlotLengths(seq); !s.ok()) return s;
  p->applied_ = *applied;
  return p;
}

absl::Status PolicyDriver::ExecuteSteps(absl::Span<PendingStep* const> steps) {
  std::vector<DecisionApplier::Pending*> batches;
  for (PendingStep* step : steps) {
    if (step->pending_ != nullptr && step->pending_->executes()) {
      batches.push_back(step->pending_.get());
    }
  }
  if (batches.empty()) return absl::OkStatus();
  absl::Status executed = applier_->ExecuteMany(batches);
  if (!executed.ok()) return executed;
  // The commits' compactions of the slot states, together when there are several (each
  // CommitStep then has nothing left to do, or compacts alone if this could not).
  std::vector<store::SlotState*> states;
  for (PendingStep* step : steps) {
    step->seq_->mu.AssertHeld();  // by the caller
    if (step->pending_ != nullptr && step->pending_->executes()) {
      states.push_back(step->seq_->slots());
    }
  }
  if (states.size() < 2) return executed;
  try {
    store::CommitSlotStates(states);
  } catch (const std::bad_alloc&) {
    // Compacted by each CommitStep instead.
  }
  return executed;
}

absl::StatusOr<StepResult> PolicyDriver::EndStep(PendingStep& p, const absl::Status& executed) {
  Sequence& seq = *p.seq_;
  seq.mu.AssertHeld();  // a PendingStep lives inside its sequence's lock
  p.ended_ = true;
  absl::StatusOr<Applied> applied =
      p.applied_ ? absl::StatusOr<Applied>(*p.applied_)
                 : FinishKernelStep(seq, *p.pending_,
                                    p.pending_->executes() ? executed : absl::OkStatus());
  if (!applied.ok()) return applied.status();
  const policy::Decision& decision = p.decision_;
  const std::vector<absl::Span<const float>>& rows = p.step_->rows;
  if (PolicyTelemetry* t = telemetry_->For(seq.policy_name())) {
    const StepSite site = seq.kernel_step() ? StepSite::kDevice : StepSite::kHost;
    t->step_seconds[static_cast<int>(site)].Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - p.started_).count());
    t->confidence.Observe(decision.confidence);  // NaN (no confidence) is not observed
    if (decision.budget_tokens > 0) t->budget_tokens.Observe(decision.budget_tokens);
    if (!std::isnan(p.quantized_mass_)) {
      t->quantized_attention_mass.Observe(p.quantized_mass_);
      t->evicted_attention_mass.Observe(EvictedMassOf(rows, decision));
    }
  }

  StepResult result;
  result.confidence = decision.confidence;
  result.budget_tokens = decision.budget_tokens;
  result.evicted_tokens = applied->evicted;
  result.quantized_tokens = applied->quantized;
  result.kv_bytes_before = p.kv_bytes_before_;
  result.kv_bytes_after = seq.kv_bytes();
  result.epoch = seq.epoch();
  result.step = seq.CountStep();
  seq.mutable_prefix().compressed_document = false;
  ++telemetry_->steps;
  budget_->Account(seq);
  registry_->Renew(seq);
  return result;
}

absl::StatusOr<StepResult> PolicyDriver::Step(Sequence& seq, const CheckedStep& step,
                                              Staged* staged) {
  absl::StatusOr<std::unique_ptr<PendingStep>> begun = BeginStep(seq, step, staged);
  if (!begun.ok()) return begun.status();
  const absl::Status executed = ExecuteSteps({begun->get()});
  return EndStep(**begun, executed);
}

absl::StatusOr<CompressResult> PolicyDriver::Compress(Sequence& seq, const CheckedCompress& signals,
                                                      uint32_t target_tokens) {
  const std::vector<absl::Span<const float>>* rows = &signals.rows;
  const std::vector<absl::Span<const float>>* window = &signals.window_scores;
  policy::CallContext ctx = Context(seq);
  ctx.target_tokens = target_tokens;

  const auto started = std::chrono::steady_clock::now();  // latency: monotonic
  CompressResult result;
  result.kv_bytes_before = seq.kv_bytes();
  result.layers.resize(seq.layout().num_layers);
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    LayerKept& layer = result.layers[s / seq.layout().num_kv_heads];
    layer.layer = static_cast<uint32_t>(s / seq.layout().num_kv_heads);
    layer.before_tokens += seq.streams()[s].size();
  }
  // Compress runs policy code on the host: on the scores in place, or on copies of a
  // device slot state's (once per prompt, not per step).
  HostScoreCall scores;
  if (absl::Status s = scores.Begin(seq, budget_); !s.ok()) return s;
  if (scores.copied()) Failpoints::ThrowIfHit(failpoints_, Failpoints::kHostAlloc);
  std::vector<policy::StreamState> states = StagedStreamStates(seq, scores);
  for (size_t s = 0; s < states.size(); ++s) {
    states[s].attention = (*rows)[s];
    states[s].window_scores = (*window)[s];
  }
  const policy::Decision decision = seq.policy().Compress(ctx, absl::MakeSpan(states));
  absl::StatusOr<Applied> applied =
      applier_->Apply(seq, decision, CommitPolicyState(seq, decision, scores, nullptr));
  if (applied.ok()) {
    if (absl::Status s = CheckSlotLengths(seq); !s.ok()) return s;
  }
  if (!applied.ok()) return applied.status();
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    result.layers[s / seq.layout().num_kv_heads].kept_tokens += seq.streams()[s].size();
  }
  result.evicted_tokens = applied->evicted;
  result.quantized_tokens = applied->quantized;
  result.kv_bytes_after = seq.kv_bytes();
  result.epoch = seq.epoch();
  budget_->Account(seq);
  registry_->Renew(seq);
  versions_->Publish(seq);
  if (PolicyTelemetry* t = telemetry_->For(seq.policy_name())) {
    t->compress_seconds.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  result.version = seq.version();
  // One compression, by the policy's own rule, of a prompt no step has touched: a document
  // others may map. A second Compress, or one with a target of the client's, is not.
  Sequence::PrefixState& prefix = seq.mutable_prefix();
  ++prefix.compressions;
  prefix.compressed_document = seq.steps() == 0 && prefix.compressions == 1 && target_tokens == 0;
  return result;
}

}  // namespace kvmem::engine
