#include "kvmem/step_channel_client.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "google/rpc/status.pb.h"
#include "kvmem/attach.h"
#include "kvmem/convert.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/step_channel.h"

namespace kvmem::client::internal {

namespace layout = v1::step_channel;

absl::StatusOr<std::unique_ptr<StepChannelClient>> StepChannelClient::Open(
    v1::KvCache::Stub* stub, uint64_t capacity_bytes, absl::Duration deadline,
    uint64_t signal_bytes, absl::string_view authorization) {
  std::unique_ptr<StepChannelClient> channel(new StepChannelClient());
  if (!authorization.empty()) {
    channel->context_.AddMetadata("authorization", std::string(authorization));
  }
  v1::OpenStepChannelRequest request;
  request.set_capacity_bytes(capacity_bytes);
  request.set_signal_bytes(signal_bytes);
  channel->reader_ = stub->OpenStepChannel(&channel->context_, request);
  v1::OpenStepChannelResponse opened;
  // The first message comes at once; the deadline bounds only the wait for it.
  absl::Notification answered;
  std::thread timer([&channel, &answered, deadline] {
    if (!answered.WaitForNotificationWithTimeout(deadline)) channel->context_.TryCancel();
  });
  const bool read = channel->reader_->Read(&opened);
  answered.Notify();
  timer.join();
  if (!read) {
    const grpc::Status s = channel->reader_->Finish();
    channel->reader_.reset();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("OpenStepChannel: ", s.error_message()));
  }
  if (opened.layout_version() != layout::kLayoutVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("OpenStepChannel: layout_version ", opened.layout_version(),
                     "; this client knows ", layout::kLayoutVersion));
  }
  const uint64_t bytes = opened.segment_bytes();
  if (bytes < layout::kHeaderBytes + 2 * opened.capacity_bytes()) {
    return absl::FailedPreconditionError("OpenStepChannel: the segment is smaller than announced");
  }
  const SegmentTicket ticket{opened.attach().socket(), opened.attach().ticket(),
                             opened.attach().daemon_uid()};
  absl::StatusOr<uint8_t*> data =
      MapSegment(ticket, v1::attach::kChannel, bytes, true, "OpenStepChannel: the segment");
  if (!data.ok()) return data.status();
  channel->data_ = *data;
  channel->bytes_ = bytes;
  channel->capacity_ = opened.capacity_bytes();
  const auto* header = reinterpret_cast<const layout::Header*>(channel->data_);
  if (header->magic != layout::kMagic || header->capacity_bytes != channel->capacity_) {
    return absl::FailedPreconditionError("OpenStepChannel: the segment has no channel header");
  }
  if (opened.nonce().size() != layout::kNonceBytes ||
      std::memcmp(header->nonce, opened.nonce().data(), layout::kNonceBytes) != 0) {
    return absl::FailedPreconditionError(
        "OpenStepChannel: the segment received is not the channel the daemon opened");
  }
  if (signal_bytes > 0) {
    if (opened.signal_bytes() < signal_bytes) {
      return absl::FailedPreconditionError(
          "OpenStepChannel: the daemon opened no signal area (an older kvmemd?)");
    }
    absl::StatusOr<uint8_t*> area =
        MapSegment(ticket, v1::attach::kSignalArea, opened.signal_bytes(), true,
                   "OpenStepChannel: the signal area");
    if (!area.ok()) return area.status();
    channel->signal_data_ = *area;
    channel->signal_bytes_ = opened.signal_bytes();
  }
  // The call's end (the daemon drained, or died) closes the channel.
  channel->watcher_ = std::thread([raw = channel.get()] { raw->Watch(); });
  return channel;
}

void StepChannelClient::Watch() {
  v1::OpenStepChannelResponse more;
  while (reader_->Read(&more)) {
  }
  reader_->Finish().ok();  // the reason goes nowhere: a call sees only that the channel closed
  gone_.store(true, std::memory_order_release);
  if (data_ != nullptr) {
    layout::FutexWakeAll(&reinterpret_cast<layout::Header*>(data_)->response_seq);
  }
}

StepChannelClient::~StepChannelClient() {
  context_.TryCancel();
  if (watcher_.joinable()) {
    watcher_.join();
  } else if (reader_ != nullptr) {  // Open failed after the call began
    v1::OpenStepChannelResponse more;
    while (reader_->Read(&more)) {
    }
    reader_->Finish().ok();
  }
  if (data_ != nullptr) munmap(data_, bytes_);
  if (signal_data_ != nullptr) munmap(signal_data_, signal_bytes_);
}

