#pragma once
// Compaction of K/V rows after selection (the data half of an eviction step; select.h's
// CompactSlots does the metadata half): every stream's kept slots move, in order, to the
// front of the stream's blocks, and the blocks past ceil(kept / B) are then free. The C++
// reference is compact_ref.cc; compact.cu is the CUDA twin (one thread block per stream,
// all streams of a step in one launch). Byte-exact.
//
// Blocks are layout blocks: K rows [B][row_bytes] then V rows [B][row_bytes]; slot j of a
// stream lives in its block j / B at row j % B. Stream s's blocks are the pool offsets
// block_offsets[block_first[s] + i].
#include <cstdint>

#include "kernels/select.h"

namespace kvmem::kernels {

struct RowGeometry {
  uint32_t block_tokens;  // B
  uint32_t row_bytes;     // D * element bytes; a multiple of 4
};

// For stream s: slot r <- slot kept_index[offset + r] for r < kept[s] (kept_index
// ascending, as CompactSlots writes it); blocks_used[s] = ceil(kept[s] / B).
void CompactRowsRef(const StreamSlice* streams, uint32_t num_streams, const uint32_t* kept_index,
                    const uint32_t* kept, const uint64_t* block_offsets,
                    const uint32_t* block_first, RowGeometry g, uint8_t* base,
                    uint32_t* blocks_used);

}  // namespace kvmem::kernels
