#include "server/engine/block_format.h"

#include "kernels/block_layout.h"

namespace kvmem::engine {

absl::string_view PrecisionName(Precision p) {
  switch (p) {
    case Precision::kLayout:
      return "layout";
    case Precision::kInt8:
      return "int8";
    case Precision::kInt4:
      return "int4";
    case Precision::kNF4:
      return "nf4";
  }
  return "?";
}

kernels::ElemType ToElemType(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return kernels::ElemType::kF16;
    case DType::kBF16:
      return kernels::ElemType::kBF16;
    case DType::kF32:
      return kernels::ElemType::kF32;
  }
  return kernels::ElemType::kF32;
}

Precision ToPrecision(kernels::QuantType type) {
  switch (type) {
    case kernels::QuantType::kInt8:
      return Precision::kInt8;
    case kernels::QuantType::kInt4:
      return Precision::kInt4;
    case kernels::QuantType::kNF4:
      return Precision::kNF4;
  }
  return Precision::kLayout;
}

BlockFormat::BlockFormat(const Layout& layout, std::optional<kernels::QuantType> quant)
    : B_(layout.block_tokens),
      D_(layout.head_dim),
      elem_(ToElemType(layout.dtype)),
      row_bytes_(layout.row_bytes()),
      quant_(quant),
      geometry_{quant.value_or(kernels::QuantType::kInt8), layout.block_tokens, layout.head_dim} {}

Precision BlockFormat::quant_precision() const {
  return quant_ ? ToPrecision(*quant_) : Precision::kLayout;
}

uint64_t BlockFormat::block_bytes(Precision p) const {
  return p == Precision::kLayout ? kernels::LayoutBlock{B_, row_bytes_}.bytes()
                                 : geometry_.block_bytes();
}

int BlockFormat::SlotRanges(Precision p, uint64_t block_offset, uint32_t slot,
                            ByteRange out[4]) const {
  if (p == Precision::kLayout) {
    const kernels::LayoutBlock plane{B_, row_bytes_};
    out[0] = {block_offset + plane.k_offset(slot), row_bytes_};
    out[1] = {block_offset + plane.v_offset(slot), row_bytes_};
    return 2;
  }
  const uint64_t row = geometry_.code_row_bytes();
  out[0] = {block_offset + slot * row, row};
  out[1] = {block_offset + geometry_.v_codes_offset() + slot * row, row};
  if (p != Precision::kNF4) return 2;
  const uint64_t scales = 4ull * geometry_.groups();
  out[2] = {block_offset + geometry_.k_scales_offset() + slot * scales, scales};
  out[3] = {block_offset + geometry_.v_scales_offset() + slot * scales, scales};
  return 4;
}

uint64_t BlockFormat::KvBytes(Precision p, uint32_t count) const {
  if (p == Precision::kLayout) return 2 * uint64_t{count} * row_bytes_;
  return count * geometry_.slot_bytes() + geometry_.block_scale_bytes();
}

uint64_t BlockFormat::KvBytes(uint64_t layout_slots, uint64_t quantized_slots,
                              uint64_t quantized_blocks) const {
  return 2 * layout_slots * row_bytes_ + quantized_slots * geometry_.slot_bytes() +
         quantized_blocks * geometry_.block_scale_bytes();
}

}  // namespace kvmem::engine
