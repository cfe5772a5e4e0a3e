#pragma once
// Which way a client's StepBatch goes: the same-host step channel while one is open, gRPC
// otherwise. A channel that closes (a drain, a daemon restart) is dropped and opened again
// by a later batch once its wait has passed (ClientOptions::step_channel_reopen, doubled
// after each reopened channel that answers no batch, up to a minute); until then batches go
// by gRPC. Thread-safe; internal to the C++ client.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvmem/step_channel_client.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::client::internal {

class StepChannelRouter {
 public:
  // `stub` must outlive the router. `deadline` bounds each attempt to open a channel;
  // `first_reopen_wait` is the wait after a channel closes (at least 1 ms; infinite: never).
  // `authorization`: the metadata value every open sends (empty: none).
  StepChannelRouter(v1::KvCache::Stub* stub, absl::Duration deadline,
                    absl::Duration first_reopen_wait, std::string authorization = {});
  StepChannelRouter(const StepChannelRouter&) = delete;
  StepChannelRouter& operator=(const StepChannelRouter&) = delete;

  // Opens a channel now, in place of any open one; fails, changing nothing, when the daemon
  // is on another host or refuses. From then on a closed channel is reopened.
  // `signal_bytes`: a signal area with the channel (and with each reopened one).
  absl::Status Open(uint64_t capacity_bytes, uint64_t signal_bytes = 0);
  // Closes the channel and stops reopening it.
  void Close();
  bool open() const;
  // The channel in use now (null: none), without reopening one.
  std::shared_ptr<StepChannelClient> current() const;

  // A batch's channel: the open one, or one opened again in place of a channel that closed
  // once its wait has passed (one thread tries; the others go by gRPC meanwhile); null:
  // go by gRPC.
  std::shared_ptr<StepChannelClient> ForBatch();
  // The channel ForBatch gave answered a batch: counted, and a reopened channel's wait goes
  // back to the first.
  void Answered();
  // `gone` closed: it is dropped (if still the one in use) and reopened after the wait.
  void Drop(const StepChannelClient* gone);
  // Batches answered through a channel so far.
  uint64_t batches() const { return batches_.load(std::memory_order_relaxed); }

 private:
  v1::KvCache::Stub* const stub_;
  const absl::Duration deadline_;
  const std::string authorization_;
  const absl::Duration first_reopen_wait_;
  mutable absl::Mutex mu_;
  std::shared_ptr<StepChannelClient> channel_ ABSL_GUARDED_BY(mu_);
  // While the caller wants a channel (Open succeeded, no Close since): the capacity it
  // asked for, and when a dropped channel may be opened again.
  std::optional<uint64_t> wanted_capacity_ ABSL_GUARDED_BY(mu_);
  uint64_t wanted_signal_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time reopen_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration reopen_wait_ ABSL_GUARDED_BY(mu_);
  // A reopened channel whose wait stays doubled until it answers a batch: read without the
  // lock on every answered batch, so that only the first after a reopen takes it.
  std::atomic<bool> reopen_unconfirmed_{false};
  std::atomic<uint64_t> batches_{0};
};

}  // namespace kvmem::client::internal
