#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/select.h"

namespace kvmem::kernels {
namespace {

// The per-slot loops run four slots at a time in GCC/Clang vector types (SSE2 on x86-64,
// NEON on arm64), LowestPriorityRef's eight at a time where the CPU has AVX2, with the
// scalar code for the tail. Every float operation is the one the contract writes, in its
// order, per slot, so the results are those of the scalar code bit for bit; only the order
// of the max reduction differs, and it does not matter (MaxLanes).
constexpr uint32_t kLanes = 4;
using F4 = float __attribute__((vector_size(16)));
using I4 = int32_t __attribute__((vector_size(16)));
using U4 = uint32_t __attribute__((vector_size(16)));

template <typename V, typename T>
V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V, typename T>
void Store(T* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
F4 Splat(float x) { return F4{x, x, x, x}; }

// max(from, lanes...) as a sequential std::max from `from` finds it: a NaN never replaces a
// value (x < NaN is false) and a -0 never replaces a +0, so lanes started at +0 end with the
// same maximum whatever the order the slots came in.
float MaxLanes(F4 lanes, float from) {
  for (uint32_t i = 0; i < kLanes; ++i) from = std::max(from, lanes[i]);
  return from;
}

// e = lambda * e + (1 - lambda) * a (a where e is NaN: never scored) for n slots, e read
// from `old` and written to `scores` (which may be `old`); returns max(0, e...).
float EmaStream(float lambda, uint32_t n, const float* attention, const float* old_scores,
                float* scores) {
  const float fresh_weight = 1.0f - lambda;
  F4 lanes = {};
  uint32_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F4 old = Load<F4>(old_scores + j);
    const F4 a = Load<F4>(attention + j);
    const F4 decayed = Splat(lambda) * old;
    const F4 fresh = Splat(fresh_weight) * a;
    const F4 e = old != old ? a : decayed + fresh;
    Store(scores + j, e);
    lanes = lanes < e ? e : lanes;
  }
  float mx = MaxLanes(lanes, 0.0f);
  for (; j < n; ++j) {
    const float old = old_scores[j];
    const float decayed = lambda * old;
    const float fresh = fresh_weight * attention[j];
    scores[j] = std::isnan(old) ? attention[j] : decayed + fresh;
    mx = std::max(mx, scores[j]);
  }
  return mx;
}

// s = s + a for n slots, s read from `old` and written to `scores`; returns max(0, s...).
float AccumulateStream(uint32_t n, const float* attention, const float* old_scores, float* scores) {
  F4 lanes = {};
  uint32_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F4 e = Load<F4>(old_scores + j) + Load<F4>(attention + j);
    Store(scores + j, e);
    lanes = lanes < e ? e : lanes;
  }
  float mx = MaxLanes(lanes, 0.0f);
  for (; j < n; ++j) {
    scores[j] = old_scores[j] + attention[j];
    mx = std::max(mx, scores[j]);
  }
  return mx;
}

// SelectionKey's high word as a signed integer (the sign bit flipped): the same order, in
// the signed compares SSE2 has.
int32_t OrderedBits(float r) {
  const uint32_t u = FloatBits(r);
  return static_cast<int32_t>(u ^ ((u & 0x80000000u) ? 0x7fffffffu : 0u));
}

// LowestPriorityRef's loop in vectors of kWidth = sizeof(F) / 4 lanes: four (F4, SSE2 or NEON)
// or eight (F8, AVX2 where the CPU has it). Per slot the same float operations in the same
// order as the scalar tail, and lanes merged by the scalar rule, so both widths return the
// same slot.
template <typename F, typename I, typename U>
__attribute__((always_inline)) inline uint32_t LowestPriorityLanes(
    const float* scores, const int64_t* positions, uint32_t length, uint32_t unprotected,
    float max_score, float attention_weight) {
  constexpr uint32_t kWidth = sizeof(F) / sizeof(float);
  const int64_t span = positions[length - 1] - positions[0];
  const PriorityScale p = PriorityScaleFor(attention_weight, max_score, span);
  // The smallest key: the lowest ordered priority, the later slot among equal ones (<=).
  int32_t lowest = std::numeric_limits<int32_t>::max();
  int32_t worst = -1;
  uint32_t j = 0;
  // Positions ascend (select.h), so pos_j - pos_0 lies in [0, span]: when span fits an
  // int32, it is the difference of the positions' low 32-bit words, and its float conversion
  // from int32 is the one from int64.
  const bool narrow = span >= 0 && span <= std::numeric_limits<int32_t>::max();
  if (narrow) {
    const uint32_t low0 = static_cast<uint32_t>(positions[0]);
    I best = I{} + lowest;
    I at = I{} - 1;
    I index;
    for (uint32_t i = 0; i < kWidth; ++i) index[i] = static_cast<int32_t>(i);
    const F e_scale = F{} + p.e_scale, r_scale = F{} + p.r_scale, r_const = F{} + p.r_const;
    for (; j + kWidth <= unprotected; j += kWidth, index += static_cast<int32_t>(kWidth)) {
      // The low words of kWidth little-endian int64 positions.
      // Loads by memcpy here, not Load<>: a function returning an AVX vector would be
      // compiled for the default target, with another ABI.
      U words_a, words_b;
      std::memcpy(&words_a, positions + j, sizeof words_a);
      std::memcpy(&words_b, positions + j + kWidth / 2, sizeof words_b);
      U low;
      if constexpr (kWidth == 4) {
        low = __builtin_shufflevector(words_a, words_b, 0, 2, 4, 6);
      } else {
        low = __builtin_shufflevector(words_a, words_b, 0, 2, 4, 6, 8, 10, 12, 14);
      }
      F slot_scores;
      std::memcpy(&slot_scores, scores + j, sizeof slot_scores);
      const F a = slot_scores * e_scale;
      const F b = __builtin_convertvector((I)(low - low0), F) * r_scale;
      const F r = (a + b) + r_const;
      I u;
      std::memcpy(&u, &r, sizeof u);
      // OrderedBits, lane by lane (written out: a function taking an AVX vector would be
      // compiled for the default target).
      const I ordered = u ^ ((u >> 31) & 0x7fffffff);
      const I take = ordered <= best;
      best = take ? ordered : best;
      at = take ? index : at;
    }
    for (uint32_t i = 0; i < kWidth; ++i) {
      if (best[i] < lowest || (best[i] == lowest && at[i] > worst)) {
        lowest = best[i];
        worst = at[i];
      }
    }
  }
  for (; j < unprotected; ++j) {  // later than every lane's slot
    const float a = scores[j] * p.e_scale;
    const int64_t since = positions[j] - positions[0];
    const float b =
        (narrow ? static_cast<float>(static_cast<int32_t>(since)) : static_cast<float>(since)) *
        p.r_scale;
    const int32_t ordered = OrderedBits((a + b) + p.r_const);
    if (ordered <= lowest) {
      lowest = ordered;
      worst = static_cast<int32_t>(j);
    }
  }
  return static_cast<uint32_t>(worst);
}

#if defined(__x86_64__)
using F8 = float __attribute__((vector_size(32)));
using I8 = int32_t __attribute__((vector_size(32)));
using U8 = uint32_t __attribute__((vector_size(32)));
// AVX2 without FMA; and this library builds with -ffp-contract=off (CMakeLists.txt), so
// a * b + c stays a product and a sum, as in the contract, whatever the target.
__attribute__((target("avx2"))) uint32_t LowestPriorityAvx2(const float* scores,
                                                            const int64_t* positions,
                                                            uint32_t length, uint32_t unprotected,
                                                            float max_score,
                                                            float attention_weight) {
  return LowestPriorityLanes<F8, I8, U8>(scores, positions, length, unprotected, max_score,
                                         attention_weight);
}
#endif

}  // namespace

