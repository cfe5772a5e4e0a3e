#pragma once
// ReFreeKV: threshold-free compression. Per layer (from layer 2), evict candidates in a
// fixed order until the attention norm the layer would lose passes T = 1%; the kept share
// is the policy's own decision, reported, never configured. refreekv_h2o orders
// candidates by window scores instead of age.
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& RefreeKvDescriptor();
const PolicyDescriptor& RefreeKvH2oDescriptor();
std::unique_ptr<Policy> MakeRefreeKvPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakeRefreeKvH2oPolicy(const ResolvedParams& params);

}  // namespace kvmem::policy
