#include "quant_matvec.h"

#include <cstring>
#include <vector>

#include "kernels/dtype.h"

namespace kvmem::worker {
namespace {

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kernels::HalfToFloat(h);
}

// Built for AVX2+FMA where the CPU has them, plain x86-64 otherwise (chosen at load time).
__attribute__((target_clones("avx2", "default"))) void Q4_1Rows(const uint8_t* data, uint32_t rows,
                                                                uint32_t blocks, const float* x,
                                                                const float* block_sums, float* y) {
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* p = data + uint64_t{r} * blocks * 20;
    float total = 0;
    for (uint32_t b = 0; b < blocks; ++b, p += 20) {
      const float* xb = x + uint64_t{b} * 32;
      const uint8_t* qs = p + 4;
      float acc = 0;
      for (int j = 0; j < 16; ++j) {
        acc +=
            static_cast<float>(qs[j] & 0x0f) * xb[j] + static_cast<float>(qs[j] >> 4) * xb[j + 16];
      }
      total += Half(p) * acc + Half(p + 2) * block_sums[b];
    }
    y[r] = total;
  }
}

__attribute__((target_clones("avx2", "default"))) void Q8_0Rows(const uint8_t* data, uint32_t rows,
                                                                uint32_t blocks, const float* x,
                                                                float* y) {
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* p = data + uint64_t{r} * blocks * 34;
    float total = 0;
    for (uint32_t b = 0; b < blocks; ++b, p += 34) {
      const float* xb = x + uint64_t{b} * 32;
      const auto* qs = reinterpret_cast<const int8_t*>(p + 2);
      float acc = 0;
      for (int j = 0; j < 32; ++j) acc += static_cast<float>(qs[j]) * xb[j];
      total += Half(p) * acc;
    }
    y[r] = total;
  }
}

}  // namespace

void QuantMatVec(const QuantMatrix& w, const float* x, float* y) {
  const uint32_t blocks = w.cols / 32;
  if (w.type == 3) {
    std::vector<float> sums(blocks);
    for (uint32_t b = 0; b < blocks; ++b) {
      float s = 0;
      for (int j = 0; j < 32; ++j) s += x[b * 32 + j];
      sums[b] = s;
    }
    Q4_1Rows(w.data, w.rows, blocks, x, sums.data(), y);
  } else {
    Q8_0Rows(w.data, w.rows, blocks, x, y);
  }
}

}  // namespace kvmem::worker
