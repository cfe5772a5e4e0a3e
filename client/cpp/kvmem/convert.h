#pragma once
// Between the client's types (kvmem/client.h) and the wire: gRPC and google.rpc statuses to
// absl::Status (details as payloads, message unchanged), requests filled from client
// arguments, responses read into client results. Pure functions; internal to the C++ client.
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/support/status.h"
#include "kvmem/client.h"
#include "kvmem/v1/kvmem.pb.h"

namespace kvmem::client::internal {

// The daemon's status, message unchanged; its google.rpc details become payloads.
absl::Status FromGrpc(const grpc::Status& status);
// A google.rpc.Status (a call's, a StepBatch entry's or a step channel's) with its details
// as payloads (the kvmem/... payloads of client.h included).
absl::Status FromRpcStatus(const google::rpc::Status& rich);

absl::Duration FromProto(const google::protobuf::Duration& d);
void ToProto(absl::Duration d, google::protobuf::Duration* out);
void ToProto(const PolicySpec& policy, v1::PolicySpec* out);
void ToProto(const Layout& layout, v1::Layout* out);
Layout FromProto(const v1::Layout& layout);
BlockTable FromProto(const v1::BlockTable& table);

Info InfoOf(const v1::GetInfoResponse& r);
StepResult StepResultOf(const v1::StepResponse& r);
CompressResult CompressResultOf(const v1::CompressResponse& r);
// A Stats response's counters (the first page's; later pages repeat them), without the
// sequences.
Stats StatsCountersOf(const v1::StatsResponse& r);
SequenceStats SequenceStatsOf(const v1::SequenceStats& seq);

// The client_table of a request that should bring `table` up to date.
void HoldTable(const BlockTable& table, v1::ClientTable* out);

// The rows the batch's steps put in a signal area (StepSignals.attention_offset; the layout
// of WriteAttentionRows), moved into the message itself, for a batch that goes any other
// way than through that area's channel: the area is still mapped here (empty: none). At
// most the area's bytes in all, as the daemon would copy (entries may name the same rows);
// an entry past that, or whose rows cannot be read back, keeps an offset past any area,
// which the daemon refuses by name for that entry alone.
void InlineAreaRows(absl::Span<const uint8_t> area, v1::StepBatchRequest* q);

// The step signals a request carries, without those the sequence's policy does not use;
// attention rows as IEEE halves when args.attention_f16. `Signals`: a StepRequest or a
// StepBatchEntry's StepSignals.
template <typename Signals>
void FillStepSignals(const StepArgs& args, bool logit_stats, bool attention_rows, Signals* q);

template <typename Repeated>
auto ToVector(const Repeated& r) {
  return std::vector<typename Repeated::value_type>(r.begin(), r.end());
}

// The tokens of an AppendRequest, an AppendStreamRequest chunk or a StepBatchEntry.
template <typename Request>
void FillTokens(const AppendArgs& args, Request* out) {
  out->mutable_positions()->Add(args.positions.begin(), args.positions.end());
  out->mutable_token_ids()->Add(args.token_ids.begin(), args.token_ids.end());
  out->set_k(std::string(args.k));
  out->set_v(std::string(args.v));
  out->mutable_token_entropy()->Add(args.token_entropy.begin(), args.token_entropy.end());
  out->mutable_layer_distance()->Add(args.layer_distance.begin(), args.layer_distance.end());
}

// An AppendRequest or an AppendStreamRequest chunk.
template <typename Request>
void ToProto(const AppendArgs& args, uint64_t id, Request* out) {
  out->set_sequence_id(id);
  FillTokens(args, out);
}

// An AppendResponse or AppendStreamResponse.
template <typename Response>
AppendResult AppendResultOf(const Response& r) {
  return AppendResult{r.appended_tokens(), r.max_stream_tokens(), r.epoch(), r.kv_bytes(),
                      r.table_version()};
}

// Attention rows (f32 weights) or window scores, one per stream.
template <typename Out>
void AddSignals(const std::vector<StreamSignal>& in, Out* out) {
  for (const StreamSignal& s : in) {
    auto* row = out->Add();
    row->set_layer(s.layer);
    row->set_kv_head(s.kv_head);
    if constexpr (std::is_same_v<std::decay_t<decltype(*row)>, v1::AttentionRow>) {
      row->mutable_weights()->Add(s.values.begin(), s.values.end());
    } else {
      row->mutable_scores()->Add(s.values.begin(), s.values.end());
    }
  }
}

}  // namespace kvmem::client::internal