StepChannelClient::Wait StepChannelClient::AwaitAnswer(uint32_t seq, absl::Time deadline) {
  auto* header = reinterpret_cast<layout::Header*>(data_);
  for (;;) {
    const uint32_t answered = header->response_seq.load(std::memory_order_acquire);
    if (answered == seq) return Wait::kAnswered;
    if (gone()) {
      // An answer written just before the channel closed still counts.
      return header->response_seq.load(std::memory_order_acquire) == seq ? Wait::kAnswered
                                                                         : Wait::kGone;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      // The daemon may still read or run the request: no later request may use the area.
      gone_.store(true, std::memory_order_release);
      context_.TryCancel();
      return Wait::kLate;
    }
    layout::FutexWait(&header->response_seq, answered,
                      absl::ToInt64Nanoseconds(std::min(left, absl::Milliseconds(50))));
  }
}

uint32_t StepChannelClient::Post(uint32_t kind, size_t bytes) {
  auto* header = reinterpret_cast<layout::Header*>(data_);
  header->request_bytes.store(static_cast<uint32_t>(bytes), std::memory_order_relaxed);
  header->request_kind.store(kind, std::memory_order_relaxed);
  const uint32_t seq = ++seq_;
  header->request_seq.store(seq, std::memory_order_release);
  layout::FutexWakeAll(&header->request_seq);
  return seq;
}

StepChannelClient::Outcome StepChannelClient::Call(const v1::StepBatchRequest& request,
                                                   absl::Time deadline,
                                                   v1::StepBatchResponse* response,
                                                   absl::Status* status) {
  absl::MutexLock lock(&mu_);
  if (gone()) return Outcome::kChannelGone;
  const size_t size = request.ByteSizeLong();
  if (size > capacity_) return Outcome::kUseGrpc;
  if (absl::Now() >= deadline) {
    *status = absl::DeadlineExceededError(
        "StepBatch over the step channel: the deadline passed before it was sent; nothing "
        "was sent");
    return Outcome::kAnswered;
  }
  const auto* header = reinterpret_cast<const layout::Header*>(data_);
  const uint8_t* const body = data_ + layout::kHeaderBytes + capacity_;
  request.SerializeWithCachedSizesToArray(data_ + layout::kHeaderBytes);
  uint32_t seq = Post(layout::kBatch, size);
  std::string assembled;  // an answer larger than the area, chunk by chunk
  uint64_t total = 0;
  for (;;) {
    switch (AwaitAnswer(seq, deadline)) {
      case Wait::kAnswered:
        break;
      case Wait::kGone:
        return Outcome::kChannelGone;  // repeated by gRPC: answered once either way
      case Wait::kLate:
        *status = absl::DeadlineExceededError(
            "StepBatch over the step channel: no answer by the deadline (the batch may still "
            "apply; repeat it with the same request_id)");
        return Outcome::kAnswered;
    }
    const uint32_t code = header->response_code.load(std::memory_order_relaxed);
    const uint32_t bytes = header->response_bytes.load(std::memory_order_relaxed);
    if (bytes > capacity_) {
      *status = absl::InternalError("step channel: response_bytes past the channel's capacity");
      return Outcome::kAnswered;
    }
    if (!assembled.empty() && (code != 0 || bytes == 0)) {
      // The batch ran; only its answer's rest is missing. gRPC's StepBatch under the same
      // request_id answers it from the daemon's request-id cache.
      return GiveUp();
    }
    if (code != 0) {
      google::rpc::Status rich;
      if (!rich.ParseFromArray(body, static_cast<int>(bytes))) {
        rich.Clear();
        rich.set_message("step channel: an error without a readable status");
      }
      rich.set_code(static_cast<int32_t>(code));
      *status = FromRpcStatus(rich);
      return Outcome::kAnswered;
    }
    if (assembled.empty()) total = header->response_total.load(std::memory_order_relaxed);
    if (assembled.empty() && total == bytes) {  // the whole answer in the area
      if (!response->ParseFromArray(body, static_cast<int>(bytes))) {
        *status = absl::InternalError("step channel: the area holds no StepBatchResponse");
      } else {
        *status = absl::OkStatus();
      }
      return Outcome::kAnswered;
    }
    if (bytes == 0 || assembled.size() + bytes > total ||
        header->response_total.load(std::memory_order_relaxed) != total) {
      return GiveUp();  // chunks that do not add up: the batch ran all the same
    }
    assembled.append(reinterpret_cast<const char*>(body), bytes);
    if (assembled.size() == total) break;
    seq = Post(layout::kMore, 0);
  }
  if (!response->ParseFromString(assembled)) return GiveUp();
  *status = absl::OkStatus();
  return Outcome::kAnswered;
}

StepChannelClient::Outcome StepChannelClient::GiveUp() {
  gone_.store(true, std::memory_order_release);
  context_.TryCancel();
  return Outcome::kChannelGone;
}

}  // namespace kvmem::client::internal
