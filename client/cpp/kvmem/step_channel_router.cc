#include "kvmem/step_channel_router.h"

#include <algorithm>
#include <utility>

namespace kvmem::client::internal {

StepChannelRouter::StepChannelRouter(v1::KvCache::Stub* stub, absl::Duration deadline,
                                     absl::Duration first_reopen_wait, std::string authorization)
    : stub_(stub),
      deadline_(deadline),
      authorization_(std::move(authorization)),
      first_reopen_wait_(std::max(first_reopen_wait, absl::Milliseconds(1))),
      reopen_wait_(first_reopen_wait_) {}

absl::Status StepChannelRouter::Open(uint64_t capacity_bytes, uint64_t signal_bytes) {
  absl::StatusOr<std::unique_ptr<StepChannelClient>> opened =
      StepChannelClient::Open(stub_, capacity_bytes, deadline_, signal_bytes, authorization_);
  if (!opened.ok()) return opened.status();
  std::shared_ptr<StepChannelClient> replaced;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  replaced = std::move(channel_);
  channel_ = *std::move(opened);
  wanted_capacity_ = channel_->capacity();
  wanted_signal_bytes_ = signal_bytes;
  reopen_wait_ = first_reopen_wait_;
  return absl::OkStatus();
}

void StepChannelRouter::Close() {
  std::shared_ptr<StepChannelClient> closed;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  closed = std::move(channel_);
  wanted_capacity_.reset();
}

std::shared_ptr<StepChannelClient> StepChannelRouter::current() const {
  absl::MutexLock lock(&mu_);
  return channel_;
}

bool StepChannelRouter::open() const {
  std::shared_ptr<StepChannelClient> channel;
  {
    absl::MutexLock lock(&mu_);
    channel = channel_;
  }
  return channel != nullptr && !channel->gone();
}

std::shared_ptr<StepChannelClient> StepChannelRouter::ForBatch() {
  uint64_t capacity = 0, signal_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    if (channel_ != nullptr || !wanted_capacity_ || absl::Now() < reopen_at_) return channel_;
    capacity = *wanted_capacity_;
    signal_bytes = wanted_signal_bytes_;
    reopen_wait_ = std::min(2 * reopen_wait_, absl::Minutes(1));  // the wait if this fails
    reopen_at_ = absl::Now() + reopen_wait_;
  }
  // The call's own deadline: a daemon that refuses a channel answers at once, and one that
  // does not answer would hold the batch as long over gRPC.
  absl::StatusOr<std::unique_ptr<StepChannelClient>> opened =
      StepChannelClient::Open(stub_, capacity, deadline_, signal_bytes, authorization_);
  absl::MutexLock lock(&mu_);
  // Kept only while still wanted and not replaced meanwhile (Open). The wait stays doubled
  // until the new channel answers a batch (Answered): one that opens but fails every batch
  // is not reopened every first wait.
  if (opened.ok() && wanted_capacity_ && channel_ == nullptr) {
    channel_ = *std::move(opened);
    reopen_at_ = absl::InfinitePast();
    reopen_unconfirmed_.store(true, std::memory_order_relaxed);
  }
  return channel_;
}

void StepChannelRouter::Answered() {
  batches_.fetch_add(1, std::memory_order_relaxed);
  if (!reopen_unconfirmed_.load(std::memory_order_relaxed)) return;
  absl::MutexLock lock(&mu_);
  reopen_wait_ = first_reopen_wait_;
  reopen_unconfirmed_.store(false, std::memory_order_relaxed);
}

void StepChannelRouter::Drop(const StepChannelClient* gone) {
  std::shared_ptr<StepChannelClient> dropped;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  if (channel_.get() != gone) return;
  dropped = std::move(channel_);
  reopen_at_ = absl::Now() + reopen_wait_;  // never, for an infinite wait
}

}  // namespace kvmem::client::internal
