#include "server/policy/refreekv.h"

#include <algorithm>
#include <numeric>

#include "server/policy/scoring.h"

namespace kvmem::policy {
namespace {

class RefreeKvPolicy final : public Policy {
 public:
  RefreeKvPolicy(const ResolvedParams& p, bool by_window_scores)
      : sinks_(static_cast<uint32_t>(p.Get("sinks"))),
        threshold_(p.Get("threshold")),
        skip_layers_(static_cast<uint32_t>(p.Get("skip_layers"))),
        interval_(static_cast<uint32_t>(p.Get("interval"))),
        recent_(by_window_scores ? static_cast<uint32_t>(p.Get("recent")) : 0),
        by_window_scores_(by_window_scores) {}

  const PolicyDescriptor& descriptor() const override {
    return by_window_scores_ ? RefreeKvH2oDescriptor() : RefreeKvDescriptor();
  }

  // [ours] With interval N > 0, every N steps the rule runs again over the tokens decoded
  // so far (slots that arrived after prefill), if the worker sent attention rows.
  Decision Step(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d;
    d.keep.resize(streams.size());
    if (interval_ == 0 || (ctx.step + 1) % interval_ != 0 || streams.empty() ||
        streams[0].attention.empty()) {
      return d;
    }
    return Apply(ctx, streams, /*decoded_only=*/true);
  }

  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    return Apply(ctx, streams, /*decoded_only=*/false);
  }

 private:
  // Candidate slots of a stream in eviction order (first evicted first).
  std::vector<uint32_t> Candidates(const StreamState& st, bool decoded_only) const {
    const uint32_t n = static_cast<uint32_t>(st.positions.size());
    const uint32_t protected_tail = std::min(recent_, n);
    std::vector<uint32_t> cand;
    for (uint32_t j = std::min(sinks_, n); j < n - protected_tail; ++j) {
      if (!decoded_only || st.arrival_step[j] > 0) cand.push_back(j);
    }
    if (by_window_scores_ && !st.window_scores.empty()) {
      std::stable_sort(cand.begin(), cand.end(), [&](uint32_t a, uint32_t b) {
        return st.window_scores[a] < st.window_scores[b];
      });
    }
    return cand;
  }

  Decision Apply(const CallContext& ctx, absl::Span<StreamState> streams, bool decoded_only) const {
    Decision d;
    d.keep.resize(streams.size());
    const uint32_t H = ctx.num_kv_heads;
    for (uint32_t layer = skip_layers_; layer < ctx.num_layers; ++layer) {
      // A layer runs the rule only when each of its streams has a row over its slots.
      bool rows_cover = true;
      for (uint32_t h = 0; h < H; ++h) {
        const StreamState& st = streams[size_t{layer} * H + h];
        rows_cover = rows_cover && st.attention.size() >= st.positions.size();
      }
      if (!rows_cover) continue;
      std::vector<std::vector<uint32_t>> cands(H);
      std::vector<std::vector<float>> rows(H);
      for (uint32_t h = 0; h < H; ++h) {
        const StreamState& st = streams[size_t{layer} * H + h];
        cands[h] = Candidates(st, decoded_only);
        rows[h].reserve(cands[h].size());
        for (uint32_t j : cands[h]) rows[h].push_back(st.attention[j]);
      }
      // Streams of a layer may differ in length after per-stream eviction elsewhere; the
      // rule needs equal candidate counts, so it looks at the common prefix of each order.
      size_t m = cands[0].size();
      for (const auto& c : cands) m = std::min(m, c.size());
      for (auto& r : rows) r.resize(m);
      const uint32_t stop = RefreeStopIndex(rows, threshold_);
      if (stop == 0) continue;
      for (uint32_t h = 0; h < H; ++h) {
        const size_t s = size_t{layer} * H + h;
        std::vector<uint32_t> evict(cands[h].begin(), cands[h].begin() + stop);
        std::sort(evict.begin(), evict.end());
        std::vector<uint32_t> keep;
        const size_t n = streams[s].positions.size();
        keep.reserve(n - evict.size());
        size_t e = 0;
        for (uint32_t j = 0; j < n; ++j) {
          if (e < evict.size() && evict[e] == j) {
            ++e;
          } else {
            keep.push_back(j);
          }
        }
        d.keep[s] = KeepSet::FromSlots(keep);
      }
    }
    return d;
  }

  const uint32_t sinks_;
  const double threshold_;
  const uint32_t skip_layers_;
  const uint32_t interval_;
  const uint32_t recent_;
  const bool by_window_scores_;
};

std::vector<ParamSpec> RefreeParams(bool by_window_scores) {
  std::vector<ParamSpec> specs = {
      {"sinks", 4, 0, 1 << 20, true, "m, first tokens always kept"},
      {"threshold", 0.01, 0, 1, false, "T, the attention-norm drop allowed (universal 1%)"},
      {"skip_layers", 2, 0, 1024, true, "first layers never compressed"},
      {"interval", 0, 0, 1 << 20, true,
       "re-run over decoded tokens every N steps; 0 = after prefill only [ours]"}};
  if (by_window_scores) {
    specs.push_back({"recent", 8, 0, 1 << 20, true, "last tokens always kept"});
    specs.push_back({"window", 8, 1, 4096, true, "w the worker uses for window scores"});
  }
  return specs;
}

// Candidates of a decode step are the slots decoded since the prompt (arrival step > 0).
PolicyDescriptor* WithArrivalSteps(PolicyDescriptor* d) {
  d->arrival_steps = true;
  return d;
}

}  // namespace

const PolicyDescriptor& RefreeKvDescriptor() {
  static const PolicyDescriptor* d = WithArrivalSteps(new PolicyDescriptor{
      "refreekv",
      "ReFreeKV: per layer from layer 2, evicts the oldest candidates while the lost attention "
      "norm stays within T; the kept share is the policy's own decision (reported).",
      RefreeParams(false), 0, kAttentionRows});
  return *d;
}

const PolicyDescriptor& RefreeKvH2oDescriptor() {
  static const PolicyDescriptor* d = WithArrivalSteps(new PolicyDescriptor{
      "refreekv_h2o",
      "ReFreeKV with candidates ordered by window scores (w = 8), least first; the last 8 "
      "tokens kept.",
      RefreeParams(true), 0, kAttentionRows | kWindowScores});
  return *d;
}

std::unique_ptr<Policy> MakeRefreeKvPolicy(const ResolvedParams& params) {
  return std::make_unique<RefreeKvPolicy>(params, false);
}
std::unique_ptr<Policy> MakeRefreeKvH2oPolicy(const ResolvedParams& params) {
  return std::make_unique<RefreeKvPolicy>(params, true);
}

}  // namespace kvmem::policy
