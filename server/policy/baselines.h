#pragma once
// Classic baselines over accumulated or positional scores: streaming_llm (attention sinks
// plus a recent window) and h2o (heavy hitters plus a recent window).
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& StreamingLlmDescriptor();
const PolicyDescriptor& H2oDescriptor();
std::unique_ptr<Policy> MakeStreamingLlmPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakeH2oPolicy(const ResolvedParams& params);

}  // namespace kvmem::policy
