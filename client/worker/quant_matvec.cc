#include "quant_matvec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/dtype.h"

namespace kvmem::worker {
namespace {

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return kernels::HalfToFloat(h);
}

// Portable reference loops (any x86-64); the AVX2 versions below are used when the CPU has
// AVX2 and FMA.
void Q4_1Rows(const uint8_t* data, uint32_t rows, uint32_t blocks, const float* x,
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

void Q8_0Rows(const uint8_t* data, uint32_t rows, uint32_t blocks, const float* x, float* y) {
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

__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// The same sums with explicit AVX2: per block, the 32 codes widen to f32 in four groups of
// eight and meet x in four FMAs; the block scale joins through one more FMA.
// Sum over 32 weights of q[i] * x[i], the codes already widened to 4 x 8 int32 lanes: one
// multiply and three fused adds, the same order for Q4_1 and Q8_0.
__attribute__((target("avx2,fma"))) inline __m256 Dot32(__m256i q0, __m256i q1, __m256i q2,
                                                        __m256i q3, const float* x) {
  __m256 acc = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(x));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(x + 8), acc);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q2), _mm256_loadu_ps(x + 16), acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q3), _mm256_loadu_ps(x + 24), acc);
}

__attribute__((target("avx2,fma"))) void Q4_1RowsAvx2(const uint8_t* data, uint32_t rows,
                                                      uint32_t blocks, const float* x,
                                                      const float* block_sums, float* y) {
  const __m128i low_mask = _mm_set1_epi8(0x0f);
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* p = data + uint64_t{r} * blocks * 20;
    __m256 total = _mm256_setzero_ps();
    float offset = 0;
    for (uint32_t b = 0; b < blocks; ++b, p += 20) {
      const float* xb = x + uint64_t{b} * 32;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
      const __m128i lo = _mm_and_si128(q, low_mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
      const __m256 acc =
          Dot32(_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), xb);
      total = _mm256_fmadd_ps(acc, _mm256_set1_ps(Half(p)), total);
      offset += Half(p + 2) * block_sums[b];
    }
    y[r] = HorizontalSum(total) + offset;
  }
}

__attribute__((target("avx2,fma"))) void Q8_0RowsAvx2(const uint8_t* data, uint32_t rows,
                                                      uint32_t blocks, const float* x, float* y) {
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* p = data + uint64_t{r} * blocks * 34;
    __m256 total = _mm256_setzero_ps();
    for (uint32_t b = 0; b < blocks; ++b, p += 34) {
      const float* xb = x + uint64_t{b} * 32;
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18));
      const __m256 acc =
          Dot32(_mm256_cvtepi8_epi32(q0), _mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)),
                _mm256_cvtepi8_epi32(q1), _mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)), xb);
      total = _mm256_fmadd_ps(acc, _mm256_set1_ps(Half(p)), total);
    }
    y[r] = HorizontalSum(total);
  }
}

}  // namespace

int WorkerThreads() {
  static const int threads = [] {
    if (const char* env = std::getenv("KVMEM_WORKER_THREADS")) return std::max(1, std::atoi(env));
    return static_cast<int>(std::min(2u, std::max(1u, std::thread::hardware_concurrency())));
  }();
  return threads;
}

namespace {

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

namespace {
// Rows [r0, r1) of y = W x, with the kernel the CPU supports.
void Rows(const QuantMatrix& w, const float* x, const float* block_sums, uint32_t r0, uint32_t r1,
          float* y) {
  const uint32_t blocks = w.cols / 32;
  const uint64_t row_bytes = uint64_t{blocks} * (w.type == 3 ? 20 : 34);
  const uint8_t* data = w.data + r0 * row_bytes;
  if (w.type == 3) {
    (HasAvx2() ? Q4_1RowsAvx2 : Q4_1Rows)(data, r1 - r0, blocks, x, block_sums, y + r0);
  } else {
    (HasAvx2() ? Q8_0RowsAvx2 : Q8_0Rows)(data, r1 - r0, blocks, x, y + r0);
  }
}
}  // namespace

void QuantMatVec(const QuantMatrix& w, const float* x, float* y) {
  const uint32_t blocks = w.cols / 32;
  std::vector<float> sums;  // per-block sums of x, for Q4_1's offsets
  if (w.type == 3) {
    sums.resize(blocks);
    for (uint32_t b = 0; b < blocks; ++b) {
      float s = 0;
      for (int j = 0; j < 32; ++j) s += x[b * 32 + j];
      sums[b] = s;
    }
  }
  // Rows split across the worker's threads (OpenMP), one contiguous slice each.
  const int threads = w.rows >= 256 ? WorkerThreads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int t = 0; t < threads; ++t) {
    Rows(w, x, sums.data(), static_cast<uint32_t>(uint64_t{w.rows} * t / threads),
         static_cast<uint32_t>(uint64_t{w.rows} * (t + 1) / threads), y);
  }
}

namespace {
__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, uint32_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  float s = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((target("avx2,fma"))) void AxpyAvx2(float w, const float* x, float* y, size_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += w * x[i];
}
}  // namespace

float Dot(const float* a, const float* b, uint32_t n) {
  if (HasAvx2()) return DotAvx2(a, b, n);
  float s = 0;
  for (uint32_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

namespace {
// exp(x) for x <= 0 (softmax inputs after subtracting the max): 2^k * p(r) with
// x = k ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative error < 2e-7,
// a few float ulps, like std::exp's float results). Inputs below -87 give 0.
__attribute__((target("avx2,fma"))) __m256 ExpNonPositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k ln2, with ln2 split in a high and a low part for precision.
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) float ExpShiftSumAvx2(float* s, size_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = HorizontalSum(acc);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - shift));
  return sum;
}
}  // namespace

float ExpShiftSum(float* s, size_t n, float shift) {
  if (HasAvx2()) return ExpShiftSumAvx2(s, n, shift);
  float sum = 0;
  for (size_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - shift));
  return sum;
}

void Axpy(float w, const float* x, float* y, size_t n) {
  if (HasAvx2()) {
    AxpyAvx2(w, x, y, n);
    return;
  }
  for (uint32_t i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace kvmem::worker
