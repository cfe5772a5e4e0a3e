#include "kvmem/convert.h"

#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "kernels/half_arrays.h"
#include "kvmem/v1/step_channel.h"

namespace kvmem::client {

std::optional<uint64_t> CurrentEpoch(const absl::Status& status) {
  const auto payload = status.GetPayload(kCurrentEpochPayload);
  uint64_t epoch = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &epoch)) return std::nullopt;
  return epoch;
}

namespace internal {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  google::rpc::Status rich;
  if (status.error_details().empty() || !rich.ParseFromString(status.error_details())) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  rich.set_code(status.error_code());
  rich.set_message(status.error_message());
  return FromRpcStatus(rich);
}

absl::Status FromRpcStatus(const google::rpc::Status& rich) {
  if (rich.code() == 0) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(rich.code()), rich.message());
  for (const google::protobuf::Any& detail : rich.details()) {
    out.SetPayload(detail.type_url(), absl::Cord(detail.value()));
    if (google::rpc::BadRequest bad; detail.UnpackTo(&bad)) {
      if (bad.field_violations_size() > 0 && !bad.field_violations(0).field().empty()) {
        out.SetPayload(kFieldPayload, absl::Cord(bad.field_violations(0).field()));
      }
    } else if (google::rpc::ErrorInfo info; detail.UnpackTo(&info)) {
      const auto& metadata = info.metadata();
      if (auto it = metadata.find("current_epoch"); it != metadata.end()) {
        out.SetPayload(kCurrentEpochPayload, absl::Cord(it->second));
      }
      if (auto it = metadata.find("current_version"); it != metadata.end()) {
        out.SetPayload(kCurrentVersionPayload, absl::Cord(it->second));
      }
    } else if (google::rpc::QuotaFailure quota; detail.UnpackTo(&quota)) {
      if (quota.violations_size() > 0) {
        out.SetPayload(kLimitPayload, absl::Cord(quota.violations(0).subject()));
      }
    }
  }
  return out;
}

absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

void ToProto(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t seconds = absl::IDivDuration(d, absl::Seconds(1), &d);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(absl::ToInt64Nanoseconds(d)));
}

void ToProto(const PolicySpec& policy, v1::PolicySpec* out) {
  if (policy.name) out->set_name(*policy.name);
  out->set_quantization(static_cast<v1::Precision>(policy.quantization));
  if (policy.quantization_recent_tokens) {
    out->set_quantization_recent_tokens(*policy.quantization_recent_tokens);
  }
  for (const auto& [k, v] : policy.params) (*out->mutable_params())[k] = v;
}

void ToProto(const Layout& layout, v1::Layout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(static_cast<v1::DType>(layout.dtype));
  if (layout.block_tokens) out->set_block_tokens(*layout.block_tokens);
  out->set_vocab_size(layout.vocab_size);
}

Layout FromProto(const v1::Layout& layout) {
  Layout out{layout.num_layers(), layout.num_kv_heads(),
             layout.head_dim(),   static_cast<DType>(layout.dtype()),
             std::nullopt,        layout.vocab_size()};
  if (layout.has_block_tokens()) out.block_tokens = layout.block_tokens();
  return out;
}

BlockTable FromProto(const v1::BlockTable& r) {
  BlockTable table;
  table.sequence_id = r.sequence_id();
  table.epoch = r.epoch();
  table.version = r.version();
  table.positions = r.positions();
  table.block_tokens = r.block_tokens();
  table.block_bytes = r.block_bytes();
  table.layout = FromProto(r.layout());
  table.epoch_slot = r.epoch_slot();
  table.quantization = static_cast<Precision>(r.quantization());
  table.quantized_block_bytes = r.quantized_block_bytes();
  for (const v1::StreamTable& st : r.streams()) {
    StreamTable out{st.layer(), st.kv_head(), {}, ToVector(st.positions())};
    out.blocks.reserve(st.block_ids_size());
    for (int b = 0; b < st.block_ids_size(); ++b) {
      out.blocks.push_back({st.block_ids(b), st.block_offsets(b), st.block_starts(b),
                            st.block_counts(b), static_cast<Precision>(st.block_precisions(b))});
    }
    table.streams.push_back(std::move(out));
  }
  return table;
}

