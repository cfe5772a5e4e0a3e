#pragma once
// Array loops of the step's hot path that GCC leaves scalar at -O2, written four lanes at
// a time in GCC/Clang vector types (SSE2 on x86-64, NEON on arm64): the validation of float
// signals (attention rows: tens of thousands of values a step).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvmem {

// The index of the first value that is not finite or lies outside [min, max]; n if none.
inline size_t FirstOutside(const float* values, size_t n, float min, float max) {
  using F4 = float __attribute__((vector_size(16)));
  using I4 = int32_t __attribute__((vector_size(16)));
  size_t i = 0;
  if (std::isfinite(min) && std::isfinite(max)) {
    // min <= v <= max is false for NaN and, the bounds being finite, for Inf. Rounds of 64
    // values; the round with a bad value is searched one by one below.
    const F4 lo = {min, min, min, min};
    const F4 hi = {max, max, max, max};
    for (; i + 64 <= n; i += 64) {
      I4 ok = {-1, -1, -1, -1};
      for (size_t k = 0; k < 64; k += 4) {
        F4 v;
        std::memcpy(&v, values + i + k, sizeof v);
        ok &= (v >= lo) & (v <= hi);
      }
      if ((ok[0] & ok[1] & ok[2] & ok[3]) == 0) break;
    }
  }
  for (; i < n; ++i) {
    if (!std::isfinite(values[i]) || values[i] < min || values[i] > max) return i;
  }
  return n;
}

}  // namespace kvmem
