#include "server/service/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/half_arrays.h"
#include "kvmem/v1/step_channel.h"

namespace kvmem::service {

absl::StatusOr<engine::Layout> FromProto(const v1::Layout& layout, uint32_t default_block_tokens) {
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
  out.block_tokens = default_block_tokens;
  if (layout.has_block_tokens()) {
    if (layout.block_tokens() == 0) {
      return absl::InvalidArgumentError(
          "layout.block_tokens: 0 tokens per block; a block holds at least 1 token (leave the "
          "field out for the daemon's --block-tokens)");
    }
    out.block_tokens = layout.block_tokens();
  }
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

engine::Precision FromProto(v1::Precision p) {
  switch (p) {
    case v1::PRECISION_INT8:
      return engine::Precision::kInt8;
    case v1::PRECISION_INT4:
      return engine::Precision::kInt4;
    case v1::PRECISION_NF4:
      return engine::Precision::kNF4;
    default:
      return engine::Precision::kLayout;
  }
}

absl::StatusOr<std::string> PolicyNameFromProto(const v1::PolicySpec& policy) {
  if (!policy.has_name()) return std::string("full");
  if (policy.name().empty()) {
    return absl::InvalidArgumentError(
        "policy.name: empty; name a policy GetInfo lists (leave the field out for \"full\")");
  }
  return policy.name();
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
  if (policy.has_quantization_recent_tokens()) {
    if (policy.quantization_recent_tokens() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.quantization_recent_tokens: 0; at least 1 token stays at the layout precision "
          "(leave the field out for the default of ",
          quant.recent_tokens, ")"));
    }
    quant.recent_tokens = policy.quantization_recent_tokens();
  }
  return quant;
}

absl::StatusOr<absl::Duration> LeaseFromProto(const google::protobuf::Duration* lease,
                                              absl::string_view field,
                                              const engine::EngineConfig& config) {
  if (lease == nullptr) return config.default_lease;
  // google.protobuf.Duration's own range: +-10000 years, nanos of the seconds' sign.
  constexpr int64_t kMaxDurationSeconds = 315576000000;
  const int64_t seconds = lease->seconds();
  const int32_t nanos = lease->nanos();
  if (seconds > kMaxDurationSeconds || seconds < -kMaxDurationSeconds || nanos > 999999999 ||
      nanos < -999999999 || (seconds > 0 && nanos < 0) || (seconds < 0 && nanos > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": {seconds: ", seconds,
                                                   ", nanos: ", nanos,
                                                   "} is not a valid google.protobuf.Duration"));
  }
  const absl::Duration asked = absl::Seconds(seconds) + absl::Nanoseconds(nanos);
  if (asked <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", absl::FormatDuration(asked),
                     " is not a lease; a lease lasts at least 1s (leave the field out for the "
                     "daemon's default of ",
                     absl::FormatDuration(config.default_lease), ")"));
  }
  // Whole seconds: rounded up, so that a lease is never shorter than asked.
  const absl::Duration granted = absl::Ceil(asked, absl::Seconds(1));
  if (granted > config.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", absl::FormatDuration(asked),
                                                   " is over the longest lease, ",
                                                   absl::FormatDuration(config.max_lease)));
  }
  return granted;
}

void ToProto(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t seconds = absl::IDivDuration(d, absl::Seconds(1), &d);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(absl::ToInt64Nanoseconds(d)));
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

absl::StatusOr<std::vector<engine::StreamSignal>> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::AttentionRow>& rows, SignalStorage* storage) {
  std::vector<engine::StreamSignal> out = Views(
      rows, [](const v1::AttentionRow& r) -> const auto& { return r.weights(); });
  size_t halves = 0;
  for (int i = 0; i < rows.size(); ++i) {
    const std::string& half = rows[i].weights_f16();
    if (half.empty()) continue;
    if (!rows[i].weights().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention[", i, "]: sets both weights and weights_f16; send one"));
    }
    if (half.size() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("attention[", i,
                                                     "].weights_f16: ", half.size(),
                                                     " bytes is not a whole number of halves"));
    }
    halves += half.size() / 2;
  }
  if (halves == 0) return out;
  // The widened rows, one after another in one buffer (one allocation per call, not per row).
  std::unique_ptr<float[]> widened(new float[halves]);  // owned before the deque allocates
  float* at = widened.get();
  storage->push_back(std::move(widened));
  for (int i = 0; i < rows.size(); ++i) {
    const std::string& half = rows[i].weights_f16();
    if (half.empty()) continue;
    kernels::HalfToFloat(half.data(), half.size() / 2, at);  // little-endian, as kvmemd's hosts
    out[i].values = absl::MakeConstSpan(at, half.size() / 2);
    at += half.size() / 2;
  }
  return out;
}

