#include "server/policy/infokv.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "server/policy/scoring.h"

namespace kvmem::policy {
namespace {

std::vector<float> FillNan(absl::Span<const float> x) {
  double sum = 0;
  size_t count = 0;
  for (float v : x) {
    if (!std::isnan(v)) {
      sum += v;
      ++count;
    }
  }
  const float mean = count > 0 ? static_cast<float>(sum / count) : 0.0f;
  std::vector<float> out(x.begin(), x.end());
  for (float& v : out) {
    if (std::isnan(v)) v = mean;
  }
  return out;
}

std::vector<float> EntropyScores(absl::Span<const float> token_entropy,
                                 absl::Span<const float> layer_distance, double tau) {
  const std::vector<float> h = FillNan(token_entropy);
  const std::vector<float> d = FillNan(layer_distance);
  std::vector<float> e(h.size());
  for (size_t i = 0; i < h.size(); ++i) e[i] = static_cast<float>(h[i] * (d[i] + tau));
  return e;
}

void NormalizeByMax(std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, v);
  if (m > 0) {
    for (float& v : x) v /= m;
  }
}

}  // namespace

std::vector<float> InfoKvScores(absl::Span<const float> attention,
                                absl::Span<const float> token_entropy,
                                absl::Span<const float> layer_distance, double alpha, double tau) {
  std::vector<float> a(attention.begin(), attention.end());
  std::vector<float> e = EntropyScores(token_entropy, layer_distance, tau);
  NormalizeByMax(a);
  NormalizeByMax(e);
  std::vector<float> s(a.size());
  for (size_t i = 0; i < s.size(); ++i) {
    s[i] = static_cast<float>(alpha * a[i] + (1 - alpha) * e[i]);
  }
  return s;
}

namespace {

class InfoKvPolicy final : public Policy {
 public:
  InfoKvPolicy(const ResolvedParams& p, bool adaptive)
      : alpha_(p.Get("alpha")),
        tau_(p.Get("tau")),
        window_(static_cast<uint32_t>(p.Get("window"))),
        kernel_(static_cast<uint32_t>(p.Get("kernel"))),
        prefill_ratio_(p.Get("prefill_ratio")),
        decode_ratio_(p.Get("decode_ratio")),
        decode_interval_(static_cast<uint32_t>(p.Get("decode_interval"))),
        history_(static_cast<uint32_t>(p.Get("history"))),
        adaptive_(adaptive) {}

  const PolicyDescriptor& descriptor() const override {
    return adaptive_ ? InfoKvAdaptiveDescriptor() : InfoKvDescriptor();
  }

  // Decode: the last R attention rows (the engine keeps them per slot, StreamState::history);
  // every N steps compress the tokens generated since the last compression to decode_ratio
  // of their number [ours].
  Decision Step(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d;
    d.keep.resize(streams.size());
    if (decode_interval_ == 0 || (ctx.step + 1) % decode_interval_ != 0) return d;
    d.budget_tokens = 0;
    for (size_t s = 0; s < streams.size(); ++s) {
      const StreamState& st = streams[s];
      // The region: slots generated after the last compression point.
      std::vector<uint32_t> region;
      for (uint32_t j = 0; j < st.positions.size(); ++j) {
        if (st.positions[j] > ctx.mark) region.push_back(j);
      }
      if (region.size() <= window_) continue;
      const uint32_t target = std::max<uint32_t>(
          window_, static_cast<uint32_t>(std::ceil(decode_ratio_ * region.size())));
      if (target >= region.size()) continue;
      const std::vector<float> attention = HistorySums(ctx, st);
      const std::vector<float> scores =
          InfoKvScores(attention, st.token_entropy, st.layer_distance, alpha_, tau_);
      std::vector<uint32_t> older(region.begin(), region.end() - window_);
      std::vector<uint32_t> keep = TopK(scores, older, target - window_);
      keep.insert(keep.end(), region.end() - window_, region.end());
      std::vector<uint32_t> outside;
      for (uint32_t j = 0; j < region.front(); ++j) outside.push_back(j);
      d.keep[s] = KeepSet::FromSlots(MergeSorted(outside, keep));
    }
    d.mark = NewestPosition(ctx, streams);
    return d;
  }

  uint32_t history_rows() const override { return history_; }

