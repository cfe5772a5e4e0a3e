#pragma once
// Whole arrays of floats to and from IEEE halves, bit for bit as the scalar twins in
// dtype.h: attention rows cross the wire as f16 (tens of thousands of values a step),
// narrowed by the client library and widened by kvmemd. Host code only.
//
// HalfToFloat / FloatToHalf take eight values at a time with the F16C instructions where the
// CPU has them (x86-64 since about 2012), else four at a time in GCC/Clang vector types
// (SSE2 on x86-64, NEON on arm64: the *Lanes functions). The instructions give the scalar
// twins' value for every input but a NaN (narrowing keeps its payload where the twin gives
// the canonical quiet NaN; widening quiets a signaling NaN the twin passes through): eight
// values holding a NaN go through the lanes instead.
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvmem::kernels {

// out[i] = the IEEE half at src + 2i (little-endian, any alignment) as a float, exactly as
// HalfToFloat(uint16_t) gives it (subnormals, infinities, NaN payloads), four at a time: the half's
// exponent and mantissa moved into a float's place and the exponent rebased; an infinity or NaN
// rebased once more to the float's all-ones exponent; a subnormal (or zero) made the normal float
// 2^-14 (1 + m/1024) and then exactly m * 2^-24 by subtracting 2^-14.
inline void HalfToFloatLanes(const void* src, size_t n, float* out) {
  using U4 = uint32_t __attribute__((vector_size(16)));
  using F4 = float __attribute__((vector_size(16)));
  constexpr uint32_t kRebase = (127 - 15) << 23;
  constexpr uint32_t kHalfMaxExp = 0x1fu << 23;  // after the shift by 13
  const auto four = [](const void* at, float* to) {
    using H4 = uint16_t __attribute__((vector_size(8)));
    H4 in;
    std::memcpy(&in, at, sizeof in);
    const U4 h = __builtin_convertvector(in, U4);
    U4 bits = (h & 0x7fffu) << 13;
    const U4 exp = bits & kHalfMaxExp;
    bits += kRebase;
    bits += static_cast<U4>(exp == kHalfMaxExp) & kRebase;  // Inf / NaN
    const U4 small = static_cast<U4>(exp == 0);             // subnormal or zero
    // The subtraction runs on every lane but is kept only for the small ones, so that a
    // signaling NaN's bits pass untouched (arithmetic would quiet it).
    const U4 raised = bits + (1u << 23);
    F4 f;
    std::memcpy(&f, &raised, sizeof f);
    const F4 two_to_minus_14 = {1.0f / 16384, 1.0f / 16384, 1.0f / 16384, 1.0f / 16384};
    f -= two_to_minus_14;
    U4 subnormal;
    std::memcpy(&subnormal, &f, sizeof subnormal);
    U4 result = (subnormal & small) | (bits & ~small);
    result |= (h & 0x8000u) << 16;
    std::memcpy(to, &result, sizeof result);
  };
  const auto* bytes = static_cast<const char*>(src);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) four(bytes + 2 * i, out + i);
  if (i == n) return;
  uint16_t rest[4] = {0, 0, 0, 0};
  float converted[4];
  std::memcpy(rest, bytes + 2 * i, (n - i) * sizeof(uint16_t));
  four(rest, converted);
  std::memcpy(out + i, converted, (n - i) * sizeof(float));
}

