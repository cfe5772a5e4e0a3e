#pragma once
// IndexEvents: what the prefix index tells a listener about its prompt blocks, in the order
// the index changes (kvmemd's KV events for cache-aware routers: server/service/kv_events.h).
// Called under the index's lock, past the point where the index's change can fail: an
// implementation only queues (never blocks, never throws, never calls back into the index). Shared
// compressed documents are kvmem's own and not announced.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/prefix/prefix_hash.h"

namespace kvmem::prefix {

// A block published for the first time: its tokens, and what its hash covered besides
// them (the chain's extra keys: the cache salt of the chain's first block, else none).
struct StoredBlock {
  absl::string_view ns;  // the index's namespace: model, layout, precision (PrefixPublisher)
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
  virtual void Removed(absl::string_view ns, const BlockHash& hash) noexcept = 0;
};

// Tells several listeners, in the order they were added.
class IndexEventsFanout final : public IndexEvents {
 public:
  void Add(IndexEvents* listener) { listeners_.push_back(listener); }
  bool empty() const { return listeners_.empty(); }
  void Stored(const StoredBlock& block) noexcept override {
    for (IndexEvents* l : listeners_) l->Stored(block);
  }
  void Removed(absl::string_view ns, const BlockHash& hash) noexcept override {
    for (IndexEvents* l : listeners_) l->Removed(ns, hash);
  }

 private:
  std::vector<IndexEvents*> listeners_;
};

}  // namespace kvmem::prefix
