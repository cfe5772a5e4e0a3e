#pragma once
// ToGrpc: an absl::Status as the gRPC status a client sees. absl and gRPC share the canonical
// code space, so codes map 1:1; the message is unchanged (cut when too long). The status
// details carry a google.rpc.Status with the same code and message and, by code, the
// google.rpc detail a program reads instead of parsing the message:
//   INVALID_ARGUMENT, OUT_OF_RANGE   BadRequest: one FieldViolation, the field path the
//                                    message starts with ("layout.block_tokens: ...").
//   FAILED_PRECONDITION, ABORTED     PreconditionFailure (type "EPOCH", subject
//     on a stale epoch               "sequence/<id>", the current epoch in the description)
//                                    and ErrorInfo (reason "STALE_EPOCH", domain "kvmem",
//                                    metadata "current_epoch" and "current_version"), from
//                                    the payloads engine::kCurrentEpochPayload and
//                                    kCurrentVersionPayload when the engine attached them.
//   RESOURCE_EXHAUSTED               QuotaFailure: subject the kvmemd flag that sets the
//                                    limit ("--max-sequences"), as the message names it.
// Every other code carries the google.rpc.Status alone.
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/support/status.h"
#include "server/common/client_text.h"

namespace kvmem::service {

// Longest status message sent to a client. The message travels in a header twice (gRPC's
// grpc-message and the google.rpc.Status in grpc-status-details-bin); a longer one would
// pass a client's 8 KiB metadata limit and reach it as a metadata-size failure instead of
// its own code.
inline constexpr size_t kMaxStatusMessageBytes = 2048;
// kMaxDetailTextBytes and CutMessage: server/common/client_text.h.

// `sequence_id`: the sequence the call acted on, the subject of an epoch violation.
grpc::Status ToGrpc(const absl::Status& status, std::optional<uint64_t> sequence_id = std::nullopt);
// The google.rpc.Status ToGrpc sends as details (code 0 and nothing else for OK): also the
// per-entry status of a StepBatch.
google::rpc::Status ToRpcStatus(const absl::Status& status,
                                std::optional<uint64_t> sequence_id = std::nullopt);

// The field path a message starts with: "layout.block_tokens" of "layout.block_tokens: 0
// is ...", "positions[0]" of "chunk 1: positions[0]: ..." (a streamed chunk's index is not
// part of the path); empty when the message starts with no field path.
std::string FieldPathOf(absl::string_view message);

// The kvmemd flag a RESOURCE_EXHAUSTED message names ("--max-append-streams" of
// "... --max-append-streams=16 streams are open"), or the flag behind the resource it
// starts with ("pool: ..." is --pool-bytes); else the resource itself.
std::string QuotaSubjectOf(absl::string_view message);

}  // namespace kvmem::service