Info InfoOf(const v1::GetInfoResponse& r) {
  Info info;
  info.version = r.version();
  info.backend = r.backend();
  info.device_name = r.device_name();
  info.instance_id = r.instance_id();
  info.pool_bytes = r.pool_bytes();
  info.pool_free_bytes = r.pool_free_bytes();
  info.page_bytes = r.page_bytes();
  info.default_block_tokens = r.default_block_tokens();
  info.max_sequences = r.max_sequences();
  info.default_lease = FromProto(r.default_lease());
  info.max_lease = FromProto(r.max_lease());
  info.max_message_bytes = r.max_message_bytes();
  info.device_step = r.device_step();
  info.in_place_writes = r.in_place_writes();
  for (const v1::PolicyInfo& p : r.policies()) {
    PolicyInfo pi{p.name(),
                  p.description(),
                  {},
                  ToVector(p.step_signals()),
                  ToVector(p.compress_signals()),
                  ToVector(p.append_signals())};
    for (const v1::ParamInfo& param : p.params()) {
      pi.params.push_back({param.name(), param.default_value(), param.min_value(),
                           param.max_value(), param.description()});
    }
    info.policies.push_back(std::move(pi));
  }
  for (const v1::QuantizerInfo& q : r.quantizers()) {
    info.quantizers.push_back({static_cast<Precision>(q.precision()), q.name(), q.description()});
  }
  info.default_quantization_recent_tokens = r.default_quantization_recent_tokens();
  switch (r.pool_export_case()) {
    case v1::GetInfoResponse::kSharedMemory:
      info.shm_bytes = r.shared_memory().segment_bytes();
      info.shm_piece_offset = r.shared_memory().piece_offset();
      // A daemon that names no piece maps the whole pool.
      info.shm_piece_bytes =
          r.shared_memory().piece_bytes() != 0 ? r.shared_memory().piece_bytes() : info.shm_bytes;
      break;
    case v1::GetInfoResponse::kCudaIpc:
      info.cuda_ipc_handle = r.cuda_ipc().handle();
      info.cuda_device_uuid = r.cuda_ipc().device_uuid();
      info.cuda_pool_bytes = r.cuda_ipc().pool_bytes();
      break;
    case v1::GetInfoResponse::POOL_EXPORT_NOT_SET:
      break;
  }
  info.epoch_stride = r.epoch_board().stride();
  info.epoch_slots = r.epoch_board().slots();
  info.table_area_bytes = r.table_area().bytes();
  info.table_area_slots = r.table_area().slots();
  info.attach = {r.attach().socket(), r.attach().ticket(), std::nullopt};
  if (r.has_attach()) info.attach.daemon_uid = r.attach().daemon_uid();
  info.ucx = {
      r.ucx().worker_address(),        r.ucx().pool_rkey(),        r.ucx().epoch_board_rkey(),
      r.ucx().pool_address(),          r.ucx().pool_bytes(),       r.ucx().epoch_board_address(),
      r.ucx().append_worker_address(), r.ucx().max_payload_bytes()};
  return info;
}

StepResult StepResultOf(const v1::StepResponse& r) {
  StepResult out{r.confidence(),      std::nullopt,       r.evicted_tokens(), r.quantized_tokens(),
                 r.kv_bytes_before(), r.kv_bytes_after(), r.epoch(),          r.step(),
                 r.table_version()};
  if (r.has_budget_tokens()) out.budget_tokens = r.budget_tokens();
  return out;
}

CompressResult CompressResultOf(const v1::CompressResponse& r) {
  CompressResult out;
  out.evicted_tokens = r.evicted_tokens();
  out.quantized_tokens = r.quantized_tokens();
  out.kv_bytes_before = r.kv_bytes_before();
  out.kv_bytes_after = r.kv_bytes_after();
  out.epoch = r.epoch();
  out.table_version = r.table_version();
  for (const v1::LayerKept& l : r.layers()) {
    out.layers.push_back({l.layer(), l.kept_tokens(), l.before_tokens()});
  }
  return out;
}

