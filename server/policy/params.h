#pragma once
// Policy parameters: each policy declares its parameters with defaults and bounds; a
// sequence's overrides are checked against them once, at CreateSequence.
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmem::policy {

struct ParamSpec {
  std::string name;
  double default_value;
  double min_value;
  double max_value;
  bool integer;  // must be a whole number
  std::string description;
};

using ParamOverrides = absl::flat_hash_map<std::string, double>;

// The parameters of one policy instance: defaults with the overrides applied.
class ResolvedParams {
 public:
  // Rejects unknown names, non-finite values, values out of bounds and fractional values of
  // integer parameters; the message names "policy.params[<name>]" and the limit.
  static absl::StatusOr<ResolvedParams> Resolve(absl::string_view policy,
                                                const std::vector<ParamSpec>& specs,
                                                const ParamOverrides& overrides);
  // The value of a declared parameter (a programming error otherwise).
  double Get(absl::string_view name) const;
  const absl::flat_hash_map<std::string, double>& values() const { return values_; }

 private:
  absl::flat_hash_map<std::string, double> values_;
};

}  // namespace kvmem::policy