uint32_t LowestPriorityPortable(const float* scores, const int64_t* positions, uint32_t length,
                                uint32_t unprotected, float max_score, float attention_weight) {
  return LowestPriorityLanes<F4, I4, U4>(scores, positions, length, unprotected, max_score,
                                         attention_weight);
}

uint32_t LowestPriorityRef(const float* scores, const int64_t* positions, uint32_t length,
                           uint32_t unprotected, float max_score, float attention_weight) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    return LowestPriorityAvx2(scores, positions, length, unprotected, max_score, attention_weight);
  }
#endif
  return LowestPriorityPortable(scores, positions, length, unprotected, max_score,
                                attention_weight);
}

void UpdateScoresRef(ScoreRule rule, float lambda, const StreamSlice* streams, uint32_t num_streams,
                     const float* attention, const float* old_scores, float* scores,
                     float* stream_max) {
  for (uint32_t s = 0; s < num_streams; ++s) {
    const StreamSlice& st = streams[s];
    const float* a = attention + st.offset;
    const float* old = old_scores + st.offset;
    stream_max[s] = rule == ScoreRule::kAccumulate
                        ? AccumulateStream(st.length, a, old, scores + st.offset)
                        : EmaStream(lambda, st.length, a, old, scores + st.offset);
  }
}

void UpdateScoresRef(ScoreRule rule, float lambda, const StreamSlice* streams, uint32_t num_streams,
                     const float* attention, float* scores, float* stream_max) {
  UpdateScoresRef(rule, lambda, streams, num_streams, attention, scores, scores, stream_max);
}

