#pragma once
// Translation between the public protobuf API and engine types, and absl::Status -> gRPC.
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/engine/engine.h"

namespace kvmem::service {

// Longest status message sent to a client; a status message travels in a header, and a
// longer one would reach the client as a metadata-size failure instead of its own code.
inline constexpr size_t kMaxStatusMessageBytes = 4096;

// absl and gRPC share the canonical code space, so codes map 1:1. A message longer than
// kMaxStatusMessageBytes is cut (a last line of defence: echoed client text is capped where
// it is echoed, with EchoClientText).
grpc::Status ToGrpc(const absl::Status& status);

absl::StatusOr<engine::Layout> FromProto(const v1::Layout& layout);
void ToProto(const engine::Layout& layout, v1::Layout* out);

v1::Precision ToProto(engine::Precision p);
// The quantization part of a policy spec; messages name policy.quantization.
absl::StatusOr<engine::QuantConfig> QuantFromProto(const v1::PolicySpec& policy);

engine::AppendChunk ChunkView(const v1::AppendRequest& request);
std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::AttentionRow>& rows);
std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::WindowScores>& scores);

void ToProto(const engine::BlockTable& table, uint64_t block_bytes, v1::BlockTable* out);
void ToProto(const engine::EngineStats& stats, v1::StatsResponse* out);

}  // namespace kvmem::service
