#include "server/policy/snapkv.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "server/policy/scoring.h"

namespace kvmem::policy {

std::vector<uint32_t> SnapKvKeep(absl::Span<const float> window_scores, uint32_t window,
                                 uint32_t keep_prefix, uint32_t kernel) {
  const size_t n = window_scores.size();
  const size_t w = std::min<size_t>(window, n);
  const size_t prefix = n - w;
  const std::vector<float> pooled = AvgPool(window_scores.first(prefix), kernel);
  std::vector<uint32_t> candidates(prefix);
  std::iota(candidates.begin(), candidates.end(), 0u);
  std::vector<uint32_t> keep = TopK(pooled, candidates, keep_prefix);
  for (size_t i = prefix; i < n; ++i) keep.push_back(static_cast<uint32_t>(i));
  return keep;
}

namespace {

// Budget C per stream: an explicit Compress target, else ratio * n when ratio > 0, else C.
uint32_t Budget(const CallContext& ctx, double ratio, uint32_t budget, size_t n) {
  if (ctx.target_tokens > 0) return ctx.target_tokens;
  if (ratio > 0) return static_cast<uint32_t>(std::ceil(ratio * static_cast<double>(n)));
  return budget;
}

Decision NoEviction(size_t streams) {
  Decision d;
  d.keep.resize(streams);
  return d;
}

// SnapKV, and PyramidKV when `pyramid` (per-layer budgets from PyramidBudgets).
class PrefillSelectPolicy final : public Policy {
 public:
  PrefillSelectPolicy(const ResolvedParams& p, bool pyramid)
      : budget_(static_cast<uint32_t>(p.Get("budget"))),
        ratio_(p.Get("ratio")),
        window_(static_cast<uint32_t>(p.Get("window"))),
        kernel_(static_cast<uint32_t>(p.Get("kernel"))),
        beta_(pyramid ? static_cast<uint32_t>(p.Get("beta")) : 0) {}
  const PolicyDescriptor& descriptor() const override {
    return beta_ > 0 ? PyramidKvDescriptor() : SnapKvDescriptor();
  }
  Decision Step(const CallContext&, absl::Span<StreamState> streams) const override {
    return NoEviction(streams.size());
  }
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d = NoEviction(streams.size());
    for (size_t s = 0; s < streams.size(); ++s) {
      const size_t n = streams[s].positions.size();
      const uint32_t budget = Budget(ctx, ratio_, budget_, n);
      d.budget_tokens = budget;
      const uint32_t w = std::min(window_, budget);
      uint32_t keep_prefix = budget - w;
      if (beta_ > 0) {
        const std::vector<uint32_t> budgets =
            PyramidBudgets(static_cast<uint32_t>(n), budget, w, ctx.num_layers, beta_);
        if (budgets.empty()) continue;
        keep_prefix = budgets[streams[s].layer];
      } else if (n <= budget) {
        continue;
      }
      d.keep[s] = KeepSet::FromSlots(SnapKvKeep(streams[s].window_scores, w, keep_prefix, kernel_));
    }
    return d;
  }

 private:
  const uint32_t budget_;
  const double ratio_;
  const uint32_t window_;
  const uint32_t kernel_;
  const uint32_t beta_;  // 0 = one budget for every layer (SnapKV)
};

}  // namespace

const PolicyDescriptor& SnapKvDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "snapkv",
      "SnapKV (prefill): pooled observation-window scores; keeps the window plus the top "
      "C - w. Runs on Compress; no-op when n <= C.",
      {{"budget", 1024, 1, 1 << 24, true, "C, tokens kept per stream [ours: default]"},
       {"ratio", 0, 0, 1, false, "C as a share of n when > 0"},
       {"window", 32, 1, 4096, true, "w, observation window (last prompt queries)"},
       {"kernel", 5, 1, 63, true, "average-pooling kernel (odd)"}},
      0,
      kWindowScores};
  return *d;
}

const PolicyDescriptor& PyramidKvDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "pyramidkv",
      "PyramidKV (prefill): SnapKV scoring with per-layer budgets falling linearly with depth "
      "(beta sets the floor).",
      {{"budget", 1024, 1, 1 << 24, true, "C, mean tokens kept per stream [ours: default]"},
       {"ratio", 0, 0, 1, false, "C as a share of n when > 0"},
       {"window", 32, 1, 4096, true, "w, observation window"},
       {"kernel", 5, 1, 63, true, "average-pooling kernel (odd)"},
       {"beta", 20, 1, 1000, true, "beta: the last layer keeps (C - w) / beta"}},
      0,
      kWindowScores};
  return *d;
}

std::unique_ptr<Policy> MakeSnapKvPolicy(const ResolvedParams& params) {
  return std::make_unique<PrefillSelectPolicy>(params, /*pyramid=*/false);
}
std::unique_ptr<Policy> MakePyramidKvPolicy(const ResolvedParams& params) {
  return std::make_unique<PrefillSelectPolicy>(params, /*pyramid=*/true);
}

}  // namespace kvmem::policy
