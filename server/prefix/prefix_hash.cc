#include "server/prefix/prefix_hash.h"

#include <cbor.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <memory>

#include "absl/strings/escaping.h"

namespace kvmem::prefix {
namespace {

// A libcbor item owned here (its reference dropped on scope exit).
struct ItemDeleter {
  void operator()(cbor_item_t* item) const { cbor_decref(&item); }
};
using Item = std::unique_ptr<cbor_item_t, ItemDeleter>;

absl::Status OutOfMemory() {
  return absl::ResourceExhaustedError("prefix hash: out of host memory (CBOR encoding)");
}

// Canonical integers: libcbor writes the width it is given, so the width follows the value.
cbor_item_t* BuildInt(int64_t v) {
  const uint64_t magnitude = v >= 0 ? static_cast<uint64_t>(v) : static_cast<uint64_t>(-(v + 1));
  cbor_item_t* item;
  if (magnitude <= 0xff) {
    item = v >= 0 ? cbor_build_uint8(static_cast<uint8_t>(magnitude))
                  : cbor_build_negint8(static_cast<uint8_t>(magnitude));
  } else if (magnitude <= 0xffff) {
    item = v >= 0 ? cbor_build_uint16(static_cast<uint16_t>(magnitude))
                  : cbor_build_negint16(static_cast<uint16_t>(magnitude));
  } else if (magnitude <= 0xffffffffu) {
    item = v >= 0 ? cbor_build_uint32(static_cast<uint32_t>(magnitude))
                  : cbor_build_negint32(static_cast<uint32_t>(magnitude));
  } else {
    item = v >= 0 ? cbor_build_uint64(magnitude) : cbor_build_negint64(magnitude);
  }
  return item;
}

// Pushes an item built for the array (the array takes the only reference).
bool Push(cbor_item_t* array, cbor_item_t* item) {
  if (item == nullptr) return false;
  const bool pushed = cbor_array_push(array, item);
  cbor_decref(&item);
  return pushed;
}

absl::StatusOr<BlockHash> Sha256OfItem(const cbor_item_t* item) {
  unsigned char* buffer = nullptr;
  size_t capacity = 0;
  const size_t length = cbor_serialize_alloc(item, &buffer, &capacity);
  if (length == 0 || buffer == nullptr) {
    std::free(buffer);
    return OutOfMemory();
  }
  BlockHash hash;
  unsigned int out = 0;
  const int ok = EVP_Digest(buffer, length, hash.data(), &out, EVP_sha256(), nullptr);
  std::free(buffer);
  if (ok != 1 || out != hash.size()) return absl::InternalError("prefix hash: SHA-256 failed");
  return hash;
}

}  // namespace

absl::StatusOr<BlockHash> RootHash(absl::string_view seed) {
  Item text(cbor_build_stringn(seed.data(), seed.size()));
  if (text == nullptr) return OutOfMemory();
  return Sha256OfItem(text.get());
}

absl::StatusOr<BlockHash> ChainHash(const BlockHash& parent, absl::Span<const int32_t> tokens,
                                    const std::optional<std::vector<std::string>>& extra) {
  Item root(cbor_new_definite_array(3));
  if (root == nullptr) return OutOfMemory();
  if (!Push(root.get(), cbor_build_bytestring(parent.data(), parent.size()))) return OutOfMemory();
  cbor_item_t* ids = cbor_new_definite_array(tokens.size());
  if (ids == nullptr) return OutOfMemory();
  bool built = true;
  for (int32_t t : tokens) built = built && Push(ids, BuildInt(t));
  if (!Push(root.get(), ids) || !built) return OutOfMemory();
  cbor_item_t* keys = nullptr;
  if (extra) {
    keys = cbor_new_definite_array(extra->size());
    if (keys == nullptr) return OutOfMemory();
    for (const std::string& key : *extra) {
      built = built && Push(keys, cbor_build_stringn(key.data(), key.size()));
    }
  } else {
    keys = cbor_new_null();
  }
  if (!Push(root.get(), keys) || !built) return OutOfMemory();
  return Sha256OfItem(root.get());
}

absl::StatusOr<std::vector<BlockHash>> PrefixHashes(const BlockHash& root,
                                                    absl::Span<const int32_t> tokens,
                                                    uint32_t block_tokens, absl::string_view salt) {
  if (block_tokens == 0) return absl::InvalidArgumentError("block_tokens: must be at least 1");
  std::vector<BlockHash> hashes;
  hashes.reserve(tokens.size() / block_tokens);
  BlockHash parent = root;
  for (size_t i = 0; (i + 1) * block_tokens <= tokens.size(); ++i) {
    std::optional<std::vector<std::string>> extra;
    if (i == 0 && !salt.empty()) extra = std::vector<std::string>{std::string(salt)};
    absl::StatusOr<BlockHash> h =
        ChainHash(parent, tokens.subspan(i * block_tokens, block_tokens), extra);
    if (!h.ok()) return h.status();
    hashes.push_back(*h);
    parent = *h;
  }
  return hashes;
}

std::string ToHex(const BlockHash& hash) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(hash.data()), hash.size()));
}

}  // namespace kvmem::prefix
