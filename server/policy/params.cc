#include "server/policy/params.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
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
      // A name that is not a plain key (too long, or with characters a field path cannot
      // hold) is echoed after the map's path, so that the error still names a field.
      const bool plain_key =
          !name.empty() && name.size() <= kMaxEchoedBytes &&
          std::all_of(name.begin(), name.end(), [](char c) {
            return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_';
          });
      const std::string known_list = known.empty() ? "none" : absl::StrJoin(known, ", ");
      if (!plain_key) {
        return absl::InvalidArgumentError(absl::StrCat("policy.params: unknown parameter \"",
                                                       EchoClientText(name), "\" of policy \"",
                                                       policy, "\" (known: ", known_list, ")"));
      }
      return absl::InvalidArgumentError(absl::StrCat("policy.params[", name,
                                                     "]: unknown parameter of policy \"", policy,
                                                     "\" (known: ", known_list, ")"));
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
