#include "server/service/parsed.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace kvmem::service {

absl::Status ParsedBase::Parse(grpc::ByteBuffer* buffer) {
  message_->Clear();
  reservation_.Release();
  wire_bytes_ = buffer->Length();
  const google::protobuf::Descriptor* type = message_->GetDescriptor();
  status_ = [&]() -> absl::Status {
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
