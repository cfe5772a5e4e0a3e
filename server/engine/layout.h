#pragma once
// Layout: the shape of one model's cache, and the sizes derived from it.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvmem::engine {

enum class DType { kF16, kBF16, kF32 };

inline uint32_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
      return 4;
  }
  return 0;
}
absl::string_view DTypeName(DType dtype);

// Limits on layouts; generous for any model shipped today, tight enough that size
// arithmetic cannot overflow.
inline constexpr uint32_t kMaxLayers = 1024;
inline constexpr uint32_t kMaxKvHeads = 1024;
inline constexpr uint32_t kMaxHeadDim = 4096;
inline constexpr uint32_t kMaxBlockTokens = 4096;
inline constexpr uint32_t kMaxVocab = 1u << 24;
// Streams (layers x kv_heads) of one sequence: each costs host metadata even when empty,
// so the product is bounded, not only each factor (the largest models have ~1,000).
inline constexpr uint32_t kMaxStreams = 1u << 14;

struct Layout {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kF16;
  uint32_t block_tokens = 0;
  uint32_t vocab_size = 0;

  uint32_t num_streams() const { return num_layers * num_kv_heads; }
  // Bytes of one token's K (or V) row in one stream.
  uint64_t row_bytes() const { return uint64_t{head_dim} * DTypeBytes(dtype); }
  // Bytes of one layout-precision block: K [B][D] then V [B][D].
  uint64_t block_bytes() const { return 2 * uint64_t{block_tokens} * row_bytes(); }
  // Bytes of one of K or V for n tokens over every stream: [L][H][n][D].
  uint64_t payload_bytes(uint64_t n) const { return uint64_t{num_streams()} * n * row_bytes(); }
};

// Checks every field against its limit; the block must fit one pool page. Messages name
// "layout.<field>".
[[nodiscard]] absl::Status ValidateLayout(const Layout& layout, uint64_t page_bytes);

}  // namespace kvmem::engine
