#include "server/engine/sequence_report.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"

namespace kvmem::engine {

SequenceSummary Summarize(const Sequence& seq, absl::Time now) {
  SequenceSummary sum;
  sum.sequence_id = seq.id();
  sum.owner = seq.owner();
  sum.policy = seq.policy_name();
  sum.appended_tokens = seq.appended();
  sum.max_stream_tokens = seq.max_stream_tokens();
  sum.kv_bytes = seq.kv_bytes();
  sum.blocks = seq.block_count();
  sum.pool_bytes_held = seq.block_bytes_held();
  sum.slot_state_bytes = seq.slot_bytes_accounted();
  sum.quantization =
      seq.quant().type ? std::string(PrecisionName(seq.format().quant_precision())) : "none";
  sum.epoch = seq.epoch();
  sum.steps = seq.steps();
  sum.lease_remaining_seconds =
      absl::ToDoubleSeconds(absl::FromUnixNanos(seq.lease_deadline_ns()) - now);
  sum.parent_id = seq.parent_id();
  return sum;
}

void AddBlockBytes(const Sequence& seq, absl::flat_hash_map<std::string, uint64_t>* by_precision) {
  const BlockFormat& format = seq.format();
  uint64_t layout_blocks = 0, quantized_blocks = 0;
  for (const Stream& st : seq.streams()) {
    layout_blocks += st.blocks().size() - st.quantized_blocks();
    quantized_blocks += st.quantized_blocks();
  }
  (*by_precision)[std::string(DTypeName(seq.layout().dtype))] +=
      layout_blocks * format.block_bytes(Precision::kLayout);
  if (quantized_blocks > 0) {
    (*by_precision)[std::string(PrecisionName(format.quant_precision()))] +=
        quantized_blocks * format.block_bytes(format.quant_precision());
  }
}

absl::StatusOr<std::string> DescribeState(const Sequence& seq, const store::BlockPool& pool) {
  std::string out;
  std::vector<std::vector<float>> slot_scores;
  std::vector<std::vector<int64_t>> slot_positions;
  if (seq.slots()) {
    if (absl::Status s = seq.slots()->ReadScores(&slot_scores); !s.ok()) return s;
  }
  if (seq.kernel_step()) {  // a host score state keeps no positions (the streams do)
    if (absl::Status s = seq.slots()->ReadPositions(&slot_positions); !s.ok()) return s;
  }
  auto floats = [&out](absl::string_view name, absl::Span<const float> v) {
    absl::StrAppend(&out, name, ":");
    for (float x : v) {  // bit patterns: NaN marks "not scored yet"
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      absl::StrAppend(&out, " ", bits);
    }
    out += "\n";
  };
  absl::StrAppend(&out, "appended ", seq.appended(), " last ", seq.last_position(), " steps ",
                  seq.steps(), " mark ", seq.policy_mark(), " tokens ",
                  absl::StrJoin(seq.token_ids(), ","), "\n");
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const Stream& st = seq.streams()[s];
    absl::StrAppend(&out, "stream ", s, " positions ", absl::StrJoin(st.positions(), ","),
                    " arrival ", absl::StrJoin(st.arrival_step(), ","), "\nblocks");
    for (const StreamBlock& b : st.blocks()) {
      absl::StrAppend(&out, " ", b.id, "@", pool.offset(b.id), "[", b.start, "+", b.count, "]p",
                      static_cast<int>(b.precision));
    }
    out += "\n";
    floats("scores", seq.slots() ? absl::MakeConstSpan(slot_scores[s]) : absl::Span<const float>());
    floats("history", st.history());
    floats("entropy", st.token_entropy());
    floats("distance", st.layer_distance());
    if (seq.kernel_step()) {
      absl::StrAppend(&out, "slot positions ", absl::StrJoin(slot_positions[s], ","), "\n");
    }
  }
  return out;
}

}  // namespace kvmem::engine
