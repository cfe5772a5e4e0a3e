// GPU benchmarks (CUDA + CMake only; built and run by tests/gpu/run.sh):
//   1. per-step eviction for the Llama-8B shape: 32 layers x 8 KV heads x 128 (f16), 4,096
//      tokens, confkv budget 256 (protect 32): the one-off compression of the prompt, then
//      the steady state of decoding (append one token to every stream, EMA update, top-k
//      selection, metadata compaction, K/V row compaction), against the article's 0.33 ms;
//   2. quantize / dequantize throughput against the device's own copy bandwidth
//      (cudaMemcpy device to device, measured in the same run).
// Prints Markdown tables for bench/RESULTS.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda_launch.h"
#include "tests/gpu/cuda_check.h"

namespace kvmem::kernels {
namespace {

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* p = nullptr;
  CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)));
  CUDA_OK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

class Timer {
 public:
  Timer() {
    CUDA_OK(cudaEventCreate(&a_));
    CUDA_OK(cudaEventCreate(&b_));
  }
  void Start() { CUDA_OK(cudaEventRecord(a_)); }
  float StopMs() {
    CUDA_OK(cudaEventRecord(b_));
    CUDA_OK(cudaEventSynchronize(b_));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaEvent_t a_, b_;
};

void Eviction() {
  const uint32_t L = 32, H = 8, D = 128, B = 16, n0 = 4096, budget = 256, protect = 32;
  const uint32_t S = L * H, cap = n0 + B;  // slots per stream in the flat arrays
  const uint32_t blocks_per_stream = cap / B;
  const RowGeometry g{B, D * 2};
  const uint64_t block_bytes = 2ull * B * g.row_bytes;
  std::mt19937 rng(1);
  std::vector<uint64_t> offsets(S * blocks_per_stream);
  for (uint32_t i = 0; i < offsets.size(); ++i) offsets[i] = i * block_bytes;
  std::shuffle(offsets.begin(), offsets.end(), rng);  // blocks anywhere in the pool
  std::vector<uint32_t> first(S);
  for (uint32_t s = 0; s < S; ++s) first[s] = s * blocks_per_stream;
  uint8_t* pool = nullptr;
  CUDA_OK(cudaMalloc(&pool, offsets.size() * block_bytes));
  CUDA_OK(cudaMemset(pool, 1, offsets.size() * block_bytes));
  std::vector<float> scores(S * cap, std::nanf("")), attention(S * cap);
  std::vector<int64_t> positions(S * cap);
  for (uint32_t s = 0; s < S; ++s) {
    for (uint32_t j = 0; j < cap; ++j) {
      positions[s * cap + j] = j;
      attention[s * cap + j] = std::uniform_real_distribution<float>(0, 1.0f / 64)(rng);
    }
  }
  std::vector<StreamSlice> prompt(S), steady(S);
  for (uint32_t s = 0; s < S; ++s) {
    prompt[s] = {s * cap, n0, budget, protect};
    steady[s] = {s * cap, budget + 1, budget, protect};
  }
  StreamSlice* d_prompt = Upload(prompt);
  StreamSlice* d_steady = Upload(steady);
  float* d_scores = Upload(scores);
  float* d_att = Upload(attention);
  int64_t* d_pos = Upload(positions);
  uint64_t* d_offsets = Upload(offsets);
  uint32_t* d_first = Upload(first);
  float* d_max = Upload(std::vector<float>(S));
  uint8_t* d_keep = Upload(std::vector<uint8_t>(S * cap));
  uint32_t* d_index = Upload(std::vector<uint32_t>(S * cap));
  uint32_t* d_kept = Upload(std::vector<uint32_t>(S));
  uint32_t* d_used = Upload(std::vector<uint32_t>(S));
  auto evict = [&](const StreamSlice* slices) {
    CUDA_OK(cuda::UpdateScores(ScoreRule::kEma, 0.9f, slices, S, d_att, d_scores, d_max, nullptr));
    CUDA_OK(cuda::SelectTop(slices, S, d_scores, d_max, d_pos, 0.65f, d_keep, nullptr));
    CUDA_OK(cuda::CompactSlots(slices, S, d_keep, d_scores, d_pos, d_index, d_kept, nullptr));
    CUDA_OK(cuda::CompactRows(slices, S, d_index, d_kept, d_offsets, d_first, g, pool, d_used,
                              nullptr));
  };
  Timer timer;
  timer.Start();
  evict(d_prompt);
  const float prompt_ms = timer.StopMs();
  // Steady state: each step appends one token (K and V rows, position, fresh score) at slot
  // `budget` of every stream, then evicts one.
  std::vector<CopyOp> row_ops, pos_ops, score_ops;
  for (uint32_t s = 0; s < S; ++s) {
    const uint64_t block = offsets[first[s] + budget / B];
    row_ops.push_back({0, block + (budget % B) * g.row_bytes, g.row_bytes});
    row_ops.push_back({g.row_bytes, block + (B + budget % B) * g.row_bytes, g.row_bytes});
    pos_ops.push_back({0, (s * cap + budget) * 8ull, 8});
    score_ops.push_back({0, (s * cap + budget) * 4ull, 4});
  }
  CopyOp* d_row_ops = Upload(row_ops);
  CopyOp* d_pos_ops = Upload(pos_ops);
  CopyOp* d_score_ops = Upload(score_ops);
  uint8_t* staging = Upload(std::vector<uint8_t>(2 * g.row_bytes, 3));
  const float nan = std::nanf("");
  std::vector<uint8_t> meta(16);
  std::memcpy(meta.data() + 8, &nan, 4);
  uint8_t* d_meta = Upload(meta);
  auto step = [&](int64_t position) {
    CUDA_OK(cudaMemcpyAsync(d_meta, &position, 8, cudaMemcpyHostToDevice, nullptr));
    CUDA_OK(cuda::CopyBatch(staging, pool, d_row_ops, row_ops.size(), nullptr));
    CUDA_OK(cuda::CopyBatch(d_meta, reinterpret_cast<uint8_t*>(d_pos), d_pos_ops, S, nullptr));
    CUDA_OK(
        cuda::CopyBatch(d_meta + 8, reinterpret_cast<uint8_t*>(d_scores), d_score_ops, S, nullptr));
    evict(d_steady);
  };
  for (int i = 0; i < 20; ++i) step(n0 + i);  // warm up
  CUDA_OK(cudaDeviceSynchronize());
  const int steps = 1000;
  timer.Start();
  for (int i = 0; i < steps; ++i) step(n0 + 20 + i);
  const float steady_ms = timer.StopMs() / steps;
  timer.Start();
  for (int i = 0; i < steps; ++i) {
    CUDA_OK(
        cuda::UpdateScores(ScoreRule::kEma, 0.9f, d_steady, S, d_att, d_scores, d_max, nullptr));
    CUDA_OK(cuda::SelectTop(d_steady, S, d_scores, d_max, d_pos, 0.65f, d_keep, nullptr));
    CUDA_OK(cuda::CompactSlots(d_steady, S, d_keep, d_scores, d_pos, d_index, d_kept, nullptr));
  }
  const float metadata_ms = timer.StopMs() / steps;
  timer.Start();
  for (int i = 0; i < steps; ++i) {
    CUDA_OK(cuda::CompactRows(d_steady, S, d_index, d_kept, d_offsets, d_first, g, pool, d_used,
                              nullptr));
  }
  const float rows_ms = timer.StopMs() / steps;
  std::printf(
      "\n### Per-step eviction, Llama-8B shape (256 streams x 128 f16, 4,096 tokens, "
      "confkv budget 256)\n\n| phase | ms | article |\n|---|---|---|\n");
  std::printf("| prompt compression 4,096 -> 256, once | %.3f | |\n", prompt_ms);
  std::printf("| decode step: append + EMA + top-k + compaction (7 launches) | %.4f | 0.33 |\n",
              steady_ms);
  std::printf("| of which metadata (EMA, top-k, slot compaction) | %.4f | 0.11 |\n", metadata_ms);
  std::printf("| of which K/V row compaction | %.4f | 0.22 |\n", rows_ms);
}

void Quantization() {
  const uint32_t D = 128, B = 16, blocks = 65536;
  const uint64_t layout = 2ull * B * D * 2;  // f16
  uint8_t* src = nullptr;
  CUDA_OK(cudaMalloc(&src, blocks * layout));
  CUDA_OK(cudaMemset(src, 0x3c, blocks * layout));  // f16 values near 1
  uint8_t* copy = nullptr;
  CUDA_OK(cudaMalloc(&copy, blocks * layout));
  Timer timer;
  CUDA_OK(cudaMemcpy(copy, src, blocks * layout, cudaMemcpyDeviceToDevice));
  timer.Start();
  for (int i = 0; i < 10; ++i) {
    CUDA_OK(cudaMemcpyAsync(copy, src, blocks * layout, cudaMemcpyDeviceToDevice, nullptr));
  }
  const double copy_gbs = 2.0 * blocks * layout * 10 / (timer.StopMs() * 1e6);
  std::printf(
      "\n### Quantize / dequantize throughput (f16 blocks of 16 x 128, %u blocks)\n\n"
      "Device copy bandwidth (cudaMemcpy D2D, read + write): %.0f GB/s\n\n"
      "| operation | GB/s (read + write) | share of copy bandwidth |\n|---|---|---|\n",
      blocks, copy_gbs);
  for (QuantType type : {QuantType::kInt8, QuantType::kInt4, QuantType::kNF4}) {
    const QuantGeometry g{type, B, D};
    const uint64_t qbytes = g.block_bytes();
    uint8_t* base = nullptr;
    CUDA_OK(cudaMalloc(&base, blocks * (layout + qbytes)));
    CUDA_OK(cudaMemcpy(base, src, blocks * layout, cudaMemcpyDeviceToDevice));
    std::vector<cuda::QuantizeDeviceOp> ops(blocks);
    std::vector<cuda::DequantizeDeviceOp> dops(blocks);
    for (uint32_t b = 0; b < blocks; ++b) {
      ops[b] = {b * layout, blocks * layout + b * qbytes, 0, B};
      dops[b] = {blocks * layout + b * qbytes, b * layout, b * layout + layout / 2, 0, B};
    }
    auto* d_ops = Upload(ops);
    auto* d_dops = Upload(dops);
    const char* name = type == QuantType::kInt8   ? "int8"
                       : type == QuantType::kInt4 ? "int4"
                                                  : "nf4";
    CUDA_OK(cuda::QuantizeBlocks(base, ElemType::kF16, g, d_ops, blocks, nullptr));
    timer.Start();
    for (int i = 0; i < 10; ++i) {
      CUDA_OK(cuda::QuantizeBlocks(base, ElemType::kF16, g, d_ops, blocks, nullptr));
    }
    const double q = double(blocks) * (layout + qbytes) * 10 / (timer.StopMs() * 1e6);
    timer.Start();
    for (int i = 0; i < 10; ++i) {
      CUDA_OK(cuda::DequantizeBlocks(base, g, ElemType::kF16, d_dops, blocks, copy, nullptr));
    }
    const double dq = double(blocks) * (layout + qbytes) * 10 / (timer.StopMs() * 1e6);
    std::printf("| quantize %s | %.0f | %.0f %% |\n", name, q, 100 * q / copy_gbs);
    std::printf("| dequantize %s | %.0f | %.0f %% |\n", name, dq, 100 * dq / copy_gbs);
    cudaFree(base);
    cudaFree(d_ops);
    cudaFree(d_dops);
  }
}

}  // namespace
}  // namespace kvmem::kernels

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu bench: no CUDA device, skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("gpu bench on %s\n", prop.name);
  kvmem::kernels::Eviction();
  kvmem::kernels::Quantization();
  return 0;
}
