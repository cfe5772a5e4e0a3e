#pragma once
// Prefill-time selection from the observation window's attention: snapkv (one budget for
// every layer) and pyramidkv (budgets shrinking with depth).
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& SnapKvDescriptor();
const PolicyDescriptor& PyramidKvDescriptor();
std::unique_ptr<Policy> MakeSnapKvPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakePyramidKvPolicy(const ResolvedParams& params);

// SnapKV's keep-set for one stream: the last `window` slots plus the top `keep_prefix` of
// the rest by window scores average-pooled over the rest (kernel `kernel`).
std::vector<uint32_t> SnapKvKeep(absl::Span<const float> window_scores, uint32_t window,
                                 uint32_t keep_prefix, uint32_t kernel);

}  // namespace kvmem::policy
