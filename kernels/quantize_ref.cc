#include <algorithm>
#include <cmath>

#include "kernels/quantize.h"

namespace kvmem::kernels {
namespace {

uint8_t NearestNf4(float v) {
  // kNf4Codes is sorted: the nearest code is one of the two around v's insertion point.
  uint8_t best = 0;
  float best_err = std::fabs(v - kNf4Codes[0]);
  for (uint8_t i = 1; i < 16; ++i) {
    const float err = std::fabs(v - kNf4Codes[i]);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

void PutNibble(uint8_t* row, uint32_t c, uint8_t nibble) {
  uint8_t& byte = row[c / 2];
  byte = (c % 2 == 0) ? static_cast<uint8_t>((byte & 0xf0) | nibble)
                      : static_cast<uint8_t>((byte & 0x0f) | (nibble << 4));
}

uint8_t GetNibble(const uint8_t* row, uint32_t c) {
  return (c % 2 == 0) ? (row[c / 2] & 0x0f) : (row[c / 2] >> 4);
}

}  // namespace

void QuantizePlaneRef(const void* src, ElemType elem, const QuantGeometry& g, uint32_t start,
                      uint32_t count, uint8_t* codes, float* scales) {
  const uint32_t D = g.head_dim;
  const uint32_t row_bytes = g.code_row_bytes();
  if (g.type == QuantType::kNF4) {
    const uint32_t G = g.groups();
    for (uint32_t t = start; t < start + count; ++t) {
      uint8_t* row = codes + uint64_t{t} * row_bytes;
      std::fill(row, row + row_bytes, 0);
      for (uint32_t grp = 0; grp < G; ++grp) {
        const uint32_t c0 = grp * 64, c1 = std::min(D, c0 + 64);
        float absmax = 0;
        for (uint32_t c = c0; c < c1; ++c) {
          absmax = std::max(absmax, ScaleCandidate(LoadElem(src, uint64_t{t} * D + c, elem)));
        }
        scales[uint64_t{t} * G + grp] = absmax;
        for (uint32_t c = c0; c < c1; ++c) {
          const float x = LoadElem(src, uint64_t{t} * D + c, elem);
          PutNibble(row, c, NearestNf4(Nf4Ratio(x, absmax)));  // a ratio of 0 is code 7, 0.0
        }
      }
    }
    return;
  }
  const float qmax = g.type == QuantType::kInt8 ? 127.0f : 7.0f;
  for (uint32_t c = 0; c < D; ++c) {
    float absmax = 0;
    for (uint32_t t = start; t < start + count; ++t) {
      absmax = std::max(absmax, ScaleCandidate(LoadElem(src, uint64_t{t} * D + c, elem)));
    }
    scales[c] = absmax / qmax;
  }
  for (uint32_t t = start; t < start + count; ++t) {
    uint8_t* row = codes + uint64_t{t} * row_bytes;
    if (g.type == QuantType::kInt4) std::fill(row, row + row_bytes, 0);
    for (uint32_t c = 0; c < D; ++c) {
      const float x = LoadElem(src, uint64_t{t} * D + c, elem);
      const float q = SymmetricCode(x, scales[c], qmax);
      if (g.type == QuantType::kInt8) {
        row[c] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        PutNibble(row, c, static_cast<uint8_t>(static_cast<int>(q) + 8));
      }
    }
  }
}

void DequantizePlaneRef(const uint8_t* codes, const float* scales, const QuantGeometry& g,
                        uint32_t start, uint32_t count, ElemType elem, void* dst) {
  const uint32_t D = g.head_dim;
  const uint32_t row_bytes = g.code_row_bytes();
  for (uint32_t t = start; t < start + count; ++t) {
    const uint8_t* row = codes + uint64_t{t} * row_bytes;
    const uint64_t out = uint64_t{t - start} * D;
    for (uint32_t c = 0; c < D; ++c) {
      float x = 0;
      switch (g.type) {
        case QuantType::kInt8:
          x = static_cast<float>(static_cast<int8_t>(row[c])) * scales[c];
          break;
        case QuantType::kInt4:
          x = static_cast<float>(static_cast<int>(GetNibble(row, c)) - 8) * scales[c];
          break;
        case QuantType::kNF4:
          x = kNf4Codes[GetNibble(row, c)] * scales[uint64_t{t} * g.groups() + c / 64];
          break;
      }
      StoreElem(dst, out + c, elem, x);
    }
  }
}

void QuantizeBlockRef(const uint8_t* src, ElemType elem, const QuantGeometry& g, uint32_t start,
                      uint32_t count, uint8_t* dst) {
  const uint64_t plane = uint64_t{g.block_tokens} * g.head_dim * ElemBytes(elem);
  QuantizePlaneRef(src, elem, g, start, count, dst,
                   reinterpret_cast<float*>(dst + g.k_scales_offset()));
  QuantizePlaneRef(src + plane, elem, g, start, count, dst + g.v_codes_offset(),
                   reinterpret_cast<float*>(dst + g.v_scales_offset()));
}

void DequantizeBlockRef(const uint8_t* block, const QuantGeometry& g, uint32_t start,
                        uint32_t count, ElemType elem, void* k_dst, void* v_dst) {
  DequantizePlaneRef(block, reinterpret_cast<const float*>(block + g.k_scales_offset()), g, start,
                     count, elem, k_dst);
  DequantizePlaneRef(block + g.v_codes_offset(),
                     reinterpret_cast<const float*>(block + g.v_scales_offset()), g, start, count,
                     elem, v_dst);
}

}  // namespace kvmem::kernels
