#include "server/policy/confkv.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/select.h"
#include "server/common/parallel.h"
#include "server/policy/scoring.h"

namespace kvmem::policy {

uint32_t ConfKvLayerBudget(uint32_t base, uint32_t layer, uint32_t num_layers, uint32_t floor) {
  const double scaled = base * std::pow(0.5, static_cast<double>(layer) / num_layers);
  return std::max(floor, static_cast<uint32_t>(scaled));
}

KeepSet ConfKvKeep(absl::Span<const float> ema, absl::Span<const int64_t> positions,
                   uint32_t budget, uint32_t protect, double attention_weight, float max_ema) {
  const auto n = static_cast<uint32_t>(positions.size());
  if (n <= budget) return KeepSet::Range(0, n);
  if (std::isnan(max_ema)) {
    max_ema = 0;
    for (float e : ema) max_ema = std::max(max_ema, e);
  }
  const float weight = static_cast<float>(attention_weight);
  if (n - budget == 1 && budget > protect) {
    // The steady state of decoding: one slot out, one pass, no sort: the slot SelectTopRef
    // would evict (kernels/select.h: lowest priority, the newer on ties).
    const uint32_t worst =
        kernels::LowestPriorityRef(ema.data(), positions.data(), n, n - protect, max_ema, weight);
    KeepSet keep = KeepSet::Range(0, worst);
    keep.AddRun(worst + 1, n);
    return keep;
  }
  // The general case is the kernel reference itself (kernels/select.h), so that the CPU and
  // CUDA backends keep the same slots.
  const kernels::StreamSlice slice{0, static_cast<uint32_t>(n), budget, protect};
  std::vector<uint8_t> flags(n);
  kernels::SelectTopRef(&slice, 1, ema.data(), &max_ema, positions.data(), weight, flags.data());
  KeepSet keep;
  for (uint32_t j = 0; j < n; ++j) {
    if (flags[j]) keep.Add(j);
  }
  return keep;
}

std::vector<uint32_t> RandomKeep(absl::Span<const int64_t> positions, uint32_t layer,
                                 uint32_t kv_head, uint32_t budget, uint32_t protect) {
  const size_t n = positions.size();
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  if (n <= budget) return all;
  protect = std::min(protect, budget);
  // A fixed pseudo-random priority per (stream, position): splitmix64 of the three.
  std::vector<float> priority(n);
  for (size_t j = 0; j < n; ++j) {
    uint64_t z = (uint64_t(layer) << 48) ^ (uint64_t(kv_head) << 40) ^ uint64_t(positions[j]);
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    priority[j] = static_cast<float>(z >> 40) / static_cast<float>(1 << 24);
  }
  const size_t unprotected = n - protect;
  std::vector<uint32_t> keep =
      TopK(priority, absl::MakeConstSpan(all).first(unprotected), budget - protect);
  keep.insert(keep.end(), all.begin() + static_cast<std::ptrdiff_t>(unprotected), all.end());
  return keep;
}

namespace {

struct ConfKvParams {
  double theta, lambda, w_entropy, w_gap, w_p1, attention_weight;
  uint32_t c_high, c_low, protect, interval, layer_floor;
  bool per_layer, random;

  static ConfKvParams From(const ResolvedParams& p, bool per_layer) {
    return {p.Get("theta"),
            p.Get("lambda"),
            p.Get("w_entropy"),
            p.Get("w_gap"),
            p.Get("w_p1"),
            p.Get("attention_weight"),
            static_cast<uint32_t>(p.Get("c_high")),
            static_cast<uint32_t>(p.Get("c_low")),
            static_cast<uint32_t>(p.Get("protect")),
            static_cast<uint32_t>(p.Get("interval")),
            per_layer ? static_cast<uint32_t>(p.Get("layer_floor")) : 0,
            per_layer,
            p.Get("random") > 0};
  }
};

class ConfKvPolicy final : public Policy {
 public:
  explicit ConfKvPolicy(ConfKvParams p) : p_(p) {}
  const PolicyDescriptor& descriptor() const override {
    return p_.per_layer ? ConfKvLDescriptor() : ConfKvDescriptor();
  }

