#include "server/policy/params.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "server/common/client_text.h"

namespace kvmem::policy {

absl::StatusOr<ResolvedParams> ResolvedParams::Resolve(absl::string_view policy,
                                                       const std::vector<ParamSpec>& specs,
                                                       const ParamOverrides& overrides) {
  ResolvedParams resolved;
  for (const ParamSpec& spec : specs) resolved.values_[spec.name] = spec.default_value;
  for (const auto& [name, value] : overrides) {
    const ParamSpec* spec = nullptr;
    for (const ParamSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) {
      std::vector<std::string> known;
      known.reserve(specs.size());
      for (const ParamSpec& s : specs) known.push_back(s.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.params[", EchoClientText(name), "]: unknown parameter of policy \"", policy,
          "\" (known: ", known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
    }
    if (!std::isfinite(value) || value < spec->min_value || value > spec->max_value) {
      return absl::InvalidArgumentError(absl::StrCat("policy.params[", name, "]: ", value,
                                                     " is outside [", spec->min_value, ", ",
                                                     spec->max_value, "]"));
    }
    if (spec->integer && value != std::floor(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.params[", name, "]: ", value, " must be a whole number"));
    }
    resolved.values_[name] = value;
  }
  return resolved;
}

double ResolvedParams::Get(absl::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) std::abort();  // a policy reading a parameter it did not declare
  return it->second;
}

}  // namespace kvmem::policy
