#pragma once
// Array loops of the step's hot path that GCC leaves scalar at -O2, written four lanes at
// a time in GCC/Clang vector types (SSE2 on x86-64, NEON on arm64): the validation of float
// signals (attention rows: tens of thousands of values a step), the runs of ascending slot
// indices that keep-sets are made of, and their check.
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

// Whether v[0] < v[1] < ... < v[n - 1] < bound (true for n == 0): a keep-set's check, branch
// free over rounds of four neighbour pairs.
inline bool AscendingBelow(const uint32_t* v, size_t n, uint32_t bound) {
  if (n == 0) return true;
  if (v[n - 1] >= bound) return false;  // ascending, the last is the largest
  using U4 = uint32_t __attribute__((vector_size(16)));
  U4 bad = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 5 <= n; i += 4) {
    U4 a, b;
    std::memcpy(&a, v + i, sizeof a);
    std::memcpy(&b, v + i + 1, sizeof b);
    bad |= static_cast<U4>(b <= a);
  }
  uint32_t any = bad[0] | bad[1] | bad[2] | bad[3];
  for (; i + 1 < n; ++i) any |= static_cast<uint32_t>(v[i + 1] <= v[i]);
  return any == 0;
}

// In a strictly ascending v, v[j] - v[i] >= j - i, with equality exactly while v[i..j] is
// one run of consecutive values: a run's ends are binary searches, not walks over it.
// One past the last index of the run v[i] starts (i < n).
inline size_t RunEnd(const uint32_t* v, size_t n, size_t i) {
  size_t lo = i + 1, hi = n;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (size_t{v[mid]} - v[i] == mid - i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}
// The first index of the run v[e] ends.
inline size_t RunBegin(const uint32_t* v, size_t e) {
  size_t lo = 0, hi = e;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (size_t{v[e]} - v[mid] == e - mid) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// out[i] = first + i for i < count.
inline void FillAscending(uint32_t* out, uint32_t first, uint32_t count) {
  using U4 = uint32_t __attribute__((vector_size(16)));
  U4 next = U4{0, 1, 2, 3} + first;
  uint32_t i = 0;
  for (; i + 4 <= count; i += 4, next += 4) std::memcpy(out + i, &next, sizeof next);
  for (; i < count; ++i) out[i] = first + i;
}

}  // namespace kvmem