  // Prefill: pooled window scores for attention; C = prefill_ratio * n (or the target).
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d;
    d.keep.resize(streams.size());
    const uint32_t H = ctx.num_kv_heads;
    std::vector<uint32_t> budgets(streams.size());
    std::vector<std::vector<float>> scores(streams.size());
    std::vector<double> layer_e(ctx.num_layers, 0.0);
    for (size_t s = 0; s < streams.size(); ++s) {
      const StreamState& st = streams[s];
      const size_t n = st.positions.size();
      budgets[s] = ctx.target_tokens > 0
                       ? ctx.target_tokens
                       : static_cast<uint32_t>(std::ceil(prefill_ratio_ * static_cast<double>(n)));
      const std::vector<float> pooled = AvgPool(st.window_scores, kernel_);
      scores[s] = InfoKvScores(pooled, st.token_entropy, st.layer_distance, alpha_, tau_);
      const std::vector<float> e = EntropyScores(st.token_entropy, st.layer_distance, tau_);
      layer_e[st.layer] += std::accumulate(e.begin(), e.end(), 0.0);
    }
    if (adaptive_) {
      // Same total, split across layers in proportion to their summed E.
      const double total_e = std::accumulate(layer_e.begin(), layer_e.end(), 0.0);
      if (total_e > 0) {
        for (size_t s = 0; s < streams.size(); ++s) {
          const double share = layer_e[streams[s].layer] / total_e * ctx.num_layers;
          const double n = static_cast<double>(streams[s].positions.size());
          budgets[s] = static_cast<uint32_t>(
              std::max(static_cast<double>(window_), std::min(n, budgets[s] * share)));
        }
      }
    }
    d.budget_tokens = budgets.empty() ? 0 : budgets[0];
    for (size_t s = 0; s < streams.size(); ++s) {
      const size_t n = streams[s].positions.size();
      // The recent window is never evicted, however small the ratio.
      budgets[s] =
          std::max<uint32_t>(budgets[s], static_cast<uint32_t>(std::min<size_t>(window_, n)));
      if (n <= budgets[s]) continue;
      d.keep[s] = KeepSet::FromSlots(KeepWindowPlusTop(n, window_, budgets[s], scores[s]));
    }
    d.mark = NewestPosition(ctx, streams);
    (void)H;
    return d;
  }

 private:
  // Per slot, the sum of its weights over the last R rows: this step's row and the R - 1
  // before it, oldest first (the column of step - R is the one this step's row replaces).
  static std::vector<float> HistorySums(const CallContext& ctx, const StreamState& st) {
    const size_t n = st.positions.size();
    const uint32_t R = ctx.history_rows;
    std::vector<float> sums(n, 0.0f);
    for (uint32_t back = R - 1; back >= 1 && R > 1; --back) {
      const uint64_t column = (ctx.step + R - back) % R;
      for (size_t j = 0; j < n; ++j) sums[j] += st.history[j * R + column];
    }
    for (size_t j = 0; j < st.attention.size(); ++j) sums[j] += st.attention[j];
    return sums;
  }

  // The newest position any stream holds: everything up to it has now been compressed.
  static int64_t NewestPosition(const CallContext& ctx, absl::Span<const StreamState> streams) {
    int64_t newest = ctx.mark;
    for (const StreamState& st : streams) {
      if (!st.positions.empty()) newest = std::max(newest, st.positions.back());
    }
    return newest;
  }

  const double alpha_, tau_;
  const uint32_t window_, kernel_;
  const double prefill_ratio_, decode_ratio_;
  const uint32_t decode_interval_, history_;
  const bool adaptive_;
};

std::vector<ParamSpec> InfoKvParams() {
  return {{"alpha", 0.9, 0, 1, false, "weight of normalized attention (entropy gets the rest)"},
          {"tau", 1, 0, 100, false, "tau in E = H (d + tau)"},
          {"window", 32, 1, 4096, true, "w, last tokens always kept"},
          {"kernel", 5, 1, 63, true, "pooling kernel for prefill window scores"},
          {"prefill_ratio", 0.4, 0.01, 1, false, "prefill budget as a share of n (40% or 20%)"},
          {"decode_ratio", 0.25, 0.01, 1, false,
           "decode budget as a share of each generated chunk (25% or 12.5%)"},
          {"decode_interval", 1024, 0, 1 << 24, true,
           "compress the generated region every N steps; 0 = never"},
          {"history", 32, 1, 4096, true, "R, decode attention = sum of the last R rows [ours]"}};
}

}  // namespace

const PolicyDescriptor& InfoKvDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "infokv",
      "InfoKV: score = alpha * attention + (1 - alpha) * entropy H (d + tau), normalized per "
      "stream; prefill keeps prefill_ratio of n, decode compresses each generated chunk.",
      InfoKvParams(),
      kAttentionRows,
      kWindowScores,
      kTokenEntropy | kLayerDistance};
  return *d;
}

const PolicyDescriptor& InfoKvAdaptiveDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "infokv_adaptive",
      "InfoKV with layer budgets proportional to each layer's summed entropy score (total "
      "unchanged).",
      InfoKvParams(),
      kAttentionRows,
      kWindowScores,
      kTokenEntropy | kLayerDistance};
  return *d;
}

std::unique_ptr<Policy> MakeInfoKvPolicy(const ResolvedParams& params) {
  return std::make_unique<InfoKvPolicy>(params, false);
}
std::unique_ptr<Policy> MakeInfoKvAdaptivePolicy(const ResolvedParams& params) {
  return std::make_unique<InfoKvPolicy>(params, true);
}

}  // namespace kvmem::policy
