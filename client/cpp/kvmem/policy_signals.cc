#include "kvmem/policy_signals.h"

namespace kvmem::client::internal {

bool PolicySignals::known() const {
  absl::MutexLock lock(&mu_);
  return !by_policy_.empty();
}

void PolicySignals::Learn(const Info& info) {
  absl::MutexLock lock(&mu_);
  for (const PolicyInfo& p : info.policies) {
    Needs needs{false, false};
    for (const std::string& s : p.step_signals) {
      if (s == "logit_stats") needs.logit_stats = true;
      if (s == "attention_rows") needs.attention_rows = true;
    }
    by_policy_[p.name] = needs;
  }
}

void PolicySignals::Record(uint64_t sequence_id, const std::string& policy) {
  absl::MutexLock lock(&mu_);
  auto it = by_policy_.find(policy);
  if (it != by_policy_.end()) by_sequence_[sequence_id] = it->second;
}

void PolicySignals::Inherit(uint64_t parent_id, uint64_t child_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_sequence_.find(parent_id);
  if (it == by_sequence_.end()) return;
  const Needs needs = it->second;  // the insertion below may move the parent's entry
  by_sequence_[child_id] = needs;
}

PolicySignals::Needs PolicySignals::Of(uint64_t sequence_id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_sequence_.find(sequence_id);
  return it == by_sequence_.end() ? Needs{} : it->second;
}

}  // namespace kvmem::client::internal
