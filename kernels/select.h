#pragma once
// Per-step scoring and selection over all streams of a step at once (one launch each on
// the GPU): the score update of CONF-KV (EMA) and H2O (accumulation), the keep-set by
// top-k over unprotected slots (CONF-KV's priority, H2O's window-plus-top) or by a
// threshold, and the compaction of slot metadata to the kept slots. The C++ reference
// (select_ref.cc) is the CPU implementation; select.cu is the CUDA twin.
//
// Layout: the slots of every stream in one flat array per field (scores f32, positions
// i64, attention f32), stream s owning [offset, offset + length) (StreamSlice). Positions
// ascend within a stream (the order of its retained slots).
// Exactness: every formula below is evaluated in f32 in the order written, without fused
// multiply-adds, on both sides, so scores and keep-sets match bit for bit.
#include <cstdint>

#include "kernels/dtype.h"

namespace kvmem::kernels {

struct StreamSlice {
  uint32_t offset;   // first slot of the stream in the flat arrays
  uint32_t length;   // n, retained slots
  uint32_t budget;   // keep at most this many; n <= budget keeps all
  uint32_t protect;  // the last min(protect, budget) slots are always kept
};

enum class ScoreRule : uint8_t {
  kEma,         // e = lambda * e + (1 - lambda) * a; a NaN e (never scored) becomes a
  kAccumulate,  // s = s + a
};

// Updates scores[offset + j] with attention[offset + j] for j < length, and writes the
// stream's max updated score to stream_max[s] (0 for an empty stream; scores are >= 0).
void UpdateScoresRef(ScoreRule rule, float lambda, const StreamSlice* streams, uint32_t num_streams,
                     const float* attention, float* scores, float* stream_max);
// The same update read from `old_scores` (laid out as `scores`) and written to `scores`,
// leaving the old ones as they were (a host step that may be undone): one pass instead of a
// copy and an update. `old_scores` may be `scores`.
void UpdateScoresRef(ScoreRule rule, float lambda, const StreamSlice* streams, uint32_t num_streams,
                     const float* attention, const float* old_scores, float* scores,
                     float* stream_max);

// Keep-set by priority: for unprotected slot j of a stream with n > budget,
//   r_j = (score_j * e_scale + float(pos_j - pos_0) * r_scale) + r_const
// with e_scale = w / max (0 when max is 0), r_scale = (1 - w) / (pos_{n-1} - pos_0) and
// r_const = 0 (r_scale = 0, r_const = 1 - w when pos_{n-1} = pos_0), w = attention_weight:
// CONF-KV's 0.65 * normalized EMA + 0.35 * recency; w = 1 with max = 1 gives the raw score
// (H2O); stream_max = nullptr stands for max = 1 in every stream. The top
// (budget - protect) by r are kept, ties going to the older (lower) slot; the protected
// tail always. keep[offset + j] = 1 for kept slots, else 0; streams with n <= budget keep
// everything.
void SelectTopRef(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                  const float* stream_max, const int64_t* positions, float attention_weight,
                  uint8_t* keep);

// The slot SelectTopRef drops from a stream exactly one slot over its budget (the decode
// steady state: budget - protect + 1 unprotected slots, budget > protect): the one with the
// smallest selection key among slots [0, unprotected). Host only: SelectTopRef's fast path,
// shared with the policies that run on the host so that both paths drop the same slot.
uint32_t LowestPriorityRef(const float* scores, const int64_t* positions, uint32_t length,
                           uint32_t unprotected, float max_score, float attention_weight);
// Test only: the same in four-lane vectors whatever the CPU (LowestPriorityRef takes eight
// lanes where it has AVX2), so that a test can check both widths against each other.
uint32_t LowestPriorityPortable(const float* scores, const int64_t* positions, uint32_t length,
                                uint32_t unprotected, float max_score, float attention_weight);

// Keep-set by threshold: unprotected slots with score >= threshold[s] are kept (budget is
// ignored), the protected tail always.
void SelectThresholdRef(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                        const float* threshold, uint8_t* keep);

// Moves each stream's kept slots (keep = 1) to the front of its slice, in order, for
// scores and positions, and writes the kept slot indices (ascending, stream-relative) to
// kept_index[offset + r] and the kept count to kept[s]. Slots past the kept count are left
// unspecified.
void CompactSlotsRef(const StreamSlice* streams, uint32_t num_streams, const uint8_t* keep,
                     float* scores, int64_t* positions, uint32_t* kept_index, uint32_t* kept);

// One step of the chain UpdateScores -> SelectTop as a policy states it (the per-stream
// budgets and protected tails go in the StreamSlices).
struct ScoreStep {
  ScoreRule rule = ScoreRule::kEma;
  float lambda = 0.0f;            // kEma's decay
  float attention_weight = 1.0f;  // SelectTop's w
  bool normalize = true;          // false: SelectTop gets stream_max = nullptr (raw scores)
  bool select = true;             // false: update the scores only
};

// One stream of one sequence in a batched step (StepBatch runs the steps of many sequences
// as one UpdateScoresSegments and one SelectTopSegments): the arrays are that sequence's
// own, laid out as above with `slice` the stream's place in them, and `op` its policy's.
struct StepSegment {
  StreamSlice slice;
  ScoreStep op;
  const float* attention;  // slice.length values, from attention[0]
  float* scores;           // updated in place
  float* saved_scores;     // laid out as `scores`: the stream's scores before the update
  const int64_t* positions;
  uint8_t* keep;           // laid out as `scores`: the keep flags when op.select
  StreamSlice* slice_out;  // where `slice` is written (what a later CompactSlots reads)
  uint64_t keep_copy;      // offset in SelectTopSegments' `keep_copy` of a copy of the flags
};

// For every segment i: saves its scores to saved_scores, updates them as UpdateScoresRef
// does (max to stream_max[i]) and writes its slice to *slice_out.
void UpdateScoresSegmentsRef(const StepSegment* segments, uint32_t n, float* stream_max);
// For every segment with op.select: the keep flags as SelectTopRef writes them (stream_max[i]
// when op.normalize, else raw scores), in `keep` and at keep_copy + segments[i].keep_copy.
void SelectTopSegmentsRef(const StepSegment* segments, uint32_t n, const float* stream_max,
                          uint8_t* keep_copy);

// One stream of one sequence in a batched compaction (CompactSlotsSegments), its arrays
// that sequence's own, `slice` the stream's place in them.
struct CompactSegment {
  StreamSlice slice;
  const uint8_t* keep;
  float* scores;
  int64_t* positions;
  uint32_t* kept_index;  // laid out as `scores`
  // Where the kept slots go, laid out as `scores` and `positions`: arrays of their own (the
  // sources then stay as they were), or null: in place.
  float* scores_out = nullptr;
  int64_t* positions_out = nullptr;
};
// CompactSlotsRef on every segment, into its outputs; segment i's kept count to kept[i].
void CompactSlotsSegmentsRef(const CompactSegment* segments, uint32_t n, uint32_t* kept);

// r_j's scale factors for one stream (see SelectTopRef), shared by both twins.
struct PriorityScale {
  float e_scale, r_scale, r_const;
};
KVMEM_HD PriorityScale PriorityScaleFor(float weight, float max_score, int64_t span) {
  PriorityScale p;
  p.e_scale = max_score > 0 ? weight / max_score : 0.0f;
  p.r_scale = span > 0 ? (1.0f - weight) / static_cast<float>(span) : 0.0f;
  p.r_const = span > 0 ? 0.0f : 1.0f - weight;
  return p;
}

// The 64-bit selection key of slot j with priority r: larger = kept first. Order by r,
// then by lower j. Shared by both twins.
KVMEM_HD uint64_t SelectionKey(float r, uint32_t j) {
  uint32_t u = FloatBits(r);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving for non-NaN floats
  return (uint64_t{u} << 32) | (0xffffffffu - j);
}

}  // namespace kvmem::kernels