// dst + 2i = FloatToHalf(values[i]) (little-endian, any alignment), exactly as the scalar
// twin rounds (to nearest, ties to even; past the largest half to infinity; a NaN to the
// quiet NaN of its sign), four at a time. A normal half: the exponent rebased and the 13
// dropped bits rounded by adding 0xfff plus the kept mantissa's lowest bit. A subnormal half
// (|f| < 2^-14): |f| + 0.5f, whose float ulp is 2^-24, the half's subnormal step, makes the
// float unit do the rounding (the default rounding mode); its low bits are then the half.
// Unlike the scalar twin, the addition may raise the FP status flags (inexact; invalid for a
// signaling NaN): no caller reads them.
inline void FloatToHalfLanes(const float* values, size_t n, void* dst) {
  using U4 = uint32_t __attribute__((vector_size(16)));
  using F4 = float __attribute__((vector_size(16)));
  using H4 = uint16_t __attribute__((vector_size(8)));
  constexpr uint32_t kHalfMin = 113u << 23;   // 2^-14, the smallest normal half
  constexpr uint32_t kTooLarge = 143u << 23;  // 2^16: every larger value rounds to infinity
  constexpr uint32_t kFloatInfinity = 0xffu << 23;
  constexpr uint32_t kOneHalf = 126u << 23;  // 0.5f
  const auto four = [](const float* at, void* to) {
    U4 u;
    std::memcpy(&u, at, sizeof u);
    const U4 abs = u & 0x7fffffffu;
    const U4 normal = (abs - ((127u - 15u) << 23) + 0xfffu + ((abs >> 13) & 1u)) >> 13;
    F4 f;
    std::memcpy(&f, &abs, sizeof f);
    const F4 one_half = {0.5f, 0.5f, 0.5f, 0.5f};
    f += one_half;
    U4 subnormal;
    std::memcpy(&subnormal, &f, sizeof subnormal);
    subnormal -= kOneHalf;
    const U4 small = static_cast<U4>(abs < kHalfMin);
    const U4 large = static_cast<U4>(abs >= kTooLarge);
    const U4 special = 0x7c00u | (static_cast<U4>(abs > kFloatInfinity) & 0x200u);
    U4 h = (subnormal & small) | (normal & ~small);
    h = (special & large) | (h & ~large);
    h |= (u >> 16) & 0x8000u;
    const H4 out = __builtin_convertvector(h, H4);
    std::memcpy(to, &out, sizeof out);
  };
  auto* bytes = static_cast<char*>(dst);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) four(values + i, bytes + 2 * i);
  if (i == n) return;
  float rest[4] = {0, 0, 0, 0};
  uint16_t converted[4];
  std::memcpy(rest, values + i, (n - i) * sizeof(float));
  four(rest, converted);
  std::memcpy(bytes + 2 * i, converted, (n - i) * sizeof(uint16_t));
}

#if defined(__x86_64__)
// By CPUID (clang 14's __builtin_cpu_supports does not know "f16c"): the CPU has AVX and
// F16C, and the OS saves the AVX registers (OSXSAVE, then XCR0's SSE and AVX state bits).
inline bool HasF16c() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!osxsave || !avx || !f16c) return false;
    uint32_t xcr0_low = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    return (xcr0_low & 6u) == 6u;
  }();
  return has;
}

__attribute__((target("avx,f16c"))) inline void HalfToFloatF16c(const void* src, size_t n,
                                                                float* out) {
  const auto* bytes = static_cast<const char*>(src);
  const __m128i magnitude = _mm_set1_epi16(0x7fff);
  const __m128i infinity = _mm_set1_epi16(0x7c00);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 2 * i));
    // A NaN's magnitude is above infinity's (a signed compare: both are below 0x8000).
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, magnitude), infinity);
    if (_mm_movemask_epi8(nan) != 0) {
      HalfToFloatLanes(bytes + 2 * i, 8, out + i);
      continue;
    }
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  if (i < n) HalfToFloatLanes(bytes + 2 * i, n - i, out + i);
}

__attribute__((target("avx,f16c"))) inline void FloatToHalfF16c(const float* values, size_t n,
                                                                void* dst) {
  auto* bytes = static_cast<char*>(dst);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(values + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
      FloatToHalfLanes(values + i, 8, bytes + 2 * i);
      continue;
    }
    // Rounded to nearest, ties to even, by the instruction's own mode (not MXCSR's).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 2 * i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  }
  if (i < n) FloatToHalfLanes(values + i, n - i, bytes + 2 * i);
}
#endif

// out[i] = the IEEE half at src + 2i (little-endian, any alignment) as a float, exactly as
// HalfToFloat(uint16_t) gives it.
inline void HalfToFloat(const void* src, size_t n, float* out) {
#if defined(__x86_64__)
  if (HasF16c()) return HalfToFloatF16c(src, n, out);
#endif
  HalfToFloatLanes(src, n, out);
}

// dst + 2i = FloatToHalf(values[i]) (little-endian, any alignment), exactly as the scalar
// twin rounds.
inline void FloatToHalf(const float* values, size_t n, void* dst) {
#if defined(__x86_64__)
  if (HasF16c()) return FloatToHalfF16c(values, n, dst);
#endif
  FloatToHalfLanes(values, n, dst);
}

}  // namespace kvmem::kernels
