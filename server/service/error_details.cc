#include "server/service/error_details.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/engine/engine.h"

namespace kvmem::service {
namespace {

bool IsPathChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' ||
         c == ']';
}

// The text after "<field>: ", or the whole message when it names no field.
absl::string_view AfterField(absl::string_view message, absl::string_view field) {
  if (field.empty()) return message;
  const size_t at = message.find(absl::StrCat(field, ": "));
  return at == absl::string_view::npos ? message : message.substr(at + field.size() + 2);
}

std::optional<uint64_t> DecimalPayload(const absl::Status& status, absl::string_view key) {
  const auto payload = status.GetPayload(key);  // absl::optional<absl::Cord>
  uint64_t value = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &value)) return std::nullopt;
  return value;
}

// The last decimal number in `message`: the epoch the table has moved to in the engine's
// stale-epoch messages ("... but the block table is at epoch 12", "... changed from epoch 9
// to 12 during the read"). Only read when the engine attached no kCurrentEpochPayload (its
// reads do not, yet).
std::optional<uint64_t> LastNumber(absl::string_view message) {
  size_t end = message.size();
  while (end > 0 && !absl::ascii_isdigit(static_cast<unsigned char>(message[end - 1]))) --end;
  size_t begin = end;
  while (begin > 0 && absl::ascii_isdigit(static_cast<unsigned char>(message[begin - 1]))) --begin;
  uint64_t value = 0;
  if (begin == end || !absl::SimpleAtoi(message.substr(begin, end - begin), &value)) {
    return std::nullopt;
  }
  return value;
}

void AddStaleEpochDetails(const absl::Status& status, absl::string_view message,
                          std::optional<uint64_t> sequence_id, google::rpc::Status* out) {
  std::optional<uint64_t> epoch = DecimalPayload(status, engine::kCurrentEpochPayload);
  if (!epoch && FieldPathOf(message) == "epoch") epoch = LastNumber(message);
  const std::optional<uint64_t> version = DecimalPayload(status, engine::kCurrentVersionPayload);
  const std::string subject =
      sequence_id ? absl::StrCat("sequence/", *sequence_id) : std::string("sequence");
  google::rpc::PreconditionFailure failure;
  google::rpc::PreconditionFailure::Violation* violation = failure.add_violations();
  violation->set_type("EPOCH");
  violation->set_subject(subject);
  violation->set_description(epoch ? absl::StrCat("the current epoch is ", *epoch)
                                   : CutMessage(AfterField(message, "epoch"), kMaxDetailTextBytes));
  if (version) {
    violation = failure.add_violations();
    violation->set_type("VERSION");
    violation->set_subject(subject);
    violation->set_description(absl::StrCat("the current table version is ", *version));
  }
  out->add_details()->PackFrom(failure);
  google::rpc::ErrorInfo info;
  info.set_reason("STALE_EPOCH");
  info.set_domain("kvmem");
  if (sequence_id) (*info.mutable_metadata())["sequence_id"] = absl::StrCat(*sequence_id);
  if (epoch) (*info.mutable_metadata())["current_epoch"] = absl::StrCat(*epoch);
  if (version) (*info.mutable_metadata())["current_version"] = absl::StrCat(*version);
  out->add_details()->PackFrom(info);
}

}  // namespace

std::string FieldPathOf(absl::string_view message) {
  // A streamed chunk's errors start with its index: "chunk 3: positions[0]: ...".
  if (absl::StartsWith(message, "chunk ")) {
    const size_t colon = message.find(": ");
    if (colon != absl::string_view::npos) message.remove_prefix(colon + 2);
  }
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return "";
  const absl::string_view path = message.substr(0, colon);
  for (char c : path) {
    if (!IsPathChar(c)) return "";
  }
  return std::string(path);
}

std::string QuotaSubjectOf(absl::string_view message) {
  const size_t flag = message.find("--");
  if (flag != absl::string_view::npos) {
    size_t end = flag + 2;
    while (end < message.size() && (absl::ascii_isalnum(static_cast<unsigned char>(message[end])) ||
                                    message[end] == '-' || message[end] == '_')) {
      ++end;
    }
    if (end > flag + 2) return std::string(message.substr(flag, end - flag));
  }
  const std::string resource = FieldPathOf(message);
  if (resource == "pool") return "--pool-bytes";
  return resource.empty() ? "kvmemd" : resource;
}

grpc::Status ToGrpc(const absl::Status& status, std::optional<uint64_t> sequence_id) {
  if (status.ok()) return grpc::Status::OK;
  const google::rpc::Status rich = ToRpcStatus(status, sequence_id);
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), rich.message(),
                      rich.SerializeAsString());
}

google::rpc::Status ToRpcStatus(const absl::Status& status, std::optional<uint64_t> sequence_id) {
  google::rpc::Status rich;
  if (status.ok()) return rich;
  const std::string message = CutMessage(status.message(), kMaxStatusMessageBytes);
  rich.set_code(static_cast<int32_t>(status.code()));
  rich.set_message(message);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange: {
      google::rpc::BadRequest bad;
      google::rpc::BadRequest::FieldViolation* violation = bad.add_field_violations();
      violation->set_field(FieldPathOf(status.message()));
      violation->set_description(
          CutMessage(AfterField(status.message(), violation->field()), kMaxDetailTextBytes));
      rich.add_details()->PackFrom(bad);
      break;
    }
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
      if (status.GetPayload(engine::kCurrentEpochPayload) ||
          status.GetPayload(engine::kCurrentVersionPayload) ||
          FieldPathOf(status.message()) == "epoch") {
        AddStaleEpochDetails(status, status.message(), sequence_id, &rich);
      }
      break;
    case absl::StatusCode::kResourceExhausted: {
      google::rpc::QuotaFailure quota;
      google::rpc::QuotaFailure::Violation* violation = quota.add_violations();
      violation->set_subject(QuotaSubjectOf(status.message()));
      violation->set_description(CutMessage(status.message(), kMaxDetailTextBytes));
      rich.add_details()->PackFrom(quota);
      break;
    }
    case absl::StatusCode::kNotFound:
      if (sequence_id) {  // the sequence the call named is gone (released, lapsed) or never was
        google::rpc::ResourceInfo info;
        info.set_resource_type("kvmem.v1.Sequence");
        info.set_resource_name(absl::StrCat("sequence/", *sequence_id));
        info.set_description(CutMessage(status.message(), kMaxDetailTextBytes));
        rich.add_details()->PackFrom(info);
      }
      break;
    default:
      break;
  }
  return rich;
}

}  // namespace kvmem::service
