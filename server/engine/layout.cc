#include "server/engine/layout.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvmem::engine {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "f32";
  }
  return "?";
}

namespace {
absl::Status CheckRange(const char* field, uint32_t value, uint32_t min, uint32_t max) {
  if (value < min || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout.", field, ": ", value, " is outside [", min, ", ", max, "]"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status ValidateLayout(const Layout& layout, uint64_t page_bytes) {
  if (auto s = CheckRange("num_layers", layout.num_layers, 1, kMaxLayers); !s.ok()) return s;
  if (auto s = CheckRange("num_kv_heads", layout.num_kv_heads, 1, kMaxKvHeads); !s.ok()) return s;
  if (auto s = CheckRange("head_dim", layout.head_dim, 1, kMaxHeadDim); !s.ok()) return s;
  if (auto s = CheckRange("block_tokens", layout.block_tokens, 1, kMaxBlockTokens); !s.ok()) {
    return s;
  }
  if (auto s = CheckRange("vocab_size", layout.vocab_size, 2, kMaxVocab); !s.ok()) return s;
  if (uint64_t{layout.num_layers} * layout.num_kv_heads > kMaxStreams) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: num_layers x num_kv_heads = ", uint64_t{layout.num_layers} * layout.num_kv_heads,
        " streams, over the limit of ", kMaxStreams));
  }
  if (layout.block_bytes() > page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout.block_tokens: a block of ", layout.block_tokens, " tokens x head_dim ",
        layout.head_dim, " x ", DTypeName(layout.dtype), " x 2 (K,V) is ", layout.block_bytes(),
        " bytes, more than the pool page of ", page_bytes, " bytes (--page-bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace kvmem::engine
