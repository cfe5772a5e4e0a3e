#include "server/engine/input_checks.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "server/common/parallel.h"
#include "server/common/simd_loops.h"
#include "server/engine/table_versions.h"

namespace kvmem::engine {
namespace {

// `field` names the values in the error: a callable, so that the name is built only then
// (a step checks one attention row per stream).
template <typename Name>
absl::Status CheckFinite(absl::Span<const float> values, const Name& field, float min, float max) {
  const size_t i = FirstOutside(values.data(), values.size(), min, max);
  if (i == values.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field(), "[", i, "]: ", values[i], " is not a finite value in [", min, ", ", max, "]"));
}

// K or V of a chunk of n tokens, [layers][kv_heads][n][head_dim] values of the layout's
// dtype: an infinity or a NaN is refused, since a block quantized with it would spread it
// to the same channel of every other token in the block (its scale).
absl::Status CheckKvFinite(absl::string_view data, const Layout& layout, size_t n,
                           const std::string& where, const char* field) {
  const uint32_t bytes = DTypeBytes(layout.dtype);
  uint32_t exponent = 0;  // the format's exponent bits
  switch (layout.dtype) {
    case DType::kF16:
      exponent = 0x7c00u;
      break;
    case DType::kBF16:
      exponent = 0x7f80u;
      break;
    case DType::kF32:
      exponent = 0x7f800000u;
      break;
  }
  const size_t count = data.size() / bytes;
  const size_t i = FirstNonFinite(data.data(), count, bytes, exponent);
  if (i == count) return absl::OkStatus();
  const uint64_t D = layout.head_dim, H = layout.num_kv_heads;
  const uint64_t per_stream = n * D;
  return absl::InvalidArgumentError(
      absl::StrCat(where, field, "[", i, "]: an infinity or NaN (layer ", i / per_stream / H,
                   ", kv_head ", i / per_stream % H, ", token ", i % per_stream / D, ", dim ",
                   i % D, "); K and V must be finite"));
}

// Checks per-stream signals (range, duplicates, lengths, finiteness, values in [0, max]) and
// returns them indexed by stream (empty span where absent). A signal whose length misses its
// stream's slot count is INVALID_ARGUMENT, or stale (FAILED_PRECONDITION) when it is short
// and the client said it holds an older table (`table_version`): the rows follow that table.
absl::StatusOr<std::vector<absl::Span<const float>>> IndexSignals(
    const Sequence& seq, absl::Span<const StreamSignal> signals, const char* field, float max,
    bool require_all, absl::string_view why, size_t pending, uint64_t table_version)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu) {
  const Layout& layout = seq.layout();
  std::vector<absl::Span<const float>> by_stream(seq.streams().size());
  std::vector<bool> seen(seq.streams().size(), false);
  // Errors are reported for the first signal, in order, that has one; a signal's shape is
  // checked before its values. The shapes first: `shaped` signals pass, then `shape_error`.
  size_t shaped = 0;
  size_t longest = 0;
  absl::Status shape_error;
  for (; shaped < signals.size(); ++shaped) {
    const size_t i = shaped;
    const StreamSignal& sig = signals[i];
    if (sig.layer >= layout.num_layers) {
      shape_error = absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "].layer: ", sig.layer, " is outside [0, ", layout.num_layers, ")"));
      break;
    }
    if (sig.kv_head >= layout.num_kv_heads) {
      shape_error = absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "].kv_head: ", sig.kv_head, " is outside [0, ", layout.num_kv_heads, ")"));
      break;
    }
    const size_t s = size_t{sig.layer} * layout.num_kv_heads + sig.kv_head;
    if (seen[s]) {
      shape_error =
          absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: stream (layer ", sig.layer,
                                                  ", kv_head ", sig.kv_head, ") appears twice"));
      break;
    }
    seen[s] = true;
    if (sig.values.size() != seq.streams()[s].size() + pending) {
      const std::string message = absl::StrCat(
          field, "[", i, "]: ", sig.values.size(), " values but stream (layer ", sig.layer,
          ", kv_head ", sig.kv_head, ") retains ", seq.streams()[s].size() + pending, " slots",
          pending > 0 ? absl::StrCat(" (", pending, " of them appended by this call)") : "",
          " at table version ", seq.version(),
          ": rows follow the current table (a client whose table is older fetches it again)");
      // A client that says it holds an older table computed its rows on it: stale, not bad.
      // Within an epoch a stream only grows (evictions and moves change the epoch, checked
      // first), so only a row shorter than the slots can follow an older table; a longer
      // one is malformed whatever the client holds (and a client never loops on it).
      const bool stale = table_version != 0 && table_version < seq.version() &&
                         sig.values.size() < seq.streams()[s].size() + pending;
      shape_error = stale ? TableVersions::StaleEpoch(
                                seq, absl::StrCat(message, "; the client's table is at version ",
                                                  table_version))
                          : absl::InvalidArgumentError(message);
      break;
    }
    by_stream[s] = sig.values;
    longest = std::max(longest, sig.values.size());
  }
  // Then the values of the signals that passed, split across cores (a step sends one row
  // per stream): the first one in order with a bad value wins.
  std::atomic<size_t> first_bad{shaped};
  ParallelFor(shaped, StreamGrain(longest), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end && i < first_bad.load(std::memory_order_relaxed); ++i) {
      const absl::Span<const float> v = signals[i].values;
      if (FirstOutside(v.data(), v.size(), 0.0f, max) == v.size()) continue;
      size_t seen_bad = first_bad.load(std::memory_order_relaxed);
      while (i < seen_bad && !first_bad.compare_exchange_weak(seen_bad, i)) {
      }
      return;
    }
  });
  if (const size_t i = first_bad.load(); i < shaped) {
    return CheckFinite(
        signals[i].values, [&] { return absl::StrCat(field, "[", i, "]"); }, 0.0f, max);
  }
  if (!shape_error.ok()) return shape_error;
  if (require_all && signals.size() != seq.streams().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", why, " needs one entry per stream (", seq.streams().size(),
                     " = layers x kv_heads), got ", signals.size()));
  }
  return by_stream;
}

}  // namespace

