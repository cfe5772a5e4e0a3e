#pragma once
// Array loops of the step's hot path that GCC leaves scalar at -O2, written four lanes at
// a time in GCC/Clang vector types (SSE2 on x86-64, NEON on arm64): the validation of float
// signals (attention rows: tens of thousands of values a step) and of K/V. Their conversion
// from f16 lives with the client's conversion to it, in kernels/half_arrays.h.
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

// The index of the first element of `n` IEEE values of `bytes` bytes each (2: f16 or bf16,
// 4: f32; little-endian, any alignment) whose exponent bits are all ones (an infinity or a
// NaN); n if none. `exponent` is the format's exponent mask (0x7c00 f16, 0x7f80 bf16,
// 0x7f800000 f32). Rounds of 64 bytes; the round with a bad value is searched one by one.
inline size_t FirstNonFinite(const void* data, size_t n, uint32_t bytes, uint32_t exponent) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto bad = [&](size_t i) {
    uint32_t v = 0;
    std::memcpy(&v, p + i * bytes, bytes);
    return (v & exponent) == exponent;
  };
  using U4 = uint32_t __attribute__((vector_size(16)));
  // Two halves in a 32-bit lane are checked as a pair of masks.
  const uint32_t lane_mask = bytes == 2 ? exponent | (exponent << 16) : exponent;
  const U4 mask = {lane_mask, lane_mask, lane_mask, lane_mask};
  const U4 lo = bytes == 2 ? U4{exponent, exponent, exponent, exponent} : mask;
  const U4 hi = bytes == 2 ? lo << 16 : mask;
  const size_t total = n * bytes;
  size_t at = 0;
  for (; at + 64 <= total; at += 64) {
    U4 any = {0, 0, 0, 0};
    for (size_t k = 0; k < 64; k += 16) {
      U4 v;
      std::memcpy(&v, p + at + k, sizeof v);
      any |= static_cast<U4>((v & lo) == lo) | static_cast<U4>((v & hi) == hi);
    }
    if ((any[0] | any[1] | any[2] | any[3]) != 0) break;
  }
  for (size_t i = at / bytes; i < n; ++i) {
    if (bad(i)) return i;
  }
  return n;
}

}  // namespace kvmem
