#pragma once
// The client's side of a same-host step channel (OpenStepChannel in kvmem.proto; layout in
// kvmem/v1/step_channel.h): StepBatch requests written to a shared segment, the daemon
// woken by a futex, the response read from the segment. Internal to the C++ client.
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::client::internal {

class StepChannelClient {
 public:
  // Opens a channel through `stub` (which must outlive it) and maps its segment. Fails on
  // another host (no such segment), on a layout this client does not know, or when the
  // daemon refuses (the status says why). `authorization`: the metadata value of a daemon
  // that checks tokens (empty: none).
  static absl::StatusOr<std::unique_ptr<StepChannelClient>> Open(
      v1::KvCache::Stub* stub, uint64_t capacity_bytes, absl::Duration deadline,
      uint64_t signal_bytes = 0, absl::string_view authorization = {});
  ~StepChannelClient();  // closes the channel (ends the call) and unmaps
  StepChannelClient(const StepChannelClient&) = delete;
  StepChannelClient& operator=(const StepChannelClient&) = delete;

  enum class Outcome {
    kAnswered,     // *status (and, when OK, *response) is the daemon's answer
    kUseGrpc,      // send the request over gRPC instead: it does not fit the area
    kChannelGone,  // the channel closed; whether the request ran is unknown, so the
                   // caller repeats it over gRPC under the same request_id
  };
  // One request at a time (callers queue). `request` must carry a request_id.
  Outcome Call(const v1::StepBatchRequest& request, absl::Time deadline,
               v1::StepBatchResponse* response, absl::Status* status);
  bool gone() const { return gone_.load(std::memory_order_acquire); }
  uint64_t capacity() const { return capacity_; }
  // The signal area (OpenStepChannelRequest.signal_bytes), mapped writable; empty if none.
  absl::Span<uint8_t> signal_area() const { return {signal_data_, signal_bytes_}; }

 private:
  StepChannelClient() = default;
  void Watch();  // runs on watcher_: the call's end closes the channel
  enum class Wait { kAnswered, kGone, kLate };
  // Waits for the answer to `seq`; kLate marks the channel gone (the area is the daemon's
  // until it answers, so no later request may be written there).
  Wait AwaitAnswer(uint32_t seq, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the channel after a batch ran but its answer could not be read whole: the
  // caller repeats it by gRPC under the same request_id.
  Outcome GiveUp() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the request (or kMore) in the area; returns its sequence number.
  uint32_t Post(uint32_t kind, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::OpenStepChannelResponse>> reader_;
  std::thread watcher_;
  std::atomic<bool> gone_{false};
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t capacity_ = 0;
  uint8_t* signal_data_ = nullptr;
  uint64_t signal_bytes_ = 0;
  absl::Mutex mu_;  // one request in flight
  uint32_t seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::client::internal