absl::StatusOr<std::vector<engine::StreamSignal>> SignalsFromArea(AreaReader read, uint64_t offset,
                                                                  absl::string_view field,
                                                                  uint64_t* budget,
                                                                  SignalStorage* storage,
                                                                  AreaValues* area_values) {
  namespace area = v1::signal_area;
  // What the batch's entries copy out of the area, in all, is at most the area's size: a
  // batch that names the same bytes from many entries is refused, not copied many times.
  const auto take = [&](uint64_t bytes) {
    if (bytes > *budget) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": the batch's entries name more bytes of the signal area than it holds (",
          *budget, " left of its size for this entry's ", bytes, ")"));
    }
    *budget -= bytes;
    return absl::OkStatus();
  };
  area::RowsHeader header;
  if (absl::Status s = take(sizeof header); !s.ok()) return s;
  if (absl::Status s = read(offset, sizeof header, &header); !s.ok()) return s;
  if (header.rows == 0 || header.rows > area::kMaxRows) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the header at ", offset, " says ",
                                                   header.rows, " rows (1 to ", area::kMaxRows,
                                                   ")"));
  }
  if (header.dtype != area::kF32 && header.dtype != area::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the header at ", offset, " says dtype ", header.dtype, " (0 f32 or 1 f16)"));
  }
  // The entries, then the values: each is checked against the area and the batch's budget
  // before anything is allocated for it.
  const uint64_t entries_at = offset + sizeof header;
  const uint64_t entry_bytes = uint64_t{header.rows} * sizeof(area::RowEntry);
  if (absl::Status s = read(entries_at + entry_bytes, 0, nullptr); !s.ok()) return s;
  if (absl::Status s = take(entry_bytes); !s.ok()) return s;
  std::vector<area::RowEntry> entries(header.rows);
  if (absl::Status s = read(entries_at, entry_bytes, entries.data()); !s.ok()) return s;
  uint64_t values = 0;
  for (const area::RowEntry& e : entries) values += e.length;
  const uint64_t width = header.dtype == area::kF16 ? 2 : 4;
  const uint64_t values_at = entries_at + entry_bytes;
  if (absl::Status s = read(values_at + values * width, 0, nullptr); !s.ok()) return s;
  if (absl::Status s = take(values * width); !s.ok()) return s;
  std::unique_ptr<float[]> rows(new float[std::max<uint64_t>(values, 1)]);
  *area_values = {values_at, values, header.dtype == area::kF16, rows.get()};
  std::vector<engine::StreamSignal> out(header.rows);
  const float* at = rows.get();
  for (size_t i = 0; i < entries.size(); ++i) {
    out[i] = {entries[i].layer, entries[i].kv_head, absl::MakeConstSpan(at, entries[i].length)};
    at += entries[i].length;
  }
  storage->push_back(std::move(rows));
  return out;
}

void ToProto(const engine::PlanView& plan, v1::WritePlan* out) {
  out->set_plan_id(plan.id);
  out->set_tokens(plan.tokens);
  out->mutable_block_offsets()->Assign(plan.block_offsets.begin(), plan.block_offsets.end());
  out->mutable_first_slots()->Assign(plan.first_slots.begin(), plan.first_slots.end());
}

std::vector<engine::StreamSignal> SignalViews(
    const google::protobuf::RepeatedPtrField<v1::WindowScores>& scores) {
  return Views(
      scores, [](const v1::WindowScores& w) -> const auto& { return w.scores(); });
}

template <typename Signals>
absl::StatusOr<engine::StepInput> StepInputViewOf(const Signals& request, SignalStorage* storage) {
  engine::StepInput input;
  input.epoch = request.epoch();
  if (request.has_logit_stats()) {
    const v1::LogitStats& ls = request.logit_stats();
    input.logits = engine::RawLogitStats{
        ls.entropy(), ls.p1(), ls.p2(), {ls.top_logprobs().begin(), ls.top_logprobs().end()}};
  }
  absl::StatusOr<std::vector<engine::StreamSignal>> rows =
      SignalViews(request.attention(), storage);
  if (!rows.ok()) return rows.status();
  input.attention = *std::move(rows);
  return input;
}

absl::StatusOr<engine::StepInput> StepInputView(const v1::StepRequest& request,
                                                SignalStorage* storage) {
  absl::StatusOr<engine::StepInput> input = StepInputViewOf(request, storage);
  if (input.ok() && request.has_client_table())
    input->table_version = request.client_table().version();
  return input;
}

