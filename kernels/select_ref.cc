#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/select.h"

namespace kvmem::kernels {

void UpdateScoresRef(ScoreRule rule, float lambda, const StreamSlice* streams, uint32_t num_streams,
                     const float* attention, float* scores, float* stream_max) {
  for (uint32_t s = 0; s < num_streams; ++s) {
    const StreamSlice& st = streams[s];
    float mx = 0.0f;
    for (uint32_t j = st.offset; j < st.offset + st.length; ++j) {
      const float a = attention[j];
      float e;
      if (rule == ScoreRule::kAccumulate) {
        e = scores[j] + a;
      } else if (std::isnan(scores[j])) {
        e = a;
      } else {
        const float decayed = lambda * scores[j];
        const float fresh = (1.0f - lambda) * a;
        e = decayed + fresh;
      }
      scores[j] = e;
      mx = std::max(mx, e);
    }
    stream_max[s] = mx;
  }
}

void SelectTopRef(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                  const float* stream_max, const int64_t* positions, float attention_weight,
                  uint8_t* keep) {
  thread_local std::vector<uint64_t> keys;  // reused: called once per stream per step on the CPU
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
    const int64_t* pos = positions + st.offset;
    const PriorityScale p = PriorityScaleFor(attention_weight, stream_max ? stream_max[s] : 1.0f,
                                             pos[st.length - 1] - pos[0]);
    auto key = [&](uint32_t j) {
      const float a = scores[st.offset + j] * p.e_scale;
      const float b = static_cast<float>(pos[j] - pos[0]) * p.r_scale;
      return SelectionKey((a + b) + p.r_const, j);
    };
    if (take > 0 && take + 1 == unprotected) {
      // The steady state of decoding, one slot out: the smallest key goes (keys are
      // unique), found in one pass.
      uint32_t worst = 0;
      uint64_t worst_key = ~uint64_t{0};
      for (uint32_t j = 0; j < unprotected; ++j) {
        const uint64_t kj = key(j);
        if (kj < worst_key) {
          worst_key = kj;
          worst = j;
        }
      }
      std::fill(k, k + st.length, 1);
      k[worst] = 0;
      continue;
    }
    keys.resize(unprotected);
    for (uint32_t j = 0; j < unprotected; ++j) keys[j] = key(j);
    uint64_t threshold = ~uint64_t{0};  // take = 0 keeps none of them
    if (take > 0) {
      std::vector<uint64_t> sorted(keys);
      std::nth_element(sorted.begin(), sorted.begin() + (take - 1), sorted.end(),
                       std::greater<uint64_t>());
      threshold = sorted[take - 1];
    }
    for (uint32_t j = 0; j < unprotected; ++j) k[j] = take > 0 && keys[j] >= threshold;
    std::fill(k + unprotected, k + st.length, 1);
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
