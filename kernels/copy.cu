// CUDA twin of copy_ref.cc's CopyBatchRef (contract: copy.h, cuda_launch.h).
#include <algorithm>

#include "kernels/cuda_launch.h"

namespace kvmem::kernels::cuda {
namespace {

// One op's bytes, by the block's threads: 16-byte words when the op allows, bytes else.
__device__ void CopyBytes(const uint8_t* s, uint8_t* d, uint64_t bytes) {
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) | bytes) & 15u) == 0;
  if (aligned) {
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (uint64_t w = threadIdx.x; w < bytes / 16; w += blockDim.x) d4[w] = s4[w];
  } else {
    for (uint64_t b = threadIdx.x; b < bytes; b += blockDim.x) d[b] = s[b];
  }
}

// One op per block (grid-stride over ops).
__global__ void CopyBatchKernel(const uint8_t* src, uint8_t* dst, const CopyOp* ops, uint32_t n) {
  for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const CopyOp op = ops[i];
    CopyBytes(src + op.src, dst + op.dst, op.bytes);
  }
}

__global__ void ScatterBatchKernel(const uint8_t* src, const ScatterOp* ops, uint32_t n) {
  for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const ScatterOp op = ops[i];
    CopyBytes(src + op.src, op.dst, op.bytes);
  }
}

}  // namespace

cudaError_t CopyBatch(const uint8_t* src, uint8_t* dst, const CopyOp* ops, uint32_t n,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const uint32_t blocks = std::min<uint32_t>(n, 65535u);
  return Launched([&] { CopyBatchKernel<<<blocks, 256, 0, stream>>>(src, dst, ops, n); });
}

cudaError_t ScatterBatch(const uint8_t* src, const ScatterOp* ops, uint32_t n,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const uint32_t blocks = std::min<uint32_t>(n, 65535u);
  return Launched([&] { ScatterBatchKernel<<<blocks, 256, 0, stream>>>(src, ops, n); });
}

}  // namespace kvmem::kernels::cuda