absl::StatusOr<engine::StepInput> StepInputView(const v1::StepSignals& signals,
                                                SignalStorage* storage) {
  return StepInputViewOf(signals, storage);
}

void ToProto(const engine::StepResult& result, v1::StepResponse* out) {
  out->set_confidence(result.confidence);
  // The engine's budget 0: the policy set no bound this step.
  if (result.budget_tokens != 0) out->set_budget_tokens(result.budget_tokens);
  out->set_evicted_tokens(result.evicted_tokens);
  out->set_quantized_tokens(result.quantized_tokens);
  out->set_kv_bytes_before(result.kv_bytes_before);
  out->set_kv_bytes_after(result.kv_bytes_after);
  out->set_epoch(result.epoch);
  out->set_step(result.step);
  out->set_table_version(result.version);
}

absl::StatusOr<engine::CompressInput> CompressInputView(const v1::CompressRequest& request,
                                                        SignalStorage* storage) {
  engine::CompressInput input;
  input.epoch = request.epoch();
  if (request.has_client_table()) input.table_version = request.client_table().version();
  // The engine's target 0 is the policy's own rule: what an absent target_tokens asks for.
  if (request.has_target_tokens()) {
    if (request.target_tokens() == 0) {
      return absl::InvalidArgumentError(
          "target_tokens: 0; a stream keeps at least 1 token (leave the field out for the "
          "policy's own rule)");
    }
    input.target_tokens = request.target_tokens();
  }
  absl::StatusOr<std::vector<engine::StreamSignal>> rows =
      SignalViews(request.attention(), storage);
  if (!rows.ok()) return rows.status();
  input.attention = *std::move(rows);
  input.window_scores = SignalViews(request.window_scores());
  return input;
}

void ToProto(const engine::CompressResult& result, v1::CompressResponse* out) {
  for (const engine::LayerKept& layer : result.layers) {
    v1::LayerKept* kept = out->add_layers();
    kept->set_layer(layer.layer);
    kept->set_kept_tokens(layer.kept_tokens);
    kept->set_before_tokens(layer.before_tokens);
  }
  out->set_evicted_tokens(result.evicted_tokens);
  out->set_quantized_tokens(result.quantized_tokens);
  out->set_kv_bytes_before(result.kv_bytes_before);
  out->set_kv_bytes_after(result.kv_bytes_after);
  out->set_epoch(result.epoch);
  out->set_table_version(result.version);
}

namespace {

// One block's entry in a message that lists blocks column by column (StreamTable,
// TableDelta).
template <typename Message>
void AddBlock(const engine::TableBlock& b, Message* out) {
  out->add_block_ids(b.id);
  out->add_block_offsets(b.offset);
  out->add_block_precisions(ToProto(b.precision));
  out->add_block_starts(b.start);
  out->add_block_counts(b.count);
}

}  // namespace

void ToProto(const engine::TableUpdate& update, v1::TableUpdate* out) {
  if (update.table) {
    ToProto(*update.table, update.table->layout.block_bytes(), out->mutable_table());
    return;
  }
  v1::TableDelta* delta = out->mutable_delta();
  delta->set_base_version(update.base_version);
  delta->set_version(update.version);
  delta->set_epoch(update.epoch);
  // Columns: every array sized once, then filled.
  size_t runs = 0, given = 0, positions = 0;
  for (const engine::StreamDelta& d : update.streams) {
    runs += d.kept.size();
    given += d.blocks.size();
    positions += d.positions.size();
  }
  const auto reserve = [](size_t n, auto*... columns) {
    (columns->Reserve(static_cast<int>(n)), ...);
  };
  reserve(update.streams.size(), delta->mutable_stream(), delta->mutable_block_count(),
          delta->mutable_run_count());
  reserve(runs, delta->mutable_kept_at(), delta->mutable_kept_from(), delta->mutable_kept_count());
  reserve(given, delta->mutable_block_ids(), delta->mutable_block_offsets(),
          delta->mutable_block_precisions(), delta->mutable_block_starts(),
          delta->mutable_block_counts());
  reserve(positions, delta->mutable_positions());
  for (const engine::StreamDelta& d : update.streams) {
    delta->add_stream(d.stream);
    delta->add_block_count(d.block_count);
    delta->add_run_count(static_cast<uint32_t>(d.kept.size()));
    for (const engine::KeptRun& run : d.kept) {
      delta->add_kept_at(run.at);
      delta->add_kept_from(run.from);
      delta->add_kept_count(run.count);
    }
    for (const engine::TableBlock& b : d.blocks) AddBlock(b, delta);
    delta->mutable_positions()->Add(d.positions.begin(), d.positions.end());
  }
}

