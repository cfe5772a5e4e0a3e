// One decode step's attention rows at SmolLM2-135M's shape (90 streams x 257 weights: confkv
// at its low budget plus the new token) converted to f16 by the client library and back to
// f32 by kvmemd: the scalar twins of kernels/dtype.h, one value at a time, against the
// loops of kernels/half_arrays.h: the four-lane ones (*Lanes) and the entry points the
// client and kvmemd call (F16C where the CPU has it). Same data, one run: compare the rows'
// ratios.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/half_arrays.h"

namespace {

constexpr size_t kStreams = 90, kWeights = 257;

std::vector<float> Rows() {
  std::vector<float> v(kStreams * kWeights);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f / static_cast<float>(1 + i % kWeights);
  return v;
}

// The same rows as the client sends them.
std::vector<uint16_t> HalfRows() {
  const std::vector<float> rows = Rows();
  std::vector<uint16_t> half(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) half[j] = kvmem::kernels::FloatToHalf(rows[j]);
  return half;
}

void BM_NarrowScalar(benchmark::State& state) {
  const std::vector<float> rows = Rows();
  std::vector<char> half(2 * rows.size());
  for (auto _ : state) {
    for (size_t j = 0; j < rows.size(); ++j) {
      const uint16_t h = kvmem::kernels::FloatToHalf(rows[j]);
      std::memcpy(half.data() + 2 * j, &h, 2);
    }
    benchmark::DoNotOptimize(half.data());
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_NarrowScalar);

using Narrow = void (*)(const float*, size_t, void*);
using Widen = void (*)(const void*, size_t, float*);

void BM_NarrowRows(benchmark::State& state, Narrow narrow) {
  const std::vector<float> rows = Rows();
  std::vector<char> half(2 * rows.size());
  for (auto _ : state) {
    for (size_t s = 0; s < kStreams; ++s) {  // one call per row, as the client converts
      narrow(rows.data() + s * kWeights, kWeights, half.data() + 2 * s * kWeights);
    }
    benchmark::DoNotOptimize(half.data());
    benchmark::ClobberMemory();
  }
}
BENCHMARK_CAPTURE(BM_NarrowRows, FourLanes, kvmem::kernels::FloatToHalfLanes);
BENCHMARK_CAPTURE(BM_NarrowRows, Chosen, kvmem::kernels::FloatToHalf);

void BM_WidenScalar(benchmark::State& state) {
  const std::vector<uint16_t> half = HalfRows();
  std::vector<float> out(half.size());
  for (auto _ : state) {
    for (size_t j = 0; j < half.size(); ++j) out[j] = kvmem::kernels::HalfToFloat(half[j]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_WidenScalar);

void BM_WidenRows(benchmark::State& state, Widen widen) {
  const std::vector<uint16_t> half = HalfRows();
  std::vector<float> out(half.size());
  for (auto _ : state) {
    for (size_t s = 0; s < kStreams; ++s) {
      widen(half.data() + s * kWeights, kWeights, out.data() + s * kWeights);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}
BENCHMARK_CAPTURE(BM_WidenRows, FourLanes, kvmem::kernels::HalfToFloatLanes);
BENCHMARK_CAPTURE(BM_WidenRows, Chosen, kvmem::kernels::HalfToFloat);

}  // namespace

BENCHMARK_MAIN();
