#pragma once
// Where a token's K and V rows lie inside a layout-precision block, for every component that
// computes it (the daemon's planner and reads, the same-host client). Quantized blocks have
// their own layout (quantize.h).
//
// Layout precision: [K rows: block_tokens][V rows: block_tokens], one row = head_dim
// elements of the layout dtype (row_bytes), slot s at row s of each plane.
#include <cstdint>

namespace kvmem::kernels {

struct LayoutBlock {
  uint32_t block_tokens;
  uint64_t row_bytes;

  uint64_t k_offset(uint64_t slot) const { return slot * row_bytes; }
  uint64_t v_offset(uint64_t slot) const { return (block_tokens + slot) * row_bytes; }
  uint64_t bytes() const { return 2 * uint64_t{block_tokens} * row_bytes; }
};

}  // namespace kvmem::kernels
