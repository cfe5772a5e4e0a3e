// CUDA twin of compact_ref.cc (contract: compact.h). One thread block per stream; kept rows
// move chunk by chunk: every thread reads its 4-byte word of the chunk's rows, the block
// synchronizes, then writes. Destinations are at or before their sources, so no chunk
// overwrites a row a later chunk still has to read.
#include "kernels/cuda_launch.h"

namespace kvmem::kernels::cuda {
namespace {

constexpr uint32_t kThreads = 256;

__global__ void CompactRowsKernel(const StreamSlice* streams, const uint32_t* kept_index,
                                  const uint32_t* kept, const uint64_t* block_offsets,
                                  const uint32_t* block_first, RowGeometry g, uint8_t* base,
                                  uint32_t* blocks_used) {
  const uint32_t s = blockIdx.x;
  const uint32_t n = kept[s];
  const uint64_t* blocks = block_offsets + block_first[s];
  const uint64_t plane = uint64_t{g.block_tokens} * g.row_bytes;
  const uint32_t words = g.row_bytes / 4;  // per row and plane
  const uint32_t per_chunk = 2 * words;    // K and V words of one row
  const uint32_t rows_per_chunk = per_chunk >= kThreads ? 1 : kThreads / per_chunk;
  for (uint32_t r0 = 0; r0 < n; r0 += rows_per_chunk) {
    // Each row's 2 * words words are spread over the block (several passes for big rows).
    for (uint32_t w0 = 0; w0 < rows_per_chunk * per_chunk; w0 += kThreads) {
      const uint32_t item = w0 + threadIdx.x;
      const uint32_t r = r0 + item / per_chunk, w = item % per_chunk;
      const bool active = item < rows_per_chunk * per_chunk && r < n;
      uint32_t value = 0;
      uint32_t* dst = nullptr;
      if (active) {
        const uint32_t from = kept_index[streams[s].offset + r];
        const uint64_t in_plane = (w < words ? 0 : plane) + uint64_t{w % words} * 4;
        const uint8_t* src = base + blocks[from / g.block_tokens] +
                             uint64_t{from % g.block_tokens} * g.row_bytes + in_plane;
        dst = reinterpret_cast<uint32_t*>(base + blocks[r / g.block_tokens] +
                                          uint64_t{r % g.block_tokens} * g.row_bytes + in_plane);
        value = *reinterpret_cast<const uint32_t*>(src);
      }
      __syncthreads();
      if (active) *dst = value;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) blocks_used[s] = (n + g.block_tokens - 1) / g.block_tokens;
}

}  // namespace

cudaError_t CompactRows(const StreamSlice* streams, uint32_t num_streams,
                        const uint32_t* kept_index, const uint32_t* kept,
                        const uint64_t* block_offsets, const uint32_t* block_first, RowGeometry g,
                        uint8_t* base, uint32_t* blocks_used, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;
  return Launched([&] {
    CompactRowsKernel<<<num_streams, kThreads, 0, stream>>>(
        streams, kept_index, kept, block_offsets, block_first, g, base, blocks_used);
  });
}

}  // namespace kvmem::kernels::cuda
