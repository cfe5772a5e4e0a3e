#include "server/prefix/prefix_index.h"

#include "server/common/mutex.h"

namespace kvmem::prefix {

PrefixIndex::~PrefixIndex() {
  kvmem::MutexLock lock(&mu_);
  for (const auto& [key, entry] : entries_) pool_->Unref(entry.blocks);
}

uint64_t PrefixIndex::EntryHostBytes(const Key& key, const Entry& e) const {
  // The map slot, the LRU node (a key copy) and the block list; the namespace twice.
  return 2 * (sizeof(Key) + key.ns.capacity()) + sizeof(Entry) + 2 * sizeof(void*) +
         e.blocks.capacity() * sizeof(store::BlockId);
}

void PrefixIndex::Touch(Entry& e) { lru_.splice(lru_.begin(), lru_, e.lru); }

size_t PrefixIndex::MatchLocked(absl::string_view ns, absl::Span<const BlockHash> hashes) {
  ++queries_;
  Key key{std::string(ns), {}};
  size_t n = 0;
  for (; n < hashes.size(); ++n) {
    key.hash = hashes[n];
    if (!entries_.contains(key)) break;
  }
  if (n > 0) ++hits_;
  return n;
}

size_t PrefixIndex::Match(absl::string_view ns, absl::Span<const BlockHash> hashes) {
  kvmem::MutexLock lock(&mu_);
  return MatchLocked(ns, hashes);
}

std::vector<std::vector<store::BlockId>> PrefixIndex::Map(absl::string_view ns,
                                                          absl::Span<const BlockHash> hashes,
                                                          size_t at_most, uint32_t block_tokens) {
  kvmem::MutexLock lock(&mu_);
  const size_t n = std::min(MatchLocked(ns, hashes), at_most);
  std::vector<std::vector<store::BlockId>> mapped(n);
  Key key{std::string(ns), {}};
  // Touched from the last entry to the first, so that the chain's head is the most recent
  // and a chain is reclaimed from its end.
  for (size_t i = n; i-- > 0;) {
    key.hash = hashes[i];
    Entry& e = entries_.find(key)->second;
    mapped[i] = e.blocks;
    Touch(e);
  }
  for (const auto& blocks : mapped) pool_->Ref(blocks);
  reused_tokens_ += uint64_t{n} * block_tokens;
  return mapped;
}

bool PrefixIndex::Publish(absl::string_view ns, const BlockHash& parent, const BlockHash& hash,
                          absl::Span<const store::BlockId> blocks) {
  kvmem::MutexLock lock(&mu_);
  Key key{std::string(ns), hash};
  if (auto it = entries_.find(key); it != entries_.end()) {
    Touch(it->second);
    return false;
  }
  Entry entry;
  entry.blocks.assign(blocks.begin(), blocks.end());
  entry.parent = parent;
  lru_.push_front(key);
  entry.lru = lru_.begin();
  if (auto p = entries_.find(Key{key.ns, parent}); p != entries_.end()) ++p->second.children;
  host_bytes_ += EntryHostBytes(key, entry);
  pool_->Ref(entry.blocks);
  indexed_blocks_ += entry.blocks.size();
  entries_.emplace(std::move(key), std::move(entry));
  return true;
}

uint64_t PrefixIndex::Reclaim(uint64_t bytes) {
  kvmem::MutexLock lock(&mu_);
  uint64_t freed = 0;
  // Oldest first; a pass drops every reclaimable leaf it meets, and a parent whose last
  // child went becomes a leaf for the next pass.
  bool dropped = true;
  while (freed < bytes && dropped) {
    dropped = false;
    for (auto it = lru_.end(); it != lru_.begin() && freed < bytes;) {
      --it;
      auto found = entries_.find(*it);
      Entry& e = found->second;
      if (e.children > 0) continue;
      bool only_ours = true;
      for (store::BlockId id : e.blocks) only_ours = only_ours && pool_->refs(id) == 1;
      if (!only_ours) continue;
      for (store::BlockId id : e.blocks) freed += pool_->block_bytes(id);
      pool_->Unref(e.blocks);
      indexed_blocks_ -= e.blocks.size();
      host_bytes_ -= EntryHostBytes(found->first, e);
      if (auto p = entries_.find(Key{found->first.ns, e.parent}); p != entries_.end()) {
        --p->second.children;
      }
      it = lru_.erase(it);
      entries_.erase(found);
      dropped = true;
    }
  }
  reclaimed_bytes_ += freed;
  return freed;
}

PrefixStats PrefixIndex::stats() const {
  kvmem::MutexLock lock(&mu_);
  PrefixStats s;
  s.queries = queries_;
  s.hits = hits_;
  s.reused_tokens = reused_tokens_;
  s.entries = entries_.size();
  s.indexed_blocks = indexed_blocks_;
  s.reclaimed_bytes = reclaimed_bytes_;
  s.host_bytes = host_bytes_;
  for (const auto& [key, e] : entries_) {
    for (store::BlockId id : e.blocks) s.cached_blocks += pool_->refs(id) == 1 ? 1 : 0;
  }
  return s;
}

}  // namespace kvmem::prefix
