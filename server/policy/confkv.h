#pragma once
// CONF-KV: a per-step budget chosen from the model's confidence (high confidence -> the
// smaller budget), EMA attention scores mixed with recency, a protected recent window.
// confkv_l adds pyramid-style per-layer budgets.
#include <cmath>
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& ConfKvDescriptor();
const PolicyDescriptor& ConfKvLDescriptor();
std::unique_ptr<Policy> MakeConfKvPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakeConfKvLPolicy(const ResolvedParams& params);

// Per-layer budget of confkv_l: max(floor, base * 0.5^(l / L)), rounded down.
uint32_t ConfKvLayerBudget(uint32_t base, uint32_t layer, uint32_t num_layers, uint32_t floor);

// The keep-set of one stream under CONF-KV's priority rule: r = a_mix * e/max(e) +
// (1 - a_mix) * recency, the last `protect` slots kept, the lowest r evicted down to
// `budget`. `ema` must be initialized (finite).
// `max_ema` is max(ema) when the caller has it (NaN: computed here).
KeepSet ConfKvKeep(absl::Span<const float> ema, absl::Span<const int64_t> positions,
                   uint32_t budget, uint32_t protect, double attention_weight,
                   float max_ema = std::nanf(""));

// The ablation "random" at confkv's budgets: the last `protect` slots kept, the others kept
// by a fixed pseudo-random priority of (layer, kv_head, position), down to `budget`.
std::vector<uint32_t> RandomKeep(absl::Span<const int64_t> positions, uint32_t layer,
                                 uint32_t kv_head, uint32_t budget, uint32_t protect);

}  // namespace kvmem::policy
