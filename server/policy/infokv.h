#pragma once
// InfoKV: information-aware scoring. Each token's score mixes normalized attention with
// normalized entropy E = H (d + tau) (token entropy and layer distance from the worker);
// keeps the last w plus the top C - w. infokv_adaptive splits the total budget across
// layers in proportion to each layer's summed E.
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& InfoKvDescriptor();
const PolicyDescriptor& InfoKvAdaptiveDescriptor();
std::unique_ptr<Policy> MakeInfoKvPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakeInfoKvAdaptivePolicy(const ResolvedParams& params);

// s_i = alpha * A_i / max A + (1 - alpha) * E_i / max E with E_i = H_i (d_i + tau); NaN
// entropies or distances take the mean of the stream's others [ours].
std::vector<float> InfoKvScores(absl::Span<const float> attention,
                                absl::Span<const float> token_entropy,
                                absl::Span<const float> layer_distance, double alpha, double tau);

}  // namespace kvmem::policy
