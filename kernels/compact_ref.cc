#include <cstring>

#include "kernels/compact.h"

namespace kvmem::kernels {

void CompactRowsRef(const StreamSlice* streams, uint32_t num_streams, const uint32_t* kept_index,
                    const uint32_t* kept, const uint64_t* block_offsets,
                    const uint32_t* block_first, RowGeometry g, uint8_t* base,
                    uint32_t* blocks_used) {
  const uint64_t plane = uint64_t{g.block_tokens} * g.row_bytes;
  for (uint32_t s = 0; s < num_streams; ++s) {
    const uint64_t* blocks = block_offsets + block_first[s];
    auto row = [&](uint32_t slot) {
      return base + blocks[slot / g.block_tokens] + uint64_t{slot % g.block_tokens} * g.row_bytes;
    };
    for (uint32_t r = 0; r < kept[s]; ++r) {
      const uint32_t from = kept_index[streams[s].offset + r];
      if (from == r) continue;  // ascending indices: from >= r, so sources are never stale
      std::memmove(row(r), row(from), g.row_bytes);
      std::memmove(row(r) + plane, row(from) + plane, g.row_bytes);
    }
    blocks_used[s] = (kept[s] + g.block_tokens - 1) / g.block_tokens;
  }
}

}  // namespace kvmem::kernels
