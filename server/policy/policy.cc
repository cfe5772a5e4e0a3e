#include "server/policy/policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "server/common/client_text.h"
#include "server/policy/baselines.h"
#include "server/policy/confkv.h"
#include "server/policy/infokv.h"
#include "server/policy/refreekv.h"
#include "server/policy/snapkv.h"
#include "server/policy/window.h"

namespace kvmem::policy {
namespace {

using Factory = std::unique_ptr<Policy> (*)(const ResolvedParams&);

struct Entry {
  const PolicyDescriptor* descriptor;
  Factory make;
};

const std::vector<Entry>& Registry() {
  static const std::vector<Entry>* entries = new std::vector<Entry>{
      {&FullDescriptor(), &MakeFullPolicy},
      {&WindowDescriptor(), &MakeWindowPolicy},
      {&StreamingLlmDescriptor(), &MakeStreamingLlmPolicy},
      {&H2oDescriptor(), &MakeH2oPolicy},
      {&SnapKvDescriptor(), &MakeSnapKvPolicy},
      {&PyramidKvDescriptor(), &MakePyramidKvPolicy},
      {&ConfKvDescriptor(), &MakeConfKvPolicy},
      {&ConfKvLDescriptor(), &MakeConfKvLPolicy},
      {&RefreeKvDescriptor(), &MakeRefreeKvPolicy},
      {&RefreeKvH2oDescriptor(), &MakeRefreeKvH2oPolicy},
      {&InfoKvDescriptor(), &MakeInfoKvPolicy},
      {&InfoKvAdaptiveDescriptor(), &MakeInfoKvAdaptivePolicy},
  };
  return *entries;
}

}  // namespace

std::vector<std::string> SignalNames(SignalSet signals) {
  static constexpr std::pair<Signal, const char*> kNames[] = {{kLogitStats, "logit_stats"},
                                                              {kAttentionRows, "attention_rows"},
                                                              {kWindowScores, "window_scores"},
                                                              {kTokenEntropy, "token_entropy"},
                                                              {kLayerDistance, "layer_distance"}};
  std::vector<std::string> names;
  for (const auto& [bit, name] : kNames) {
    if (signals & bit) names.emplace_back(name);
  }
  return names;
}

const std::vector<PolicyDescriptor>& AllPolicies() {
  static const std::vector<PolicyDescriptor>* all = [] {
    auto* v = new std::vector<PolicyDescriptor>;
    for (const Entry& e : Registry()) v->push_back(*e.descriptor);
    return v;
  }();
  return *all;
}

absl::StatusOr<std::unique_ptr<Policy>> CreatePolicy(absl::string_view name,
                                                     const ParamOverrides& overrides) {
  if (name.empty()) name = "full";
  for (const Entry& e : Registry()) {
    if (e.descriptor->name != name) continue;
    absl::StatusOr<ResolvedParams> params =
        ResolvedParams::Resolve(name, e.descriptor->params, overrides);
    if (!params.ok()) return params.status();
    if (e.descriptor->check != nullptr) {
      if (absl::Status s = e.descriptor->check(*params); !s.ok()) return s;
    }
    return e.make(*std::move(params));
  }
  std::vector<std::string> known;
  for (const Entry& e : Registry()) known.push_back(e.descriptor->name);
  return absl::InvalidArgumentError(absl::StrCat("policy.name: unknown policy \"",
                                                 EchoClientText(name),
                                                 "\" (known: ", absl::StrJoin(known, ", "), ")"));
}

absl::StatusOr<LogitStats> CheckLogitStats(const LogitStats& stats, uint32_t vocab_size) {
  const double max_entropy = std::log(static_cast<double>(vocab_size)) * (1 + 1e-4) + 1e-4;
  if (!std::isfinite(stats.entropy) || stats.entropy < 0 || stats.entropy > max_entropy) {
    return absl::InvalidArgumentError(absl::StrCat("logit_stats.entropy: ", stats.entropy,
                                                   " is outside [0, ln(vocab_size) = ", max_entropy,
                                                   "]"));
  }
  if (!std::isfinite(stats.p1) || stats.p1 <= 0 || stats.p1 > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_stats.p1: ", stats.p1, " is outside (0, 1]"));
  }
  if (!std::isfinite(stats.p2) || stats.p2 < 0 || stats.p2 > stats.p1) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_stats.p2: ", stats.p2, " is outside [0, p1 = ", stats.p1, "]"));
  }
  return stats;
}

absl::StatusOr<LogitStats> LogitStatsFromTopLogprobs(absl::Span<const float> top_logprobs) {
  if (top_logprobs.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logit_stats.top_logprobs: ", top_logprobs.size(), " values; at least 2 are required"));
  }
  double mass = 0;
  double entropy = 0;
  for (size_t i = 0; i < top_logprobs.size(); ++i) {
    const float lp = top_logprobs[i];
    if (!std::isfinite(lp) || lp > 0 || (i > 0 && lp > top_logprobs[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_stats.top_logprobs[", i, "]: ", lp,
                       " must be a finite log-probability <= 0, not above the one before it"));
    }
    const double p = std::exp(static_cast<double>(lp));
    mass += p;
    entropy -= p * lp;
  }
  if (mass > 1 + 1e-3) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_stats.top_logprobs: probabilities sum to ", mass, ", more than 1"));
  }
  const double rest = std::max(0.0, 1 - mass);
  if (rest > 0) entropy -= rest * std::log(rest);
  return LogitStats{static_cast<float>(entropy), std::exp(top_logprobs[0]),
                    std::exp(top_logprobs[1])};
}

KernelStep Policy::PlanKernelStep(const CallContext&) const {
  return {};  // never called: has_kernel_step() is false
}

}  // namespace kvmem::policy
