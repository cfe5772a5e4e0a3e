#pragma once
// Host entry points of the CUDA twins (copy.cu, select.cu, quantize.cu). Pointers are device
// pointers; every launch is asynchronous on `stream` and returns the launch error (errors
// of the work itself surface at the next synchronization). Contracts: the headers of each
// operation (copy.h, select.h, quantize.h).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/compact.h"
#include "kernels/copy.h"
#include "kernels/quantize.h"
#include "kernels/select.h"

namespace kvmem::kernels::cuda {

// Runs `launch` (a <<<>>> launch) and returns its launch error. A launch reports that only
// through cudaGetLastError, which also hands back an earlier failed runtime call of this
// thread that nobody read (a cudaMalloc that ran out, say) and would fail a good request
// with it; so the record is cleared first. Every launcher goes through here.
template <typename Launch>
cudaError_t Launched(Launch&& launch) {
  (void)cudaGetLastError();
  launch();
  return cudaGetLastError();
}

// ops[i] copies [src + ops[i].src, + bytes) to [dst + ops[i].dst, + bytes); destinations
// must not overlap each other or any source (a move wave goes pool -> scratch -> pool).
cudaError_t CopyBatch(const uint8_t* src, uint8_t* dst, const CopyOp* ops, uint32_t n,
                      cudaStream_t stream);

// ops[i] copies [src + ops[i].src, + bytes) to ops[i].dst (copy.h); `ops` on the device.
cudaError_t ScatterBatch(const uint8_t* src, const ScatterOp* ops, uint32_t n, cudaStream_t stream);

// Quantize / dequantize batches over the pool at `base` (QuantizeOp / this op's offsets).
struct QuantizeDeviceOp {
  uint64_t src;  // layout block (K plane then V plane)
  uint64_t dst;  // quantized block
  uint32_t start, count;
};
struct DequantizeDeviceOp {
  uint64_t src;           // quantized block in the pool
  uint64_t k_out, v_out;  // byte offsets in `out` for [count][D] rows of K and V
  uint32_t start, count;
};
cudaError_t QuantizeBlocks(uint8_t* base, ElemType elem, QuantGeometry g,
                           const QuantizeDeviceOp* ops, uint32_t n, cudaStream_t stream);
cudaError_t DequantizeBlocks(const uint8_t* base, QuantGeometry g, ElemType elem,
                             const DequantizeDeviceOp* ops, uint32_t n, uint8_t* out,
                             cudaStream_t stream);

// select.h, one block per stream.
cudaError_t UpdateScores(ScoreRule rule, float lambda, const StreamSlice* streams,
                         uint32_t num_streams, const float* attention, float* scores,
                         float* stream_max, cudaStream_t stream);
cudaError_t SelectTop(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                      const float* stream_max, const int64_t* positions, float attention_weight,
                      uint8_t* keep, cudaStream_t stream);
// select.h's segments (one block per segment); `segments` in device memory.
cudaError_t UpdateScoresSegments(const StepSegment* segments, uint32_t n, float* stream_max,
                                 cudaStream_t stream);
cudaError_t SelectTopSegments(const StepSegment* segments, uint32_t n, const float* stream_max,
                              uint8_t* keep_copy, cudaStream_t stream);
cudaError_t CompactSlotsSegments(const CompactSegment* segments, uint32_t n, uint32_t* kept,
                                 cudaStream_t stream);
cudaError_t SelectThreshold(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                            const float* threshold, uint8_t* keep, cudaStream_t stream);
cudaError_t CompactSlots(const StreamSlice* streams, uint32_t num_streams, const uint8_t* keep,
                         float* scores, int64_t* positions, uint32_t* kept_index, uint32_t* kept,
                         cudaStream_t stream);

// compact.h, one block per stream.
cudaError_t CompactRows(const StreamSlice* streams, uint32_t num_streams,
                        const uint32_t* kept_index, const uint32_t* kept,
                        const uint64_t* block_offsets, const uint32_t* block_first, RowGeometry g,
                        uint8_t* base, uint32_t* blocks_used, cudaStream_t stream);

}  // namespace kvmem::kernels::cuda
