#include "server/metrics/rpc_telemetry.h"

#include <cstring>

namespace kvmem::metrics {

RpcTelemetry::Method::Method(std::string l)
    : label(std::move(l)), seconds(engine::LatencyBounds()) {}

RpcTelemetry::RpcTelemetry(const std::vector<std::string>& methods) : full_names_(methods) {
  for (const std::string& name : methods) {
    methods_.push_back(std::make_unique<Method>(name.substr(name.rfind('/') + 1)));
  }
  methods_.push_back(std::make_unique<Method>("other"));
}

RpcTelemetry::Method& RpcTelemetry::For(const char* full_name) {
  for (size_t i = 0; i < full_names_.size(); ++i) {
    if (std::strcmp(full_names_[i].c_str(), full_name) == 0) return *methods_[i];
  }
  return *methods_.back();
}

const char* StatusCodeName(int code) {
  static constexpr const char* kNames[RpcTelemetry::kCodes] = {"OK",
                                                               "CANCELLED",
                                                               "UNKNOWN",
                                                               "INVALID_ARGUMENT",
                                                               "DEADLINE_EXCEEDED",
                                                               "NOT_FOUND",
                                                               "ALREADY_EXISTS",
                                                               "PERMISSION_DENIED",
                                                               "RESOURCE_EXHAUSTED",
                                                               "FAILED_PRECONDITION",
                                                               "ABORTED",
                                                               "OUT_OF_RANGE",
                                                               "UNIMPLEMENTED",
                                                               "INTERNAL",
                                                               "UNAVAILABLE",
                                                               "DATA_LOSS",
                                                               "UNAUTHENTICATED"};
  return code >= 0 && code < RpcTelemetry::kCodes ? kNames[code] : "UNKNOWN";
}

}  // namespace kvmem::metrics