  Decision Step(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d;
    d.keep.resize(streams.size());
    const LogitStats& ls = *ctx.logits;  // required: the engine checked it
    d.confidence =
        Confidence(ls.entropy, ls.p1, ls.p2, ctx.vocab_size, p_.w_entropy, p_.w_gap, p_.w_p1);
    const uint32_t base = d.confidence > p_.theta ? p_.c_high : p_.c_low;
    d.budget_tokens = BudgetFor(base, 0, ctx.num_layers);
    const bool evict = ctx.step % p_.interval == 0;
    d.scores_written = true;
    size_t longest = 0;
    for (const StreamState& st : streams) longest = std::max(longest, st.positions.size());
    // Streams are independent: each chunk writes only its streams' scores and keep-sets.
    ParallelFor(streams.size(), StreamGrain(longest), [&](size_t begin, size_t end) {
      for (size_t s = begin; s < end; ++s) {
        // The loop waits on memory, not arithmetic: the selection's loads of the positions
        // start before the update.
        PrefetchPositions(streams[s]);
        const float max_ema = UpdateEma(streams[s]);
        const uint32_t budget = BudgetFor(base, streams[s].layer, ctx.num_layers);
        if (evict && streams[s].positions.size() > budget) {
          d.keep[s] = p_.random
                          ? KeepSet::FromSlots(RandomKeep(streams[s].positions, streams[s].layer,
                                                          streams[s].kv_head, budget, p_.protect))
                          : ConfKvKeep(streams[s].next_scores, streams[s].positions, budget,
                                       p_.protect, p_.attention_weight, max_ema);
        }
      }
    });
    return d;
  }

  bool has_kernel_step() const override { return !p_.random; }
  KernelStep PlanKernelStep(const CallContext& ctx) const override {
    KernelStep k;
    const LogitStats& ls = *ctx.logits;
    k.confidence =
        Confidence(ls.entropy, ls.p1, ls.p2, ctx.vocab_size, p_.w_entropy, p_.w_gap, p_.w_p1);
    const uint32_t base = k.confidence > p_.theta ? p_.c_high : p_.c_low;
    k.budget_tokens = BudgetFor(base, 0, ctx.num_layers);
    k.op = {kernels::ScoreRule::kEma, static_cast<float>(p_.lambda),
            static_cast<float>(p_.attention_weight), true, ctx.step % p_.interval == 0};
    for (uint32_t l = 0; l < ctx.num_layers; ++l) {
      k.layer_budget.push_back(BudgetFor(base, l, ctx.num_layers));
    }
    k.protect = p_.protect;
    return k;
  }

  // Explicit compression (after prefill): window scores, when sent, seed the EMA of slots
  // not scored yet; the target (default C_low) applies with the same priority rule.
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    Decision d;
    d.keep.resize(streams.size());
    const uint32_t base = ctx.target_tokens > 0 ? ctx.target_tokens : p_.c_low;
    d.budget_tokens = BudgetFor(base, 0, ctx.num_layers);
    d.scores_written = true;
    for (size_t s = 0; s < streams.size(); ++s) {
      StreamState& st = streams[s];
      for (size_t j = 0; j < st.scores.size(); ++j) {
        st.next_scores[j] = std::isnan(st.scores[j]) && j < st.window_scores.size()
                                ? st.window_scores[j]
                                : st.scores[j];
      }
      const uint32_t budget = BudgetFor(base, st.layer, ctx.num_layers);
      if (st.positions.size() <= budget) continue;
      std::vector<float> ema(st.next_scores.begin(), st.next_scores.end());
      for (float& e : ema) {
        if (std::isnan(e)) e = 0;  // never scored: only recency speaks for it
      }
      d.keep[s] = ConfKvKeep(ema, st.positions, budget, p_.protect, p_.attention_weight);
    }
    return d;
  }

