#pragma once
// Deterministic synthetic K/V for tests: element (stream s, position p, channel d) has a
// value that encodes all three, so misplaced or stale data is caught bit-exactly.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace kvmem::testing {

// Bit 14 is kept clear, so that the element is a finite f16 and bf16 (their exponents
// never all ones): kvmemd refuses infinities and NaNs in K and V.
inline uint16_t Element16(uint32_t stream, int64_t position, uint32_t d, uint16_t salt) {
  return static_cast<uint16_t>(position * 131 + stream * 17 + d * 3 + salt * 7919) & 0xbfffu;
}

// [streams][n][head_dim] of 2-byte elements for positions first..first+n-1.
inline std::string Payload16(uint32_t streams, int64_t first, uint32_t n, uint32_t head_dim,
                             uint16_t salt) {
  std::vector<uint16_t> data(size_t{streams} * n * head_dim);
  size_t i = 0;
  for (uint32_t s = 0; s < streams; ++s) {
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t d = 0; d < head_dim; ++d) data[i++] = Element16(s, first + t, d, salt);
    }
  }
  return std::string(reinterpret_cast<const char*>(data.data()), data.size() * 2);
}

// The expected [n][head_dim] bytes of one stream for the given retained positions.
inline std::string Expected16(uint32_t stream, const std::vector<int64_t>& positions,
                              uint32_t head_dim, uint16_t salt) {
  std::vector<uint16_t> data;
  data.reserve(positions.size() * head_dim);
  for (int64_t p : positions) {
    for (uint32_t d = 0; d < head_dim; ++d) data.push_back(Element16(stream, p, d, salt));
  }
  return std::string(reinterpret_cast<const char*>(data.data()), data.size() * 2);
}

inline std::vector<int64_t> Range(int64_t first, int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

// Finite values for quantization tests: element (s, p, d) as a float in [-15.6, 15.6],
// a multiple of 1/64 (exact in f16), neighbouring positions about 2 apart.
inline float ElementValue(uint32_t stream, int64_t position, uint32_t d, uint16_t salt) {
  const int64_t code = (position * 131 + stream * 17 + d * 3 + salt * 7919) % 2001;
  return static_cast<float>(code - 1000) / 64.0f;
}

// [streams][n][head_dim] f16 of ElementValue for positions first..first+n-1.
inline std::string PayloadF16(uint32_t streams, int64_t first, uint32_t n, uint32_t head_dim,
                              uint16_t salt) {
  std::string out;
  out.reserve(size_t{streams} * n * head_dim * 2);
  for (uint32_t s = 0; s < streams; ++s) {
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t d = 0; d < head_dim; ++d) {
        const uint16_t h = kernels::FloatToHalf(ElementValue(s, first + t, d, salt));
        out.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
  }
  return out;
}

}  // namespace kvmem::testing
