#include "server/service/convert.h"

#include "absl/strings/str_cat.h"

namespace kvmem::service {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  absl::string_view message = status.message();
  if (message.size() <= kMaxStatusMessageBytes) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(message));
  }
  // Cut on a UTF-8 character boundary: never leave half a character at the end.
  size_t cut = kMaxStatusMessageBytes;
  while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xC0) == 0x80) --cut;
  return grpc::Status(
      static_cast<grpc::StatusCode>(status.code()),
      absl::StrCat(message.substr(0, cut), "... (message cut, ", message.size(), " bytes)"));
}

absl::StatusOr<engine::Layout> FromProto(const v1::Layout& layout) {
  engine::Layout out;
  switch (layout.dtype()) {
    case v1::DTYPE_F16:
      out.dtype = engine::DType::kF16;
      break;
    case v1::DTYPE_BF16:
      out.dtype = engine::DType::kBF16;
      break;
    case v1::DTYPE_F32:
      out.dtype = engine::DType::kF32;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("layout.dtype: ", static_cast<int>(layout.dtype()),
                       " is not a known dtype (DTYPE_F16 = 1, DTYPE_BF16 = 2, DTYPE_F32 = 3)"));
  }
  out.num_layers = layout.num_layers();
  out.num_kv_heads = layout.num_kv_heads();
  out.head_dim = layout.head_dim();
  out.block_tokens = layout.block_tokens();
  out.vocab_size = layout.vocab_size();
  return out;
}

void ToProto(const engine::Layout& layout, v1::Layout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_head_dim(layout.head_dim);
  switch (layout.dtype) {
    case engine::DType::kF16:
      out->set_dtype(v1::DTYPE_F16);
      break;
    case engine::DType::kBF16:
      out->set_dtype(v1::DTYPE_BF16);
      break;
    case engine::DType::kF32:
      out->set_dtype(v1::DTYPE_F32);
      break;
  }
  out->set_block_tokens(layout.block_tokens);
  out->set_vocab_size(layout.vocab_size);
}

v1::Precision ToProto(engine::Precision p) {
  switch (p) {
    case engine::Precision::kLayout:
      return v1::PRECISION_LAYOUT;
    case engine::Precision::kInt8:
      return v1::PRECISION_INT8;
    case engine::Precision::kInt4:
      return v1::PRECISION_INT4;
    case engine::Precision::kNF4:
      return v1::PRECISION_NF4;
  }
  return v1::PRECISION_UNSPECIFIED;
}

absl::StatusOr<engine::QuantConfig> QuantFromProto(const v1::PolicySpec& policy) {
  engine::QuantConfig quant;
  switch (policy.quantization()) {
    case v1::PRECISION_UNSPECIFIED:
    case v1::PRECISION_LAYOUT:
      break;
    case v1::PRECISION_INT8:
      quant.type = kernels::QuantType::kInt8;
      break;
    case v1::PRECISION_INT4:
      quant.type = kernels::QuantType::kInt4;
      break;
    case v1::PRECISION_NF4:
      quant.type = kernels::QuantType::kNF4;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.quantization: ", static_cast<int>(policy.quantization()),
          " is not a known precision (PRECISION_LAYOUT = 1, INT8 = 2, INT4 = 3, NF4 = 4)"));
  }
  if (policy.quantization_recent_tokens() != 0) {
    quant.recent_tokens = policy.quantization_recent_tokens();
  }
  return quant;
}

engine::AppendChunk ChunkView(const v1::AppendRequest& request) {
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

namespace {
template <typename Message, typename Values>
std::vector<engine::StreamSignal> Views(const google::protobuf::RepeatedPtrField<Message>& in,
                                        Values values) {
  std::vector<engine::StreamSignal> out;
  out.reserve(in.size());
  for (const Message& m : in) {
    const google::protobuf::RepeatedField<float>& v = values(m);
    out.push_back({m.layer(), m.kv_head(), absl::MakeConstSpan(v.data(), v.size())});
  }
  return out;
}
}  // namespace

std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::AttentionRow>& rows) {
  return Views(
      rows, [](const v1::AttentionRow& r) -> const auto& { return r.weights(); });
}

std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::WindowScores>& scores) {
  return Views(
      scores, [](const v1::WindowScores& w) -> const auto& { return w.scores(); });
}

void ToProto(const engine::BlockTable& table, uint64_t block_bytes, v1::BlockTable* out) {
  out->set_sequence_id(table.sequence_id);
  out->set_epoch(table.epoch);
  out->set_block_tokens(table.layout.block_tokens);
  out->set_block_bytes(block_bytes);
  out->set_epoch_slot(table.epoch_slot);
  out->set_quantization(ToProto(table.quantization));
  out->set_quantized_block_bytes(table.quantized_block_bytes);
  ToProto(table.layout, out->mutable_layout());
  for (const engine::StreamTable& st : table.streams) {
    v1::StreamTable* s = out->add_streams();
    s->set_layer(st.layer);
    s->set_kv_head(st.kv_head);
    for (const engine::TableBlock& b : st.blocks) {
      s->add_block_ids(b.id);
      s->add_block_offsets(b.offset);
      s->add_block_precisions(ToProto(b.precision));
      s->add_block_starts(b.start);
      s->add_block_counts(b.count);
    }
    s->mutable_positions()->Add(st.positions.begin(), st.positions.end());
  }
}

void ToProto(const engine::EngineStats& stats, v1::StatsResponse* out) {
  out->set_pool_bytes(stats.pool.pool_bytes);
  out->set_pool_used_bytes(stats.pool.pages_used * stats.pool.page_bytes);
  out->set_pool_free_bytes(stats.pool_free_bytes);
  out->set_pages_total(stats.pool.pages_total);
  out->set_pages_used(stats.pool.pages_used);
  out->set_blocks_used(stats.pool.blocks_used);
  out->set_sequences_active(stats.sequences_active);
  out->set_tokens_appended(stats.tokens_appended);
  out->set_tokens_evicted(stats.tokens_evicted);
  out->set_tokens_quantized(stats.tokens_quantized);
  out->set_bytes_moved(stats.bytes_moved);
  out->set_slot_state_bytes(stats.slot_state_bytes);
  out->set_host_metadata_bytes(stats.host_metadata_bytes);
  out->set_host_metadata_budget_bytes(stats.host_metadata_budget_bytes);
  out->set_sequences_poisoned(stats.sequences_poisoned);
  out->set_steps(stats.steps);
  out->set_leases_expired(stats.leases_expired);
  for (const engine::SequenceSummary& s : stats.sequences) {
    v1::SequenceStats* o = out->add_sequences();
    o->set_sequence_id(s.sequence_id);
    o->set_policy(s.policy);
    o->set_appended_tokens(s.appended_tokens);
    o->set_max_stream_tokens(s.max_stream_tokens);
    o->set_kv_bytes(s.kv_bytes);
    o->set_blocks(s.blocks);
    o->set_epoch(s.epoch);
    o->set_steps(s.steps);
    o->set_lease_remaining_seconds(s.lease_remaining_seconds);
    o->set_parent_id(s.parent_id);
    o->set_pool_bytes_held(s.pool_bytes_held);
    o->set_quantization(s.quantization);
    o->set_slot_state_bytes(s.slot_state_bytes);
  }
}

}  // namespace kvmem::service