 private:
  uint32_t BudgetFor(uint32_t base, uint32_t layer, uint32_t num_layers) const {
    return p_.per_layer ? ConfKvLayerBudget(base, layer, num_layers, p_.layer_floor) : base;
  }
  // Asks for the cache lines of a stream's positions.
  static void PrefetchPositions(const StreamState& st) {
    const char* p = reinterpret_cast<const char*>(st.positions.data());
    for (size_t at = 0; at < st.positions.size() * sizeof(int64_t); at += 64) {
      __builtin_prefetch(p + at);
    }
  }
  // e <- lambda e + (1 - lambda) a; a slot's first row sets e = a. Returns max e (the
  // stream's normalizer), or NaN when some slot was left unscored.
  // The update is the kernels' (kernels/select.h, ScoreRule::kEma), read from the scores and
  // written to next_scores in one pass; slots past the row keep their scores.
  float UpdateEma(StreamState& st) const {
    const size_t rows = st.attention.size();
    if (st.scores.data() != st.next_scores.data()) {  // (the spans may alias: policy.h)
      std::copy(st.scores.begin() + static_cast<ptrdiff_t>(rows), st.scores.end(),
                st.next_scores.begin() + static_cast<ptrdiff_t>(rows));
    }
    const kernels::StreamSlice slice{0, static_cast<uint32_t>(rows), 0, 0};
    float max_ema = 0;
    kernels::UpdateScoresRef(kernels::ScoreRule::kEma, static_cast<float>(p_.lambda), &slice, 1,
                             st.attention.data(), st.scores.data(), st.next_scores.data(),
                             &max_ema);
    return st.attention.size() == st.scores.size() ? max_ema : std::nanf("");
  }
  const ConfKvParams p_;
};

absl::Status CheckConfKv(const ResolvedParams& p) {
  const double smallest = std::min(p.Get("c_high"), p.Get("c_low"));
  const double floor = p.values().count("layer_floor") ? p.Get("layer_floor") : smallest;
  if (p.Get("protect") >= std::min(smallest, floor)) {
    return absl::InvalidArgumentError(absl::StrCat("policy.params[protect]: ", p.Get("protect"),
                                                   " must be below every budget (smallest ",
                                                   std::min(smallest, floor), ")"));
  }
  if (std::fabs(p.Get("w_entropy") + p.Get("w_gap") + p.Get("w_p1") - 1.0) > 1e-6) {
    return absl::InvalidArgumentError(
        "policy.params[w_entropy]: w_entropy + w_gap + w_p1 must sum to 1");
  }
  return absl::OkStatus();
}

std::vector<ParamSpec> ConfKvParamSpecs(bool per_layer) {
  std::vector<ParamSpec> specs = {
      {"theta", 0.7, 0, 1, false, "confidence threshold: above it the budget is c_high"},
      {"c_high", 128, 1, 1 << 24, true, "budget (tokens per stream) when confident"},
      {"c_low", 256, 1, 1 << 24, true, "budget when not confident"},
      {"lambda", 0.9, 0, 1, false, "EMA decay of attention scores"},
      {"w_entropy", 0.4, 0, 1, false, "confidence weight of 1 - H / ln V"},
      {"w_gap", 0.3, 0, 1, false, "confidence weight of 1 - p2 / p1"},
      {"w_p1", 0.3, 0, 1, false, "confidence weight of p1"},
      {"attention_weight", 0.65, 0, 1, false,
       "priority weight of normalized EMA (recency gets the rest)"},
      {"protect", 32, 0, 1 << 20, true, "P, newest tokens never evicted (64 for long context)"},
      {"interval", 1, 1, 1 << 20, true, "evict every k steps (scores update every step)"},
      {"random", 0, 0, 1, true,
       "ablation: 1 = evict uniformly at random among unprotected slots (same budgets)"}};
  if (per_layer) {
    specs.push_back(
        {"layer_floor", 96, 1, 1 << 24, true, "per-layer budgets are max(floor, C * 0.5^(l/L))"});
  }
  return specs;
}

}  // namespace

const PolicyDescriptor& ConfKvDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "confkv",
      "CONF-KV: confidence-scheduled budget (c_high when confident, else c_low), EMA attention "
      "mixed with recency, protected recent window. Pair with quantization int8 for "
      "confkv+int8.",
      ConfKvParamSpecs(false),
      kLogitStats | kAttentionRows,
      0,
      0,
      std::nanf(""),
      &CheckConfKv};
  return *d;
}

const PolicyDescriptor& ConfKvLDescriptor() {
  static const PolicyDescriptor* d = new PolicyDescriptor{
      "confkv_l",
      "CONF-KV-L: CONF-KV with pyramid layer budgets C(l) = max(96, C * 0.5^(l/L)) for both "
      "c_high and c_low.",
      ConfKvParamSpecs(true),
      kLogitStats | kAttentionRows,
      0,
      0,
      std::nanf(""),
      &CheckConfKv};
  return *d;
}

std::unique_ptr<Policy> MakeConfKvPolicy(const ResolvedParams& params) {
  return std::make_unique<ConfKvPolicy>(ConfKvParams::From(params, false));
}
std::unique_ptr<Policy> MakeConfKvLPolicy(const ResolvedParams& params) {
  return std::make_unique<ConfKvPolicy>(ConfKvParams::From(params, true));
}

}  // namespace kvmem::policy
