#include "server/policy/baselines.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "server/policy/scoring.h"

namespace kvmem::policy {
namespace {

Decision KeepAll(size_t streams) {
  Decision d;
  d.keep.resize(streams);
  return d;
}

// Keep the first S (sinks) and the last C - S slots, every step.
class StreamingLlmPolicy final : public Policy {
 public:
  explicit StreamingLlmPolicy(const ResolvedParams& p)
      : sinks_(static_cast<uint32_t>(p.Get("sinks"))),
        budget_(static_cast<uint32_t>(p.Get("budget"))) {}
  const PolicyDescriptor& descriptor() const override { return StreamingLlmDescriptor(); }
  Decision Step(const CallContext&, absl::Span<StreamState> streams) const override {
    return Apply(streams, budget_);
  }
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    return Apply(streams, ctx.target_tokens > 0 ? ctx.target_tokens : budget_);
  }

 private:
  Decision Apply(absl::Span<StreamState> streams, uint32_t budget) const {
    Decision d = KeepAll(streams.size());
    d.budget_tokens = budget;
    const uint32_t sinks = std::min(sinks_, budget);
    for (size_t s = 0; s < streams.size(); ++s) {
      const size_t n = streams[s].positions.size();
      if (n <= budget) continue;
      KeepSet& keep = d.keep[s].emplace(KeepSet::Range(0, sinks));
      keep.AddRun(static_cast<uint32_t>(n - (budget - sinks)), static_cast<uint32_t>(n));
    }
    return d;
  }
  const uint32_t sinks_;
  const uint32_t budget_;
};

// Accumulated attention s_j += a_j; when n > C keep the last R plus the top C - R by s.
// With pyramid = 1, layer l keeps R + b_l instead, b_l the PyramidKV schedule for C - R
// (linear from 2(C - R) - m at layer 0 down to m = (C - R) / beta at the last), so that the
// budgets average C: pyramid-style layer budgets at the memory of plain H2O [ours: the
// PyramidKV rule with n unbounded, since in streaming n never reaches 2(C - R)].
class H2oPolicy final : public Policy {
 public:
  explicit H2oPolicy(const ResolvedParams& p)
      : budget_(static_cast<uint32_t>(p.Get("budget"))),
        recent_(p.Get("recent") > 0 ? static_cast<uint32_t>(p.Get("recent")) : budget_ / 2),
        pyramid_(p.Get("pyramid") > 0),
        beta_(static_cast<uint32_t>(p.Get("beta"))) {}
  const PolicyDescriptor& descriptor() const override { return H2oDescriptor(); }

  Decision Step(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    for (StreamState& st : streams) {
      for (size_t j = 0; j < st.scores.size(); ++j) {
        st.next_scores[j] = j < st.attention.size() ? st.scores[j] + st.attention[j] : st.scores[j];
      }
    }
    return Apply(ctx, streams, budget_);
  }
  // At prefill the accumulators start from the window scores over all prompt queries.
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    for (StreamState& st : streams) {
      for (size_t j = 0; j < st.scores.size(); ++j) {
        st.next_scores[j] = j < st.window_scores.size() ? st.window_scores[j] : st.scores[j];
      }
    }
    return Apply(ctx, streams, ctx.target_tokens > 0 ? ctx.target_tokens : budget_);
  }

  // Accumulate, then the raw score's top (budget - R) plus the last R: KeepWindowPlusTop
  // as a selection with R protected and no normalizer.
  bool has_kernel_step() const override { return true; }
  KernelStep PlanKernelStep(const CallContext& ctx) const override {
    KernelStep k;
    k.op = {kernels::ScoreRule::kAccumulate, 0.0f, 1.0f, false, true};
    k.layer_budget = LayerBudgets(ctx, budget_);
    k.protect = std::min(recent_, budget_);
    k.budget_tokens = budget_;
    return k;
  }

 private:
  // Budget per layer: C, or R + the pyramid's share beyond the recent window.
  std::vector<uint32_t> LayerBudgets(const CallContext& ctx, uint32_t budget) const {
    const uint32_t recent = std::min(recent_, budget);
    std::vector<uint32_t> layer(ctx.num_layers, budget);
    if (pyramid_ && ctx.num_layers >= 2 && budget > recent) {
      const std::vector<uint32_t> pyramid = PyramidBudgets(std::numeric_limits<uint32_t>::max(),
                                                           budget, recent, ctx.num_layers, beta_);
      for (uint32_t l = 0; l < ctx.num_layers; ++l) layer[l] = recent + pyramid[l];
    }
    return layer;
  }

  Decision Apply(const CallContext& ctx, absl::Span<StreamState> streams, uint32_t budget) const {
    Decision d = KeepAll(streams.size());
    d.budget_tokens = budget;
    d.scores_written = true;
    const uint32_t recent = std::min(recent_, budget);
    const std::vector<uint32_t> layer = LayerBudgets(ctx, budget);
    for (size_t s = 0; s < streams.size(); ++s) {
      const size_t n = streams[s].positions.size();
      const uint32_t b = streams[s].layer < layer.size() ? layer[streams[s].layer] : budget;
      if (n > b) {
        d.keep[s] = KeepSet::FromSlots(KeepWindowPlusTop(n, recent, b, streams[s].next_scores));
      }
    }
    return d;
  }
  const uint32_t budget_;
  const uint32_t recent_;
  const bool pyramid_;
  const uint32_t beta_;
};

absl::Status CheckSinks(const ResolvedParams& p) {
  if (p.Get("sinks") >= p.Get("budget")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.params[sinks]: ", p.Get("sinks"), " must be below budget (", p.Get("budget"), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRecent(const ResolvedParams& p) {
  if (p.Get("recent") > p.Get("budget")) {
    return absl::InvalidArgumentError(absl::StrCat("policy.params[recent]: ", p.Get("recent"),
                                                   " must not exceed budget (", p.Get("budget"),
                                                   ")"));
  }
  return absl::OkStatus();
}

}  // namespace

const PolicyDescriptor& StreamingLlmDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "streaming_llm",
      "StreamingLLM: keeps the first S tokens (attention sinks) and the last C - S, every step.",
      {{"sinks", 4, 0, 1 << 20, true, "S, attention-sink tokens kept at the start"},
       {"budget", 512, 1, 1 << 24, true, "C, tokens kept per stream"}},
      0,
      0,
      0,
      std::nullopt,
      &CheckSinks};
  return *d;
}

const PolicyDescriptor& H2oDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "h2o",
      "H2O heavy hitters: accumulated attention; keeps the last R plus the top C - R, every "
      "step. Compress with window scores seeds the accumulators at prefill.",
      {{"budget", 256, 1, 1 << 24, true, "C, tokens kept per stream (mean over layers)"},
       {"recent", 0, 0, 1 << 24, true, "R, recent tokens always kept; 0 = C/2"},
       {"pyramid", 0, 0, 1, true, "1 = PyramidKV-style layer budgets averaging C"},
       {"beta", 20, 1, 1 << 20, true, "pyramid: the last layer keeps (C - R) / beta + R"}},
      kAttentionRows,
      0,
      0,
      0.0f,
      &CheckRecent};
  return *d;
}

std::unique_ptr<Policy> MakeStreamingLlmPolicy(const ResolvedParams& params) {
  return std::make_unique<StreamingLlmPolicy>(params);
}
std::unique_ptr<Policy> MakeH2oPolicy(const ResolvedParams& params) {
  return std::make_unique<H2oPolicy>(params);
}

}  // namespace kvmem::policy