Stats StatsCountersOf(const v1::StatsResponse& r) {
  Stats out;
  out.pool_bytes = r.pool_bytes();
  out.pool_used_bytes = r.pool_used_bytes();
  out.pool_free_bytes = r.pool_free_bytes();
  out.pages_total = r.pages_total();
  out.pages_used = r.pages_used();
  out.blocks_used = r.blocks_used();
  out.sequences_active = r.sequences_active();
  out.tokens_appended = r.tokens_appended();
  out.tokens_evicted = r.tokens_evicted();
  out.tokens_quantized = r.tokens_quantized();
  out.stream_slots_evicted = r.stream_slots_evicted();
  out.stream_slots_quantized = r.stream_slots_quantized();
  out.sequences_created = r.sequences_created();
  out.kv_bytes = r.kv_bytes();
  out.full_cache_bytes = r.full_cache_bytes();
  for (const v1::PolicyCounters& p : r.policies()) {
    out.policies.push_back({p.policy(), p.tokens_appended(), p.tokens_evicted(),
                            p.tokens_quantized(), p.stream_slots_evicted(),
                            p.stream_slots_quantized(), p.steps()});
  }
  out.steps = r.steps();
  out.leases_expired = r.leases_expired();
  out.slot_state_bytes = r.slot_state_bytes();
  out.host_metadata_bytes = r.host_metadata_bytes();
  out.table_area_heap_bytes = r.table_area_heap_bytes();
  out.table_area_used_bytes = r.table_area_used_bytes();
  out.table_area_misses = r.table_area_misses();
  out.host_metadata_budget_bytes = r.host_metadata_budget_bytes();
  out.sequences_poisoned = r.sequences_poisoned();
  out.blocks_forsaken = r.blocks_forsaken();
  out.bytes_forsaken = r.bytes_forsaken();
  for (const v1::ArenaStats& a : r.arenas())
    out.arenas.push_back({a.tenant(), a.bytes(), a.free_bytes()});
  out.prefix_queries = r.prefix().queries_total();
  out.prefix_hits = r.prefix().hits_total();
  out.prefix_reused_tokens = r.prefix().reused_tokens_total();
  out.prefix_reclaimed_bytes = r.prefix().reclaimed_bytes_total();
  out.prefix_entries = r.prefix().entries();
  out.prefix_indexed_blocks = r.prefix().indexed_blocks();
  out.prefix_cached_blocks = r.prefix().cached_blocks();
  return out;
}

SequenceStats SequenceStatsOf(const v1::SequenceStats& seq) {
  SequenceStats one{seq.sequence_id(),
                    seq.policy(),
                    seq.appended_tokens(),
                    seq.max_stream_tokens(),
                    seq.kv_bytes(),
                    seq.blocks(),
                    seq.epoch(),
                    seq.steps(),
                    FromProto(seq.lease_remaining()),
                    std::nullopt,
                    seq.pool_bytes_held(),
                    seq.quantization(),
                    seq.slot_state_bytes()};
  if (seq.has_parent_id()) one.parent_id = seq.parent_id();
  return one;
}

void HoldTable(const BlockTable& table, v1::ClientTable* out) {
  out->set_version(table.version);
  out->set_positions(table.positions);
}

template <typename Signals>
void FillStepSignals(const StepArgs& args, bool logit_stats, bool attention_rows, Signals* q) {
  q->set_epoch(args.epoch);
  if (args.logit_stats && logit_stats) {
    v1::LogitStats* ls = q->mutable_logit_stats();
    ls->set_entropy(args.logit_stats->entropy);
    ls->set_p1(args.logit_stats->p1);
    ls->set_p2(args.logit_stats->p2);
    ls->mutable_top_logprobs()->Add(args.logit_stats->top_logprobs.begin(),
                                    args.logit_stats->top_logprobs.end());
  }
  if (!attention_rows) return;
  if constexpr (std::is_same_v<Signals, v1::StepSignals>) {
    if (args.attention_offset) {  // the rows are in the channel's signal area
      q->set_attention_offset(*args.attention_offset);
      return;
    }
  }
  if (!args.attention_f16) {
    AddSignals(args.attention, q->mutable_attention());
    return;
  }
  for (const StreamSignal& s : args.attention) {
    v1::AttentionRow* row = q->add_attention();
    row->set_layer(s.layer);
    row->set_kv_head(s.kv_head);
    std::string* half = row->mutable_weights_f16();
    half->resize(2 * s.values.size());
    kernels::FloatToHalf(s.values.data(), s.values.size(), half->data());  // little-endian
  }
}

template void FillStepSignals(const StepArgs&, bool, bool, v1::StepRequest*);
template void FillStepSignals(const StepArgs&, bool, bool, v1::StepSignals*);

}  // namespace internal

