#include "server/service/step_channel.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "google/rpc/status.pb.h"
#include "kvmem/v1/step_channel.h"
#include "server/common/mutex.h"
#include "server/store/segment_guard.h"

namespace kvmem::service {

namespace layout = v1::step_channel;

StepChannelBudget::Lease::~Lease() {
  if (budget_ == nullptr) return;
  kvmem::MutexLock lock(&budget_->mu_);
  --budget_->channels_;
  budget_->bytes_ -= bytes_;
}

absl::StatusOr<StepChannelBudget::Lease> StepChannelBudget::Open(uint64_t bytes) {
  kvmem::MutexLock lock(&mu_);
  if (channels_ >= max_channels_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("OpenStepChannel: --max-step-channels=", max_channels_,
                     " channels are open; close one or use StepBatch over gRPC"));
  }
  if (bytes > max_bytes_ - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "capacity_bytes: a channel holding ", bytes, " bytes would pass --step-channel-bytes=",
        max_bytes_, " (", bytes_, " held by open channels); ask for less"));
  }
  ++channels_;
  bytes_ += bytes;
  return Lease(this, bytes);
}

uint32_t StepChannelBudget::open() const {
  kvmem::MutexLock lock(&mu_);
  return channels_;
}

uint64_t StepChannel::SegmentBytes(uint64_t capacity) {
  return layout::kHeaderBytes + 2 * capacity;
}

uint64_t StepChannel::HeldBytes(uint64_t capacity) {
  return SegmentBytes(capacity) + ArenaBlockBytes(capacity);
}

absl::StatusOr<std::unique_ptr<StepChannel>> StepChannel::Create(uint64_t capacity) {
  absl::StatusOr<std::unique_ptr<store::SharedSegment>> segment =
      store::SharedSegment::Create("kvmem-chan", SegmentBytes(capacity));
  if (!segment.ok()) return segment.status();
  auto* header = new ((*segment)->data()) layout::Header{};
  header->magic = layout::kMagic;
  header->layout_version = layout::kLayoutVersion;
  header->request_offset = layout::kHeaderBytes;
  header->response_offset = layout::kHeaderBytes + capacity;
  header->capacity_bytes = capacity;
  return std::unique_ptr<StepChannel>(new StepChannel(*std::move(segment), capacity));
}

StepChannel::Served StepChannel::ServeOne(absl::Duration wait, const Handler& handler) {
  uint8_t* const data = segment_->data();
  auto* header = reinterpret_cast<layout::Header*>(data);
  google::protobuf::ArenaOptions options;
  options.initial_block = arena_block_.get();
  options.initial_block_size = ArenaBlockBytes(capacity_);
  google::protobuf::Arena arena(options);
  v1::StepBatchRequest& request = *google::protobuf::Arena::CreateMessage<v1::StepBatchRequest>(&arena);
  grpc::Status status;
  uint32_t seq = 0;
  {
    store::SegmentGuard guard(data, segment_->bytes());
    seq = header->request_seq.load(std::memory_order_acquire);
    if (seq == served_seq_ && !guard.faulted()) {
      layout::FutexWait(&header->request_seq, seq, absl::ToInt64Nanoseconds(wait));
      seq = header->request_seq.load(std::memory_order_acquire);
    }
    if (guard.faulted()) return Served::kBroken;
    if (seq == served_seq_) return Served::kIdle;
    const uint32_t bytes = header->request_bytes;  // read once: the client may change it
    if (bytes > capacity_) {
      status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("request_bytes: ", bytes,
                                         " is past the channel's capacity of ", capacity_));
    } else if (!request.ParseFromArray(data + layout::kHeaderBytes, static_cast<int>(bytes))) {
      status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "request: the request area does not hold a StepBatchRequest");
    }
    // What was read from a segment that faulted is zeros, not the client's bytes: run none
    // of it.
    if (guard.faulted()) return Served::kBroken;
  }
  if (!unlinked_) {  // its client has it mapped: no one else needs the name
    segment_->Unlink();
    unlinked_ = true;
  }
  if (status.ok() && request.request_id().empty()) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "request_id: required on a step channel (a response too large for "
                          "the channel is fetched again by it)");
  }
  v1::StepBatchResponse& response =
      *google::protobuf::Arena::CreateMessage<v1::StepBatchResponse>(&arena);
  if (status.ok()) status = handler(request, &response);

  store::SegmentGuard guard(data, segment_->bytes());
  uint8_t* const out = data + layout::kHeaderBytes + capacity_;
  uint32_t code = 0;
  uint64_t bytes = 0;
  if (status.ok()) {
    bytes = response.ByteSizeLong();
    if (bytes > capacity_) {
      code = layout::kRetryOverGrpc;
      bytes = 0;
    } else {
      response.SerializeWithCachedSizesToArray(out);
    }
  } else {
    google::rpc::Status rich;
    if (!status.error_details().empty()) rich.ParseFromString(status.error_details());
    rich.set_code(status.error_code());
    rich.set_message(status.error_message());
    bytes = rich.ByteSizeLong();
    if (bytes > capacity_) {  // a message can't be this long, but never write past the area
      rich.clear_details();
      rich.set_message(rich.message().substr(0, 1024));
      bytes = rich.ByteSizeLong();
    }
    rich.SerializeWithCachedSizesToArray(out);
    code = static_cast<uint32_t>(status.error_code());
  }
  header->response_bytes = static_cast<uint32_t>(bytes);
  header->response_code = code;
  header->response_seq.store(seq, std::memory_order_release);
  layout::FutexWakeAll(&header->response_seq);
  served_seq_ = seq;
  return guard.faulted() ? Served::kBroken : Served::kServed;
}

}  // namespace kvmem::service
