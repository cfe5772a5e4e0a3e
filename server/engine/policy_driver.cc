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

std::vector<policy::StreamState> PolicyDriver::StagedStreamStates(Sequence& seq) {
  std::vector<policy::StreamState> states(seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    Stream& st = seq.stream(s);

    policy::StreamState& state = states[s];
    state.layer = static_cast<uint32_t>(s / seq.layout().num_kv_heads);
    state.kv_head = static_cast<uint32_t>(s % seq.layout().num_kv_heads);
    state.positions = st.positions();
    // Empty when the policy keeps no scores; a Compress of a sequence whose scores live in a
    // SlotState has brought them over first.
    if (seq.policy().descriptor().initial_score) {
      state.scores = st.scores();
      state.next_scores = st.StageScores();
    }
    state.history = st.history();
    state.token_entropy = st.token_entropy();
    state.layer_distance = st.layer_distance();
    state.arrival_step = st.arrival_step();
  }
  return states;
}

DecisionApplier::CommitHook PolicyDriver::CommitPolicyState(
    Sequence& seq, const policy::Decision& decision,
    const std::vector<absl::Span<const float>>* rows) {
  return [&seq, &decision, rows] {
    seq.mu.AssertHeld();  // run by DecisionApplier::Apply, under the call's lock
    const uint32_t R = seq.policy().history_rows();
    // Only what StagedStreamStates staged (a policy that keeps no scores was handed none).
    const bool scores = decision.scores_written && seq.policy().descriptor().initial_score;
    for (size_t s = 0; s < seq.streams().size(); ++s) {
      Stream& st = seq.stream(s);
      if (scores) st.CommitScores();
      if (R > 0 && rows != nullptr) {
        // This step's row goes where the row of step - R was (policy.h).
        st.RecordHistory((*rows)[s], seq.steps() % R, R);
      }
    }
    if (decision.mark) seq.set_policy_mark(*decision.mark);
    return absl::OkStatus();
  };
}

absl::StatusOr<DecisionApplier::Applied> PolicyDriver::KernelStep(
    Sequence& seq, const policy::CallContext& ctx, absl::Span<const absl::Span<const float>> rows,
    policy::Decision* decision) {
  const policy::KernelStep plan = seq.policy().PlanKernelStep(ctx);
  const uint32_t H = seq.layout().num_kv_heads;
  std::vector<uint32_t> budget(seq.streams().size());
  for (size_t s = 0; s < budget.size(); ++s) budget[s] = plan.layer_budget[s / H];
  decision->confidence = plan.confidence;
  decision->budget_tokens = plan.budget_tokens;
  // The slot state stages the step (new scores, keep flags) until CommitStep; AbortStep
  // puts the scores back when the step fails before its point of no return.
  // If the scores cannot be put back, a retry would apply the row twice: poison instead.
  auto abort = [&](const absl::Status& why) {
    seq.mu.AssertHeld();
    if (seq.poisoned()) return why;
    absl::Status restored = seq.slots()->AbortStep();
    return restored.ok() ? why : versions_->Poison(seq, restored);
  };
  // An exception (host memory) past this point must not leave the scores stepped either.
  absl::Cleanup abort_on_unwind = [&] { abort(absl::ResourceExhaustedError("")).IgnoreError(); };
  if (absl::Status s = seq.slots()->Step(plan.op, rows, budget, plan.protect, &decision->keep);
      !s.ok()) {
    std::move(abort_on_unwind).Cancel();
    return abort(s);
  }
  absl::StatusOr<Applied> done = applier_->Apply(seq, *decision, [&seq] {
    seq.mu.AssertHeld();
    return seq.slots()->CommitStep();
  });
  std::move(abort_on_unwind).Cancel();
  if (!done.ok()) return abort(done.status());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    if (seq.slots()->length(static_cast<uint32_t>(s)) != seq.streams()[s].size()) {
      return versions_->Poison(
          seq, absl::InternalError(absl::StrCat("slot state of stream ", s, " holds ",
                                                seq.slots()->length(s), " slots, the table ",
                                                seq.streams()[s].size())));
    }
  }
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