absl::Status CheckChunk(const Sequence& seq, uint64_t max_append_bytes, const AppendChunk& chunk,
                        size_t index, int64_t* last_position, bool written) {
  const std::string where = index == 0 ? "" : absl::StrCat("chunk ", index, ": ");
  const size_t n = chunk.positions.size();
  const Layout& layout = seq.layout();
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "positions: at least one token is required"));
  }
  const uint64_t max_tokens = max_append_bytes / (2 * layout.payload_bytes(1));
  if (n > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "positions: ", n, " tokens exceed the per-message limit of ", max_tokens,
        " tokens (", max_append_bytes, " bytes of K+V); split them with AppendStream"));
  }
  const uint64_t want = written ? 0 : layout.payload_bytes(n);
  if (written && (!chunk.k.empty() || !chunk.v.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, chunk.k.empty() ? "v: " : "k: ", std::max(chunk.k.size(), chunk.v.size()),
        " bytes sent with plan_id: the K/V of tokens written in place is in the pool already"));
  }
  if (chunk.k.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "k: ", chunk.k.size(), " bytes, expected ", want, " = layers ", layout.num_layers,
        " x kv_heads ", layout.num_kv_heads, " x tokens ", n, " x head_dim ", layout.head_dim,
        " x ", DTypeBytes(layout.dtype), " bytes (", DTypeName(layout.dtype), ")"));
  }
  if (chunk.v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "v: ", chunk.v.size(), " bytes, expected ", want, " (same shape as k)"));
  }
  if (!written) {
    if (absl::Status s = CheckKvFinite(chunk.k, layout, n, where, "k"); !s.ok()) return s;
    if (absl::Status s = CheckKvFinite(chunk.v, layout, n, where, "v"); !s.ok()) return s;
  }
  if (!chunk.token_ids.empty() && chunk.token_ids.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(where, "token_ids: ", chunk.token_ids.size(),
                                                   " ids for ", n, " positions (send 0 or ", n,
                                                   ")"));
  }
  for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
    if (chunk.token_ids[i] < 0 || static_cast<uint32_t>(chunk.token_ids[i]) >= layout.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, "token_ids[", i,
                                                     "]: ", chunk.token_ids[i], " is outside [0, ",
                                                     layout.vocab_size, ")"));
    }
  }
  if (!chunk.token_entropy.empty() && chunk.token_entropy.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "token_entropy: ", chunk.token_entropy.size(), " values for ", n,
                     " positions (send 0 or ", n, ")"));
  }
  if (auto s = CheckFinite(
          chunk.token_entropy, [&] { return where + "token_entropy"; }, 0.0f, 1e6f);
      !s.ok()) {
    return s;
  }
  if (!chunk.layer_distance.empty() && chunk.layer_distance.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "layer_distance: ", chunk.layer_distance.size(), " values for ", n,
                     " positions (send 0 or ", n, ")"));
  }
  if (auto s = CheckFinite(
          chunk.layer_distance, [&] { return where + "layer_distance"; }, 0.0f, 2.0f);
      !s.ok()) {
    return s;
  }
  for (size_t i = 0; i < n; ++i) {
    if (chunk.positions[i] <= *last_position) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "positions[", i, "]: ", chunk.positions[i],
                       " must be greater than the previous position ", *last_position));
    }
    *last_position = chunk.positions[i];
  }
  const policy::SignalSet needs = seq.policy().descriptor().append_signals;
  if ((needs & policy::kTokenEntropy) && chunk.token_entropy.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "token_entropy: policy ", seq.policy_name(), " needs one value per appended token"));
  }
  if ((needs & policy::kLayerDistance) && chunk.layer_distance.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "layer_distance: policy ",
                                                   seq.policy_name(),
                                                   " needs one value per appended token"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckedStep> CheckStep(const Sequence& seq, const StepInput& input, size_t pending,
                                      uint64_t table_version) {
  const policy::PolicyDescriptor& desc = seq.policy().descriptor();
  const std::string why = absl::StrCat("policy ", desc.name);
  if (!input.attention.empty() && input.epoch != seq.epoch()) {
    return TableVersions::StaleEpoch(
        seq, absl::StrCat("epoch: attention rows were computed on epoch ", input.epoch,
                          " but the block table is at epoch ", seq.epoch(),
                          "; fetch the block table again"));
  }
  // Rows cover every stream or none: a policy that reads them when sent (refreekv) reads
  // every stream's.
  const bool rows_required = (desc.step_signals & policy::kAttentionRows) != 0;
  absl::StatusOr<std::vector<absl::Span<const float>>> rows = IndexSignals(
      seq, input.attention, "attention", kMaxAttention, rows_required || !input.attention.empty(),
      rows_required ? why : absl::StrCat(why, " (rows, when sent)"), pending, table_version);
  if (!rows.ok()) return rows.status();
  CheckedStep checked{*std::move(rows), std::nullopt};
  if (input.logits) {
    const RawLogitStats& raw = *input.logits;
    const uint32_t vocab = seq.layout().vocab_size;
    if (!raw.top_logprobs.empty() && (raw.entropy != 0 || raw.p1 != 0 || raw.p2 != 0)) {
      return absl::InvalidArgumentError(
          "logit_stats.top_logprobs: sent beside entropy, p1 and p2; send one or the other");
    }
    if (raw.top_logprobs.size() > vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_stats.top_logprobs: ", raw.top_logprobs.size(),
                       " values, more than the vocabulary's ", vocab));
    }
    absl::StatusOr<policy::LogitStats> stats =
        raw.top_logprobs.empty() ? policy::CheckLogitStats({raw.entropy, raw.p1, raw.p2}, vocab)
                                 : policy::LogitStatsFromTopLogprobs(raw.top_logprobs);
    if (!stats.ok()) return stats.status();
    checked.logits = *stats;
  } else if (desc.step_signals & policy::kLogitStats) {
    return absl::InvalidArgumentError(absl::StrCat("logit_stats: ", why, " needs them every step"));
  }
  return checked;
}

absl::StatusOr<CheckedCompress> CheckCompress(const Sequence& seq, const CompressInput& input) {
  const policy::PolicyDescriptor& desc = seq.policy().descriptor();
  const std::string why = absl::StrCat("policy ", desc.name);
  if ((!input.attention.empty() || !input.window_scores.empty()) && input.epoch != seq.epoch()) {
    return TableVersions::StaleEpoch(
        seq, absl::StrCat("epoch: signals were computed on epoch ", input.epoch,
                          " but the block table is at epoch ", seq.epoch(),
                          "; fetch the block table again"));
  }
  absl::StatusOr<std::vector<absl::Span<const float>>> rows = IndexSignals(
      seq, input.attention, "attention", kMaxAttention,
      (desc.compress_signals & policy::kAttentionRows) != 0, why, 0, input.table_version);
  if (!rows.ok()) return rows.status();
  absl::StatusOr<std::vector<absl::Span<const float>>> window = IndexSignals(
      seq, input.window_scores, "window_scores", kMaxWindowScore,
      (desc.compress_signals & policy::kWindowScores) != 0, why, 0, input.table_version);
  if (!window.ok()) return window.status();
  return CheckedCompress{*std::move(rows), *std::move(window)};
}

}  // namespace kvmem::engine
