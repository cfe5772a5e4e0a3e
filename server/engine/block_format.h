#pragma once
// BlockFormat: where each slot's bytes live inside a block, per precision, for one layout.
//
// Layout precision: K [B][D] then V [B][D] in the layout dtype.
// Quantized precisions: see kernels/quantize.h.
// A stream's block holds live slots [start, start + count); slots move only within the
// block they were written to, or between layout-precision blocks (exact byte copies), so
// quantized codes are never re-rounded.
#include <cstdint>
#include <optional>

#include "kernels/quantize.h"
#include "server/engine/layout.h"

namespace kvmem::engine {

enum class Precision : uint8_t { kLayout, kInt8, kInt4, kNF4 };

absl::string_view PrecisionName(Precision p);
kernels::ElemType ToElemType(DType dtype);
Precision ToPrecision(kernels::QuantType type);

// A byte range inside the pool.
struct ByteRange {
  uint64_t offset;
  uint64_t bytes;
};

class BlockFormat {
 public:
  BlockFormat(const Layout& layout, std::optional<kernels::QuantType> quant);

  uint32_t block_tokens() const { return B_; }
  kernels::ElemType elem() const { return elem_; }
  bool quantizes() const { return quant_.has_value(); }
  Precision quant_precision() const;
  const kernels::QuantGeometry& quant_geometry() const { return geometry_; }

  uint64_t block_bytes(Precision p) const;
  // Up to 4 ranges (K row, V row, and for nf4 the K and V scale rows) holding slot `slot`
  // of a block at `block_offset`; returns how many.
  int SlotRanges(Precision p, uint64_t block_offset, uint32_t slot, ByteRange out[4]) const;
  // KV bytes (ALGORITHMS.md) of `count` live slots in a block: data plus scales.
  uint64_t KvBytes(Precision p, uint32_t count) const;
  // The same over many blocks: `layout_slots` live slots in layout blocks, and
  // `quantized_slots` in `quantized_blocks` quantized ones.
  uint64_t KvBytes(uint64_t layout_slots, uint64_t quantized_slots,
                   uint64_t quantized_blocks) const;

 private:
  uint32_t B_;
  uint32_t D_;
  kernels::ElemType elem_;
  uint64_t row_bytes_;
  std::optional<kernels::QuantType> quant_;
  kernels::QuantGeometry geometry_;
};

}  // namespace kvmem::engine
