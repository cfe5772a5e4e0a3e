#include "server/service/parsed.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace kvmem::service {

void ParsedBase::Hold(grpc::ByteBuffer* buffer) {
  message_->Clear();
  reservation_.Release();
  status_ = absl::OkStatus();
  held_.Clear();
  held_.Swap(buffer);
  wire_bytes_ = held_.Length();
}

absl::Status ParsedBase::Parse() {
  message_->Clear();
  reservation_.Release();
  grpc::ByteBuffer bytes;
  bytes.Swap(&held_);  // let go of when the parse is done
  grpc::ByteBuffer* const buffer = &bytes;
  const google::protobuf::Descriptor* type = message_->GetDescriptor();
  status_ = [&]() -> absl::Status {
    if (!buffer->Valid()) return absl::OkStatus();  // nothing held: the empty message
    grpc::ProtoBufferReader counting(buffer);
    absl::StatusOr<uint64_t> cost = transport::ParseCost(type, &counting);
    if (!cost.ok()) return cost.status();
    absl::StatusOr<transport::ParseBudget::Reservation> held =
        transport::ParseBudget::Process().Reserve(*cost, type->full_name());
    if (!held.ok()) return held.status();
    reservation_ = *std::move(held);
    grpc::ProtoBufferReader reader(buffer);
    if (!reader.status().ok() || !message_->ParseFromZeroCopyStream(&reader)) {
      message_->Clear();
      reservation_.Release();
      return absl::InvalidArgumentError(
          absl::StrCat("the request does not parse as a ", type->full_name()));
    }
    return absl::OkStatus();
  }();
  return status_;
}

}  // namespace kvmem::service
