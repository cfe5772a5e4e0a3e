#pragma once
// Element types of a layout and their conversions to and from float, shared by the CPU
// reference kernels, the client library and (as __host__ __device__) CUDA kernels.
// Conversions round to nearest even; NaN and Inf are preserved.
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVMEM_HD __host__ __device__ inline
#else
#define KVMEM_HD inline
#endif

namespace kvmem::kernels {

enum class ElemType : uint8_t { kF16, kBF16, kF32 };

KVMEM_HD uint32_t ElemBytes(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

KVMEM_HD uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

KVMEM_HD float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

KVMEM_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // Inf / NaN
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    // Subnormal: normalize.
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return BitsFloat(sign | (exp << 23) | (mant << 13));
  }
  return BitsFloat(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

KVMEM_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf / NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> Inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 - (exp - 127) + 13 - 13 ... aligns to half subnormal
    uint32_t half = mant >> (shift);
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

KVMEM_HD float Bf16ToFloat(uint16_t b) { return BitsFloat(uint32_t{b} << 16); }

KVMEM_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// Element i of an array of `type`.
KVMEM_HD float LoadElem(const void* data, uint64_t i, ElemType type) {
  switch (type) {
    case ElemType::kF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(data) + 2 * i, 2);
      return HalfToFloat(h);
    }
    case ElemType::kBF16: {
      uint16_t b;
      std::memcpy(&b, static_cast<const uint8_t*>(data) + 2 * i, 2);
      return Bf16ToFloat(b);
    }
    case ElemType::kF32: {
      float f;
      std::memcpy(&f, static_cast<const uint8_t*>(data) + 4 * i, 4);
      return f;
    }
  }
  return 0.0f;
}

KVMEM_HD void StoreElem(void* data, uint64_t i, ElemType type, float value) {
  switch (type) {
    case ElemType::kF16: {
      const uint16_t h = FloatToHalf(value);
      std::memcpy(static_cast<uint8_t*>(data) + 2 * i, &h, 2);
      return;
    }
    case ElemType::kBF16: {
      const uint16_t b = FloatToBf16(value);
      std::memcpy(static_cast<uint8_t*>(data) + 2 * i, &b, 2);
      return;
    }
    case ElemType::kF32:
      std::memcpy(static_cast<uint8_t*>(data) + 4 * i, &value, 4);
      return;
  }
}

}  // namespace kvmem::kernels
