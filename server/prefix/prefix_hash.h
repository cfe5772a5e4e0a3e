#pragma once
// Block hashes of a prompt's prefix, compatible with vLLM's `sha256_cbor` prefix caching, so
// that a vLLM deployment and kvmemd name the same blocks:
//   H_root = sha256(cbor(seed))
//   H_i    = sha256(cbor([H_{i-1} as a 32-byte byte string, [token ids of block i], extra]))
// where cbor is canonical CBOR (RFC 8949 4.2.1: shortest integer forms, definite lengths),
// block i is tokens [i * B, (i + 1) * B) (full blocks only), and `extra` is null or an array
// of text strings: the cache salt, among block 0's extra keys only, so that it namespaces
// the whole chain. Model, layout and precision are not hashed: they name the namespace the
// hashes live in (PrefixIndex).
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvmem::prefix {

using BlockHash = std::array<uint8_t, 32>;

// sha256(cbor(seed)): the parent of block 0. vLLM takes the seed from PYTHONHASHSEED (and
// a random one without it, which no other process can match).
absl::StatusOr<BlockHash> RootHash(absl::string_view seed);

// sha256(cbor([parent, tokens, extra])); `extra` absent: null.
absl::StatusOr<BlockHash> ChainHash(const BlockHash& parent, absl::Span<const int32_t> tokens,
                                    const std::optional<std::vector<std::string>>& extra);

// The hashes of every full block of `tokens`, in order (tokens past the last full block
// have none). `salt`: block 0's extra key when not empty.
absl::StatusOr<std::vector<BlockHash>> PrefixHashes(const BlockHash& root,
                                                    absl::Span<const int32_t> tokens,
                                                    uint32_t block_tokens, absl::string_view salt);

std::string ToHex(const BlockHash& hash);

}  // namespace kvmem::prefix
