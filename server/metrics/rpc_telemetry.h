#pragma once
// RPCs by method and status code, their latency, and the bytes of their messages: recorded
// by the service's interceptor (server/service/rpc_interceptor.h), read by the exporter.
// Methods are fixed at construction (the services' own), so labels stay bounded; a call to
// any other method counts as "other".
#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "server/engine/telemetry.h"

namespace kvmem::metrics {

class RpcTelemetry {
 public:
  static constexpr int kCodes = 17;  // grpc::StatusCode OK .. UNAUTHENTICATED

  // `methods`: full names ("/kvmem.v1.KvCache/Step"); labelled by the part after the last '/'.
  explicit RpcTelemetry(const std::vector<std::string>& methods);

  struct Method {
    explicit Method(std::string label);
    std::string label;
    std::array<std::atomic<uint64_t>, kCodes> calls{};
    engine::Histogram seconds;
  };
  // The entry of a full method name; the "other" entry for an unknown one.
  Method& For(const char* full_name);
  const std::vector<std::unique_ptr<Method>>& methods() const { return methods_; }

  // Bytes of KvCache messages (requests in, responses out) over gRPC.
  std::atomic<uint64_t> bytes_in{0};
  std::atomic<uint64_t> bytes_out{0};

  // One answer of a same-host step channel: a batch (`call`) counts as a StepBatch call (its
  // code and latency in StepBatch's entry, as over gRPC) and in channel_batches; a chunk of
  // a long answer counts only its bytes. The bytes count under their own transport.
  void RecordChannelAnswer(bool call, int code, double seconds, uint64_t bytes_in,
                           uint64_t bytes_out);
  std::atomic<uint64_t> channel_batches{0};
  std::atomic<uint64_t> channel_bytes_in{0};
  std::atomic<uint64_t> channel_bytes_out{0};

 private:
  std::vector<std::unique_ptr<Method>> methods_;  // the services' methods, then "other"
  Method* step_batch_ = nullptr;                  // StepBatch's entry ("other" if not served)
  absl::flat_hash_map<std::string, Method*> by_full_name_;
};

// grpc::StatusCode's name ("OK", "RESOURCE_EXHAUSTED", ...).
const char* StatusCodeName(int code);

}  // namespace kvmem::metrics
