#pragma once
// Translation between the public protobuf API and engine types, and absl::Status -> gRPC.
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/engine/engine.h"

namespace kvmem::service {

// absl and gRPC share the canonical code space, so codes map 1:1.
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
