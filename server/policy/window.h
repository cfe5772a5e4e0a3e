#pragma once
// The baseline policies that need no signals: `full` keeps every token; `window` keeps the
// last W tokens of every stream (ALGORITHMS.md "window").
#include <memory>

#include "server/policy/policy.h"

namespace kvmem::policy {

const PolicyDescriptor& FullDescriptor();
const PolicyDescriptor& WindowDescriptor();
std::unique_ptr<Policy> MakeFullPolicy(const ResolvedParams& params);
std::unique_ptr<Policy> MakeWindowPolicy(const ResolvedParams& params);

}  // namespace kvmem::policy
