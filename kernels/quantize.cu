// CUDA twin of quantize_ref.cc (contract: quantize.h). The same arithmetic in the same order
// (IEEE division, round half to even, no fused multiply-add in the code paths), so codes and
// scales are byte-identical to the reference.
#include <algorithm>

#include "kernels/cuda_launch.h"

namespace kvmem::kernels::cuda {
namespace {

// kNf4Codes in constant memory (the host array is not addressable from the device).
__constant__ float kNf4[16] = {kNf4Codes[0],  kNf4Codes[1],  kNf4Codes[2],  kNf4Codes[3],
                               kNf4Codes[4],  kNf4Codes[5],  kNf4Codes[6],  kNf4Codes[7],
                               kNf4Codes[8],  kNf4Codes[9],  kNf4Codes[10], kNf4Codes[11],
                               kNf4Codes[12], kNf4Codes[13], kNf4Codes[14], kNf4Codes[15]};

__device__ uint8_t NearestNf4(float v) {
  uint8_t best = 0;
  float best_err = fabsf(v - kNf4[0]);
  for (uint8_t i = 1; i < 16; ++i) {
    const float err = fabsf(v - kNf4[i]);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

// Block (op, plane): plane 0 = K, 1 = V. Threads over channel pairs (int8: channels).
__global__ void QuantizeKernel(uint8_t* base, ElemType elem, QuantGeometry g,
                               const QuantizeDeviceOp* ops) {
  const QuantizeDeviceOp op = ops[blockIdx.x];
  const uint32_t plane = blockIdx.y;
  const uint32_t D = g.head_dim, row_bytes = g.code_row_bytes();
  const uint64_t plane_bytes = uint64_t{g.block_tokens} * D * ElemBytes(elem);
  const uint8_t* src = base + op.src + plane * plane_bytes;
  uint8_t* codes = base + op.dst + (plane == 0 ? 0 : g.v_codes_offset());
  float* scales = reinterpret_cast<float*>(
      base + op.dst + (plane == 0 ? g.k_scales_offset() : g.v_scales_offset()));
  if (g.type == QuantType::kNF4) {
    // One thread per (slot, group of 64 channels).
    const uint32_t G = g.groups();
    for (uint32_t item = threadIdx.x; item < op.count * G; item += blockDim.x) {
      const uint32_t t = op.start + item / G, grp = item % G;
      const uint32_t c0 = grp * 64, c1 = min(D, c0 + 64);
      float absmax = 0;
      for (uint32_t c = c0; c < c1; ++c) {
        absmax = fmaxf(absmax, ScaleCandidate(LoadElem(src, uint64_t{t} * D + c, elem)));
      }
      scales[uint64_t{t} * G + grp] = absmax;
      uint8_t* row = codes + uint64_t{t} * row_bytes;
      for (uint32_t c = c0; c < c1; c += 2) {
        uint8_t byte = 0;
        for (uint32_t k = 0; k < 2 && c + k < c1; ++k) {
          const float x = LoadElem(src, uint64_t{t} * D + c + k, elem);
          const uint8_t q = NearestNf4(Nf4Ratio(x, absmax));
          byte |= static_cast<uint8_t>(q << (4 * k));
        }
        row[c / 2] = byte;
      }
    }
    return;
  }
  const bool int8 = g.type == QuantType::kInt8;
  const float qmax = int8 ? 127.0f : 7.0f;
  const uint32_t per_thread = int8 ? 1 : 2;
  for (uint32_t c0 = threadIdx.x * per_thread; c0 < D; c0 += blockDim.x * per_thread) {
    float scale[2] = {0, 0};
    for (uint32_t k = 0; k < per_thread && c0 + k < D; ++k) {
      float absmax = 0;
      for (uint32_t t = op.start; t < op.start + op.count; ++t) {
        absmax = fmaxf(absmax, ScaleCandidate(LoadElem(src, uint64_t{t} * D + c0 + k, elem)));
      }
      scale[k] = absmax / qmax;
      scales[c0 + k] = scale[k];
    }
    for (uint32_t t = op.start; t < op.start + op.count; ++t) {
      uint8_t* row = codes + uint64_t{t} * row_bytes;
      uint8_t byte = 0;
      for (uint32_t k = 0; k < per_thread && c0 + k < D; ++k) {
        const float x = LoadElem(src, uint64_t{t} * D + c0 + k, elem);
        const float q = SymmetricCode(x, scale[k], qmax);
        if (int8) {
          row[c0] = static_cast<uint8_t>(static_cast<int8_t>(q));
        } else {
          byte |= static_cast<uint8_t>((static_cast<int>(q) + 8) << (4 * k));
        }
      }
      if (!int8) row[c0 / 2] = byte;
    }
  }
}

// Block (op, plane); threads over (slot, channel) of the live range.
__global__ void DequantizeKernel(const uint8_t* base, QuantGeometry g, ElemType elem,
                                 const DequantizeDeviceOp* ops, uint8_t* out) {
  const DequantizeDeviceOp op = ops[blockIdx.x];
  const uint32_t plane = blockIdx.y;
  const uint32_t D = g.head_dim, row_bytes = g.code_row_bytes();
  const uint8_t* codes = base + op.src + (plane == 0 ? 0 : g.v_codes_offset());
  const float* scales = reinterpret_cast<const float*>(
      base + op.src + (plane == 0 ? g.k_scales_offset() : g.v_scales_offset()));
  uint8_t* dst = out + (plane == 0 ? op.k_out : op.v_out);
  for (uint32_t item = threadIdx.x; item < op.count * D; item += blockDim.x) {
    const uint32_t i = item / D, c = item % D, t = op.start + i;
    const uint8_t* row = codes + uint64_t{t} * row_bytes;
    const uint8_t nibble = (c % 2 == 0) ? (row[c / 2] & 0x0f) : (row[c / 2] >> 4);
    float x = 0;
    switch (g.type) {
      case QuantType::kInt8:
        x = static_cast<float>(static_cast<int8_t>(row[c])) * scales[c];
        break;
      case QuantType::kInt4:
        x = static_cast<float>(static_cast<int>(nibble) - 8) * scales[c];
        break;
      case QuantType::kNF4:
        x = kNf4[nibble] * scales[uint64_t{t} * g.groups() + c / 64];
        break;
    }
    StoreElem(dst, uint64_t{i} * D + c, elem, x);
  }
}

}  // namespace

cudaError_t QuantizeBlocks(uint8_t* base, ElemType elem, QuantGeometry g,
                           const QuantizeDeviceOp* ops, uint32_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launched([&] { QuantizeKernel<<<dim3(n, 2), 128, 0, stream>>>(base, elem, g, ops); });
}

cudaError_t DequantizeBlocks(const uint8_t* base, QuantGeometry g, ElemType elem,
                             const DequantizeDeviceOp* ops, uint32_t n, uint8_t* out,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launched(
      [&] { DequantizeKernel<<<dim3(n, 2), 256, 0, stream>>>(base, g, elem, ops, out); });
}

}  // namespace kvmem::kernels::cuda
