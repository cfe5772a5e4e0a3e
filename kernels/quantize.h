#pragma once
// Quantize / dequantize: the contract shared by the C++ reference (quantize_ref.cc, used by
// the CPU backend and the client library) and the CUDA implementation.
//
// A block holds B slots of one stream. Quantized block layout, in bytes:
//   [K codes: B x code_row][V codes: B x code_row][K scales][V scales]
//   int8  code_row = D        (int8, symmetric, -127..127)
//         scales   = [D] f32 per plane: s_c = max over the block's live slots |x[t,c]| / 127
//   int4  code_row = ceil(D/2) (two channels a byte, low nibble = even channel, q + 8)
//         scales   = [D] f32 per plane: s_c = max |x[t,c]| / 7; q in -7..7
//   nf4   code_row = ceil(D/2) (nibble = index into kNf4Codes)
//         scales   = [B][G] f32 per plane, G = ceil(D/64): absmax of each run of 64 values
//                    of one slot (a slot carries its own scales, so moving it is exact)
// Per-channel scales (int8, int4) are computed over the live slots [start, start+count) of
// the block; slots then move only within their block, so codes never re-round.
// x_hat = q * s (int8/int4) or kNf4Codes[q] * s (nf4). Error bound per element:
//   int8 |x - x_hat| <= s_c / 2, int4 <= s_c / 2, nf4 <= s * (largest gap between codes) / 2.
// A channel whose absmax is 0 gets scale 0 and decodes to exactly 0.
// Non-finite inputs (an f16 overflow in the model, say; K/V bytes are not checked on the way
// in): a scale is the absmax of the finite values only, NaN codes as 0 and +-Inf, when the
// scale is above 0, as the largest code of its sign (else 0), so one such element decodes to
// 0 or to about +-absmax instead of turning every other value of its channel into NaN (Inf
// in the absmax would do that). An f32 channel whose absmax is within rounding of FLT_MAX
// can still decode its largest code as +-Inf (q * s rounds up).
#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvmem::kernels {

enum class QuantType : uint8_t { kInt8, kInt4, kNF4 };

// Every quantizer with its name and a one-line description (what GetInfo lists).
struct QuantizerDescription {
  QuantType type;
  const char* name;
  const char* description;
};
inline constexpr QuantizerDescription kQuantizers[] = {
    {QuantType::kInt8, "int8",
     "symmetric int8, per-channel absmax scales over each block (K and V separately)"},
    {QuantType::kInt4, "int4", "symmetric int4 (-7..7), per-channel absmax scales per block"},
    {QuantType::kNF4, "nf4", "NormalFloat4 codes, absmax scale per 64 values of a token"}};

inline constexpr float kNf4Codes[16] = {-1.0f,
                                        -0.6961928009986877f,
                                        -0.5250730514526367f,
                                        -0.39491748809814453f,
                                        -0.28444138169288635f,
                                        -0.18477343022823334f,
                                        -0.09105003625154495f,
                                        0.0f,
                                        0.07958029955625534f,
                                        0.16093020141124725f,
                                        0.24611230194568634f,
                                        0.33791524171829224f,
                                        0.44070982933044434f,
                                        0.5626170039176941f,
                                        0.7229568362236023f,
                                        1.0f};

struct QuantGeometry {
  QuantType type;
  uint32_t block_tokens;  // B
  uint32_t head_dim;      // D

  KVMEM_HD uint32_t code_row_bytes() const {
    return type == QuantType::kInt8 ? head_dim : (head_dim + 1) / 2;
  }
  // nf4 scale groups per slot; per-channel types have none per slot.
  KVMEM_HD uint32_t groups() const { return type == QuantType::kNF4 ? (head_dim + 63) / 64 : 0; }
  // Rounded up to 16 bytes so that the float scales that follow stay aligned.
  KVMEM_HD uint64_t codes_bytes() const {
    return (uint64_t{block_tokens} * code_row_bytes() + 15) / 16 * 16;
  }
  KVMEM_HD uint64_t scale_floats() const {
    return type == QuantType::kNF4 ? uint64_t{block_tokens} * groups() : head_dim;
  }
  KVMEM_HD uint64_t v_codes_offset() const { return codes_bytes(); }
  KVMEM_HD uint64_t k_scales_offset() const { return 2 * codes_bytes(); }
  KVMEM_HD uint64_t v_scales_offset() const { return k_scales_offset() + 4 * scale_floats(); }
  KVMEM_HD uint64_t block_bytes() const { return v_scales_offset() + 4 * scale_floats(); }
  // Bytes one live slot accounts for (codes of K and V, plus nf4's own scales).
  KVMEM_HD uint64_t slot_bytes() const {
    return 2 * (uint64_t{code_row_bytes()} + 4ull * groups());
  }
  // Scale bytes a block carries regardless of its fill (int8/int4 per-channel scales).
  KVMEM_HD uint64_t block_scale_bytes() const {
    return type == QuantType::kNF4 ? 0 : 8ull * head_dim;
  }
};

// The element-wise rules both twins share (the contract above, bit for bit).
KVMEM_HD bool IsNanBits(float x) { return (FloatBits(x) & 0x7fffffffu) > 0x7f800000u; }
// |x| as a candidate for an absmax: 0 for NaN and +-Inf.
KVMEM_HD float ScaleCandidate(float x) {
  return (FloatBits(x) & 0x7f800000u) == 0x7f800000u ? 0.0f : fabsf(x);
}
// The int8/int4 code of x for its channel's scale (qmax 127 or 7): x / scale rounded half
// to even, clamped to [-qmax, qmax]; 0 for NaN and for a zero scale.
KVMEM_HD float SymmetricCode(float x, float scale, float qmax) {
  if (!(scale > 0.0f) || IsNanBits(x)) return 0.0f;
  const float q = rintf(x / scale);
  return q < -qmax ? -qmax : (q > qmax ? qmax : q);
}
// What nf4 rounds to the nearest code: x over its group's absmax, clamped to [-1, 1]; 0 for
// NaN and for a zero absmax.
KVMEM_HD float Nf4Ratio(float x, float absmax) {
  if (!(absmax > 0.0f) || IsNanBits(x)) return 0.0f;
  const float r = x / absmax;
  return r < -1.0f ? -1.0f : (r > 1.0f ? 1.0f : r);
}

// Quantizes one plane (K or V) of a layout-precision block: rows [start, start+count) of
// `src` ([B][D] in `elem`) into `codes` ([B][code_row]) and `scales` (see above).
void QuantizePlaneRef(const void* src, ElemType elem, const QuantGeometry& g, uint32_t start,
                      uint32_t count, uint8_t* codes, float* scales);

// Dequantizes rows [start, start+count) of one plane into `dst` ([count][D] in `elem`).
void DequantizePlaneRef(const uint8_t* codes, const float* scales, const QuantGeometry& g,
                        uint32_t start, uint32_t count, ElemType elem, void* dst);

// Whole block, both planes: `src` is a layout block (K [B][D] then V [B][D]).
void QuantizeBlockRef(const uint8_t* src, ElemType elem, const QuantGeometry& g, uint32_t start,
                      uint32_t count, uint8_t* dst);
void DequantizeBlockRef(const uint8_t* block, const QuantGeometry& g, uint32_t start,
                        uint32_t count, ElemType elem, void* k_dst, void* v_dst);

}  // namespace kvmem::kernels
