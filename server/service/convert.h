#pragma once
// Translation between the public protobuf API and engine types. Defaults of absent fields
// are resolved here, so the engine never sees a request's "unset"; an explicit value that
// is not valid is INVALID_ARGUMENT naming the field. absl::Status -> gRPC: error_details.h.
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/engine/engine.h"
#include "server/service/error_details.h"

namespace kvmem::service {

// Absent block_tokens is `default_block_tokens`; an explicit 0 is rejected.
absl::StatusOr<engine::Layout> FromProto(const v1::Layout& layout, uint32_t default_block_tokens);
void ToProto(const engine::Layout& layout, v1::Layout* out);

v1::Precision ToProto(engine::Precision p);
// A known precision's engine value (PRECISION_UNSPECIFIED and unknown ones: kLayout; a
// caller that must refuse those checks first).
engine::Precision FromProto(v1::Precision p);
// The policy name of a spec: absent is "full"; an empty one is rejected.
absl::StatusOr<std::string> PolicyNameFromProto(const v1::PolicySpec& policy);
// The quantization part of a policy spec; messages name policy.quantization and
// policy.quantization_recent_tokens (absent: engine::QuantConfig's default; 0 is rejected).
absl::StatusOr<engine::QuantConfig> QuantFromProto(const v1::PolicySpec& policy);

// A requested lease (`lease` null when the request leaves it out: `config.default_lease`):
// rounded up to whole seconds, within [1 s, config.max_lease]; messages name `field`.
absl::StatusOr<absl::Duration> LeaseFromProto(const google::protobuf::Duration* lease,
                                              absl::string_view field,
                                              const engine::EngineConfig& config);
// `d` as a Duration; seconds and nanos share its sign.
void ToProto(absl::Duration d, google::protobuf::Duration* out);

// The tokens of an AppendRequest or one AppendStreamRequest chunk, as views into it.
template <typename Request>
engine::AppendChunk ChunkView(const Request& request) {
  engine::AppendChunk chunk;
  chunk.positions = absl::MakeConstSpan(request.positions().data(), request.positions().size());
  chunk.token_ids = absl::MakeConstSpan(request.token_ids().data(), request.token_ids().size());
  chunk.k = request.k();
  chunk.v = request.v();
  chunk.token_entropy =
      absl::MakeConstSpan(request.token_entropy().data(), request.token_entropy().size());
  chunk.layer_distance =
      absl::MakeConstSpan(request.layer_distance().data(), request.layer_distance().size());
  return chunk;
}
// An AppendResponse, an AppendStreamResponse or a StepBatch entry's append result.
template <typename Response>
void FillAppendResponse(uint64_t id, const engine::AppendResult& r, Response* out) {
  out->set_sequence_id(id);
  out->set_appended_tokens(r.appended_tokens);
  out->set_max_stream_tokens(r.max_stream_tokens);
  out->set_epoch(r.epoch);
  out->set_kv_bytes(r.kv_bytes);
  out->set_table_version(r.version);
}
// The table a request's client_table says the client holds; none without the field.
template <typename Request>
std::optional<engine::HeldTable> HeldFromProto(const Request& request) {
  if (!request.has_client_table()) return std::nullopt;
  return engine::HeldTable{request.client_table().version(), request.client_table().positions()};
}

// Rows converted from f16 (AttentionRow.weights_f16), which the views point into: arrays
// left uninitialized until the conversion writes them (no zeroing of tens of KiB a step), in
// a deque so that adding one moves none.
using SignalStorage = std::deque<std::unique_ptr<float[]>>;
// Attention rows as views into `rows`, or into `storage` for rows sent as f16.
absl::StatusOr<std::vector<engine::StreamSignal>> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::AttentionRow>& rows, SignalStorage* storage);
std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::WindowScores>& scores);

// Attention rows an entry names in a step channel's signal area (step_channel.h's
// signal_area layout) at `offset`: the header and row entries read by `read` (bounded by
// the area), the rows' values left for the caller to read into `*values` (so that a batch
// reads its entries' values across cores: transport::StepChannel::ReadSignalValues),
// which the views point into (arrays in `storage`, unwritten until then). Errors name
// `field`. `budget`: the area's bytes the batch may still copy (its size, at the batch's
// start), less what this entry's header, entries and rows take: a batch holds at most
// three times the area in copies (f16 rows widened, their views).
using AreaReader = absl::FunctionRef<absl::Status(uint64_t offset, uint64_t bytes, void* out)>;
struct AreaValues {
  uint64_t offset = 0;  // in the area
  uint64_t count = 0;
  bool f16 = false;  // halves, widened as they are read; else floats
  float* out = nullptr;
};
absl::StatusOr<std::vector<engine::StreamSignal>> SignalsFromArea(AreaReader read, uint64_t offset,
                                                                  absl::string_view field,
                                                                  uint64_t* budget,
                                                                  SignalStorage* storage,
                                                                  AreaValues* values);
void ToProto(const engine::PlanView& plan, v1::WritePlan* out);

// The engine's input of a Step, as views into `request` and `storage` (which must outlive it).
absl::StatusOr<engine::StepInput> StepInputView(const v1::StepRequest& request,
                                                SignalStorage* storage);
absl::StatusOr<engine::StepInput> StepInputView(const v1::StepSignals& signals,
                                                SignalStorage* storage);
void ToProto(const engine::StepResult& result, v1::StepResponse* out);
// The engine's input of a Compress, as views into `request`; an explicit target_tokens of
// 0 is rejected.
absl::StatusOr<engine::CompressInput> CompressInputView(const v1::CompressRequest& request,
                                                        SignalStorage* storage);
void ToProto(const engine::CompressResult& result, v1::CompressResponse* out);

void ToProto(const engine::BlockTable& table, uint64_t block_bytes, v1::BlockTable* out);
void ToProto(const engine::TableUpdate& update, v1::TableUpdate* out);
// The daemon-wide counters of a StatsResponse (its sequences are paged by the service).
void ToProto(const engine::EngineStats& stats, v1::StatsResponse* out);
void ToProto(const engine::SequenceSummary& sequence, v1::SequenceStats* out);

}  // namespace kvmem::service
