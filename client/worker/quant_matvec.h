#pragma once
// Matrix-vector products straight from GGUF's quantized blocks (Q4_1, Q8_0), for decode:
// one token reads each weight once, so reading 0.6-1.1 bytes per weight instead of 4 (f32)
// is what sets the speed. Arithmetic is f32 on the exact dequantized values
// (d * q + m), so results differ from the f32 matrix path only by summation order.
#include <cstddef>
#include <cstdint>

namespace kvmem::worker {

struct QuantMatrix {
  uint32_t type = 0;              // ggml type: 3 = Q4_1, 8 = Q8_0
  uint32_t rows = 0;              // outputs
  uint32_t cols = 0;              // inputs, a multiple of 32
  const uint8_t* data = nullptr;  // rows x (cols / 32) blocks, row-major
};

// y[rows] = W x[cols], rows split across WorkerThreads().
void QuantMatVec(const QuantMatrix& w, const float* x, float* y);

// Threads the worker computes with: KVMEM_WORKER_THREADS, else min(2, cores).
int WorkerThreads();

// Vector helpers for attention (AVX2 where available).
float Dot(const float* a, const float* b, uint32_t n);
void Axpy(float w, const float* x, float* y, size_t n);  // y += w x
// s[i] = exp(s[i] - shift) for i < n, where every s[i] <= shift (softmax after its max);
// returns the sum. Relative error under 2e-7 per value.
float ExpShiftSum(float* s, size_t n, float shift);

}  // namespace kvmem::worker