absl::StatusOr<StepResult> PolicyDriver::Step(Sequence& seq, const CheckedStep& step) {
  const auto started = std::chrono::steady_clock::now();  // latency: monotonic
  policy::CallContext ctx = Context(seq);
  ctx.logits = step.logits;
  const std::vector<absl::Span<const float>>* rows = &step.rows;
  const uint64_t before = seq.kv_bytes();
  // The attention mass quantized slots hold, from the rows over the table as it is now.
  const double quantized_mass = QuantizedMass(seq, *rows);
  policy::Decision decision;
  absl::StatusOr<Applied> applied;
  if (seq.slots()) {
    applied = KernelStep(seq, ctx, *rows, &decision);
  } else {
    // The policy reads the committed state and stages the next (policy.h); it becomes the
    // sequence's only if the whole step applies.
    std::vector<policy::StreamState> states = StagedStreamStates(seq);
    for (size_t s = 0; s < states.size(); ++s) states[s].attention = (*rows)[s];
    decision = seq.policy().Step(ctx, absl::MakeSpan(states));
    applied = applier_->Apply(seq, decision, CommitPolicyState(seq, decision, rows));
  }
  if (!applied.ok()) return applied.status();
  if (PolicyTelemetry* t = telemetry_->For(seq.policy_name())) {
    const StepSite site = seq.slots() ? StepSite::kDevice : StepSite::kHost;
    t->step_seconds[static_cast<int>(site)].Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    t->confidence.Observe(decision.confidence);  // NaN (no confidence) is not observed
    if (decision.budget_tokens > 0) t->budget_tokens.Observe(decision.budget_tokens);
    if (!std::isnan(quantized_mass)) {
      t->quantized_attention_mass.Observe(quantized_mass);
      t->evicted_attention_mass.Observe(EvictedMassOf(*rows, decision));
    }
  }

  StepResult result;
  result.confidence = decision.confidence;
  result.budget_tokens = decision.budget_tokens;
  result.evicted_tokens = applied->evicted;
  result.quantized_tokens = applied->quantized;
  result.kv_bytes_before = before;
  result.kv_bytes_after = seq.kv_bytes();
  result.epoch = seq.epoch();
  result.step = seq.CountStep();
  seq.mutable_prefix().compressed_document = false;
  ++telemetry_->steps;
  budget_->Account(seq);
  registry_->Renew(seq);
  return result;
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
  // Compress runs on the host: scores kept in a SlotState come over for the call (into the
  // streams' host scores, which are empty between calls) and go back, compacted, after it
  // (once per prompt, not per step).
  if (seq.slots()) {
    // Keep and WriteScores below run past the point of no return: what they need is taken
    // now (given back when the call ends, however it ends).
    if (absl::Status s = seq.slots()->ReserveCommit(); !s.ok()) return s;
  }
  // The host copies of the scores go however the call ends (they are taken back below
  // when it ends well): a stream of a SlotState sequence keeps no host scores between calls.
  absl::Cleanup end_commit = [&seq] {
    seq.mu.AssertHeld();
    if (!seq.slots()) return;
    for (size_t s = 0; s < seq.streams().size(); ++s) {
      seq.stream(s).TakeScores();
      seq.stream(s).DropStaging();
    }
    seq.slots()->EndCommit();
  };
  if (seq.slots()) {
    std::vector<std::vector<float>> scores;
    if (absl::Status s = seq.slots()->ReadScores(&scores); !s.ok()) return s;
    for (size_t s = 0; s < seq.streams().size(); ++s) {
      seq.stream(s).LoadScores(std::move(scores[s]));
    }
    Failpoints::ThrowIfHit(failpoints_, Failpoints::kHostAlloc);
  }
  std::vector<policy::StreamState> states = StagedStreamStates(seq);
  for (size_t s = 0; s < states.size(); ++s) {
    states[s].attention = (*rows)[s];
    states[s].window_scores = (*window)[s];
  }
  const policy::Decision decision = seq.policy().Compress(ctx, absl::MakeSpan(states));
  absl::StatusOr<Applied> applied =
      applier_->Apply(seq, decision, CommitPolicyState(seq, decision, nullptr));
  if (seq.slots()) {
    std::vector<std::vector<float>> scores(seq.streams().size());
    for (size_t s = 0; s < seq.streams().size(); ++s) {
      scores[s] = seq.stream(s).TakeScores();
      seq.stream(s).DropStaging();
    }
    if (applied.ok()) {
      absl::Status synced = seq.slots()->Keep(decision.keep);
      if (synced.ok()) synced = seq.slots()->WriteScores(scores);
      budget_->Account(seq);  // a compression may have given capacity back
      if (!synced.ok()) return versions_->Poison(seq, synced);
    }
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
  seq.Publish();
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