void ToProto(const engine::BlockTable& table, uint64_t block_bytes, v1::BlockTable* out) {
  out->set_sequence_id(table.sequence_id);
  out->set_epoch(table.epoch);
  out->set_version(table.version);
  out->set_positions(table.positions);
  out->set_block_tokens(table.layout.block_tokens);
  out->set_block_bytes(block_bytes);
  out->set_epoch_slot(table.epoch_slot);
  out->set_quantization(ToProto(table.quantization));
  // The engine's 0 bytes: a sequence that never quantizes.
  if (table.quantized_block_bytes != 0) out->set_quantized_block_bytes(table.quantized_block_bytes);
  ToProto(table.layout, out->mutable_layout());
  for (const engine::StreamTable& st : table.streams) {
    v1::StreamTable* s = out->add_streams();
    s->set_layer(st.layer);
    s->set_kv_head(st.kv_head);
    for (const engine::TableBlock& b : st.blocks) AddBlock(b, s);
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
  out->set_stream_slots_evicted(stats.stream_slots_evicted);
  out->set_stream_slots_quantized(stats.stream_slots_quantized);
  out->set_sequences_created(stats.sequences_created);
  out->set_kv_bytes(stats.kv_bytes);
  out->set_full_cache_bytes(stats.full_cache_bytes);
  for (const engine::PolicyCounts& c : stats.policies) {
    out->set_tokens_evicted(out->tokens_evicted() + c.tokens_evicted);
    out->set_tokens_quantized(out->tokens_quantized() + c.tokens_quantized);
    v1::PolicyCounters* p = out->add_policies();
    p->set_policy(c.policy);
    p->set_tokens_appended(c.tokens_appended);
    p->set_tokens_evicted(c.tokens_evicted);
    p->set_stream_slots_evicted(c.stream_slots_evicted);
    p->set_tokens_quantized(c.tokens_quantized);
    p->set_stream_slots_quantized(c.stream_slots_quantized);
    p->set_steps(c.steps);
  }
  out->set_bytes_moved(stats.bytes_moved);
  out->set_slot_state_bytes(stats.slot_state_bytes);
  out->set_host_metadata_bytes(stats.host_metadata_bytes);
  out->set_table_area_heap_bytes(stats.table_area_heap_bytes);
  out->set_table_area_used_bytes(stats.table_area_used_bytes);
  out->set_table_area_misses(stats.table_area_misses);
  out->set_host_metadata_budget_bytes(stats.host_metadata_budget_bytes);
  out->set_sequences_poisoned(stats.sequences_poisoned);
  out->set_blocks_forsaken(stats.blocks_forsaken);
  out->set_bytes_forsaken(stats.bytes_forsaken);
  for (const engine::ArenaUsage& a : stats.arenas) {
    v1::ArenaStats* arena = out->add_arenas();
    arena->set_tenant(a.tenant);
    arena->set_bytes(a.bytes);
    arena->set_free_bytes(a.free_bytes);
  }
  out->set_steps(stats.steps);
  out->set_leases_expired(stats.leases_expired);
  v1::PrefixStats* prefix = out->mutable_prefix();
  prefix->set_queries_total(stats.prefix.queries);
  prefix->set_hits_total(stats.prefix.hits);
  prefix->set_reused_tokens_total(stats.prefix.reused_tokens);
  prefix->set_reclaimed_bytes_total(stats.prefix.reclaimed_bytes);
  prefix->set_entries(stats.prefix.entries);
  prefix->set_indexed_blocks(stats.prefix.indexed_blocks);
  prefix->set_cached_blocks(stats.prefix.cached_blocks);
  prefix->set_host_bytes(stats.prefix.host_bytes);
}

void ToProto(const engine::SequenceSummary& s, v1::SequenceStats* out) {
  out->set_sequence_id(s.sequence_id);
  out->set_policy(s.policy);
  out->set_appended_tokens(s.appended_tokens);
  out->set_max_stream_tokens(s.max_stream_tokens);
  out->set_kv_bytes(s.kv_bytes);
  out->set_blocks(s.blocks);
  out->set_epoch(s.epoch);
  out->set_steps(s.steps);
  ToProto(std::max(absl::Seconds(s.lease_remaining_seconds), absl::ZeroDuration()),
          out->mutable_lease_remaining());
  // Sequence ids start at 1: the engine's parent 0 is "not forked".
  if (s.parent_id != 0) out->set_parent_id(s.parent_id);
  out->set_pool_bytes_held(s.pool_bytes_held);
  out->set_quantization(s.quantization);
  out->set_slot_state_bytes(s.slot_state_bytes);
}

}  // namespace kvmem::service