void SelectTopRef(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                  const float* stream_max, const int64_t* positions, float attention_weight,
                  uint8_t* keep) {
  // Reused: called once per stream per step on the CPU, from several threads.
  thread_local std::vector<uint64_t> keys, sorted;
  for (uint32_t s = 0; s < num_streams; ++s) {
    const StreamSlice& st = streams[s];
    uint8_t* k = keep + st.offset;
    if (st.length <= st.budget) {
      std::fill(k, k + st.length, 1);
      continue;
    }
    const uint32_t protect = std::min(st.protect, st.budget);
    const uint32_t unprotected = st.length - protect;
    const uint32_t take = st.budget - protect;
    const float* sc = scores + st.offset;
    const int64_t* pos = positions + st.offset;
    const float max_score = stream_max ? stream_max[s] : 1.0f;
    if (take > 0 && take + 1 == unprotected) {
      // The steady state of decoding, one slot out: the smallest key goes (keys are
      // unique), found in one pass over the priorities.
      std::fill(k, k + st.length, 1);
      k[LowestPriorityRef(sc, pos, st.length, unprotected, max_score, attention_weight)] = 0;
      continue;
    }
    const PriorityScale p =
        PriorityScaleFor(attention_weight, max_score, pos[st.length - 1] - pos[0]);
    keys.resize(unprotected);
    for (uint32_t j = 0; j < unprotected; ++j) {
      const float a = sc[j] * p.e_scale;
      const float b = static_cast<float>(pos[j] - pos[0]) * p.r_scale;
      keys[j] = SelectionKey((a + b) + p.r_const, j);
    }
    uint64_t threshold = ~uint64_t{0};  // take = 0 keeps none of them
    if (take > 0) {
      sorted.assign(keys.begin(), keys.end());
      std::nth_element(sorted.begin(), sorted.begin() + (take - 1), sorted.end(),
                       std::greater<uint64_t>());
      threshold = sorted[take - 1];
    }
    for (uint32_t j = 0; j < unprotected; ++j) k[j] = take > 0 && keys[j] >= threshold;
    std::fill(k + unprotected, k + st.length, 1);
  }
}

void UpdateScoresSegmentsRef(const StepSegment* segments, uint32_t n, float* stream_max) {
  for (uint32_t i = 0; i < n; ++i) {
    const StepSegment& g = segments[i];
    const StreamSlice one{0, g.slice.length, g.slice.budget, g.slice.protect};
    float* scores = g.scores + g.slice.offset;
    std::copy_n(scores, g.slice.length, g.saved_scores + g.slice.offset);
    UpdateScoresRef(g.op.rule, g.op.lambda, &one, 1, g.attention, scores, &stream_max[i]);
    *g.slice_out = g.slice;
  }
}

void SelectTopSegmentsRef(const StepSegment* segments, uint32_t n, const float* stream_max,
                          uint8_t* keep_copy) {
  for (uint32_t i = 0; i < n; ++i) {
    const StepSegment& g = segments[i];
    if (!g.op.select) continue;
    const StreamSlice one{0, g.slice.length, g.slice.budget, g.slice.protect};
    uint8_t* keep = g.keep + g.slice.offset;
    SelectTopRef(&one, 1, g.scores + g.slice.offset, g.op.normalize ? &stream_max[i] : nullptr,
                 g.positions + g.slice.offset, g.op.attention_weight, keep);
    std::copy_n(keep, g.slice.length, keep_copy + g.keep_copy);
  }
}

void CompactSlotsSegmentsRef(const CompactSegment* segments, uint32_t n, uint32_t* kept) {
  for (uint32_t i = 0; i < n; ++i) {
    const CompactSegment& g = segments[i];
    float* scores = g.scores_out != nullptr ? g.scores_out : g.scores;
    int64_t* positions = g.positions_out != nullptr ? g.positions_out : g.positions;
    const uint64_t at = g.slice.offset;
    uint32_t r = 0;
    for (uint32_t j = 0; j < g.slice.length; ++j) {
      if (!g.keep[at + j]) continue;
      scores[at + r] = g.scores[at + j];
      positions[at + r] = g.positions[at + j];
      g.kept_index[at + r] = j;
      ++r;
    }
    kept[i] = r;
  }
}

void SelectThresholdRef(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                        const float* threshold, uint8_t* keep) {
  for (uint32_t s = 0; s < num_streams; ++s) {
    const StreamSlice& st = streams[s];
    const uint32_t unprotected = st.length - std::min(st.protect, st.length);
    for (uint32_t j = 0; j < st.length; ++j) {
      keep[st.offset + j] = j >= unprotected || scores[st.offset + j] >= threshold[s];
    }
  }
}

void CompactSlotsRef(const StreamSlice* streams, uint32_t num_streams, const uint8_t* keep,
                     float* scores, int64_t* positions, uint32_t* kept_index, uint32_t* kept) {
  for (uint32_t s = 0; s < num_streams; ++s) {
    const StreamSlice& st = streams[s];
    uint32_t r = 0;
    for (uint32_t j = 0; j < st.length; ++j) {
      if (!keep[st.offset + j]) continue;
      scores[st.offset + r] = scores[st.offset + j];
      positions[st.offset + r] = positions[st.offset + j];
      kept_index[st.offset + r] = j;
      ++r;
    }
    kept[s] = r;
  }
}

}  // namespace kvmem::kernels
