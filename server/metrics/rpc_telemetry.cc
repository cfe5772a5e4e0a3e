#include "server/metrics/rpc_telemetry.h"

namespace kvmem::metrics {

RpcTelemetry::Method::Method(std::string l)
    : label(std::move(l)), seconds(engine::LatencyBounds()) {}

RpcTelemetry::RpcTelemetry(const std::vector<std::string>& methods) {
  for (const std::string& name : methods) {
    methods_.push_back(std::make_unique<Method>(name.substr(name.rfind('/') + 1)));
    by_full_name_[name] = methods_.back().get();
  }
  methods_.push_back(std::make_unique<Method>("other"));
  step_batch_ = &For("/kvmem.v1.KvCache/StepBatch");
}

void RpcTelemetry::RecordChannelAnswer(bool call, int code, double seconds, uint64_t bytes_in,
                                       uint64_t bytes_out) {
  channel_bytes_in.fetch_add(bytes_in, std::memory_order_relaxed);
  channel_bytes_out.fetch_add(bytes_out, std::memory_order_relaxed);
  if (!call) return;
  if (code >= 0 && code < kCodes) step_batch_->calls[code].fetch_add(1, std::memory_order_relaxed);
  step_batch_->seconds.Observe(seconds);
  channel_batches.fetch_add(1, std::memory_order_relaxed);
}

RpcTelemetry::Method& RpcTelemetry::For(const char* full_name) {
  auto it = by_full_name_.find(absl::string_view(full_name));
  return it == by_full_name_.end() ? *methods_.back() : *it->second;
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