absl::StatusOr<uint64_t> WriteAttentionRows(absl::Span<uint8_t> area, uint64_t offset,
                                            const std::vector<StreamSignal>& rows, bool f16) {
  namespace layout = v1::signal_area;
  uint64_t values = 0;
  for (const StreamSignal& r : rows) values += r.values.size();
  const uint64_t bytes =
      sizeof(layout::RowsHeader) + rows.size() * sizeof(layout::RowEntry) + values * (f16 ? 2 : 4);
  if (offset > area.size() || bytes > area.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat("signal area: ", bytes, " bytes at ", offset,
                                                   " do not fit its ", area.size()));
  }
  uint8_t* at = area.data() + offset;
  const layout::RowsHeader header{static_cast<uint32_t>(rows.size()),
                                  f16 ? layout::kF16 : layout::kF32};
  std::memcpy(at, &header, sizeof header);
  at += sizeof header;
  for (const StreamSignal& r : rows) {
    const layout::RowEntry entry{r.layer, r.kv_head, static_cast<uint32_t>(r.values.size()), 0};
    std::memcpy(at, &entry, sizeof entry);
    at += sizeof entry;
  }
  for (const StreamSignal& r : rows) {
    if (f16) {
      kernels::FloatToHalf(r.values.data(), r.values.size(), at);
      at += 2 * r.values.size();
    } else {
      std::memcpy(at, r.values.data(), 4 * r.values.size());
      at += 4 * r.values.size();
    }
  }
  return bytes;
}

namespace internal {

namespace {

// One step's rows (InlineAreaRows); INVALID_ARGUMENT, `step` unchanged, for rows outside
// the area or past `*budget` bytes (which the rows moved are taken from).
absl::Status InlineStepRows(absl::Span<const uint8_t> area, v1::StepSignals* step,
                            uint64_t* budget) {
  namespace layout = v1::signal_area;
  const uint64_t offset = step->attention_offset();
  layout::RowsHeader header{};
  auto outside = [&](uint64_t at, uint64_t bytes) {
    return at > area.size() || bytes > area.size() - at;
  };
  if (outside(offset, sizeof header)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_offset: ", offset, " is outside the signal area"));
  }
  std::memcpy(&header, area.data() + offset, sizeof header);
  if (header.dtype != layout::kF16 && header.dtype != layout::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_offset: rows of dtype ", header.dtype, " in the signal area"));
  }
  const uint64_t value_bytes = header.dtype == layout::kF16 ? 2 : 4;
  uint64_t at = offset + sizeof header + uint64_t{header.rows} * sizeof(layout::RowEntry);
  if (header.rows > layout::kMaxRows || at > area.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_offset: ", header.rows, " rows do not fit the signal area"));
  }
  google::protobuf::RepeatedPtrField<v1::AttentionRow> rows;
  for (uint32_t r = 0; r < header.rows; ++r) {
    layout::RowEntry entry{};
    std::memcpy(&entry, area.data() + offset + sizeof header + r * sizeof entry, sizeof entry);
    const uint64_t bytes = uint64_t{entry.length} * value_bytes;
    if (outside(at, bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention_offset: row ", r, " does not fit the signal area"));
    }
    v1::AttentionRow* row = rows.Add();
    row->set_layer(entry.layer);
    row->set_kv_head(entry.kv_head);
    if (value_bytes == 2) {
      row->set_weights_f16(area.data() + at, bytes);
    } else {
      row->mutable_weights()->Resize(static_cast<int>(entry.length), 0.0f);
      std::memcpy(row->mutable_weights()->mutable_data(), area.data() + at, bytes);
    }
    at += bytes;
  }
  const uint64_t moved = at - offset;
  if (moved > *budget) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention_offset: ", moved, " bytes of rows past the ", *budget, " left of the area"));
  }
  *budget -= moved;
  step->clear_attention_offset();
  *step->mutable_attention() = std::move(rows);
  return absl::OkStatus();
}

}  // namespace

void InlineAreaRows(absl::Span<const uint8_t> area, v1::StepBatchRequest* q) {
  uint64_t budget = area.size();
  for (int i = 0; i < q->entries_size(); ++i) {
    v1::StepBatchEntry* entry = q->mutable_entries(i);
    if (!entry->has_step() || !entry->step().has_attention_offset()) continue;
    if (InlineStepRows(area, entry->mutable_step(), &budget).ok()) continue;
    entry->mutable_step()->clear_attention();
    entry->mutable_step()->set_attention_offset(UINT64_MAX);
  }
}

}  // namespace internal
}  // namespace kvmem::client
