#pragma once
// IndexEvents: what the prefix index tells a listener about its prompt blocks, in the order
// the index changes (kvmemd's KV events for cache-aware routers: server/service/kv_events.h).
// Called under the index's lock, past the point where the index's change can fail: an
// implementation only queues (never blocks, never throws, never calls back into the index). Shared
// compressed documents are kvmem's own and not announced.
#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "server/prefix/prefix_hash.h"

namespace kvmem::prefix {

// A block published for the first time: its tokens, and what its hash covered besides
// them (the chain's extra keys: the cache salt of the chain's first block, else none).
struct StoredBlock {
  const BlockHash* parent = nullptr;  // null: the chain's first block
  const BlockHash* hash = nullptr;
  absl::Span<const int32_t> tokens;
  const std::string* salt = nullptr;  // null: no extra keys
};

class IndexEvents {
 public:
  virtual ~IndexEvents() = default;
  virtual void Stored(const StoredBlock& block) noexcept = 0;
  // The block's entry left the index (reclaimed).
  virtual void Removed(const BlockHash& hash) noexcept = 0;
};

}  // namespace kvmem::prefix
