#include "server/prefix/prefix_index.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace kvmem::prefix {

PrefixIndex::~PrefixIndex() {
  kvmem::MutexLock lock(&mu_);
  for (const auto& [key, entry] : entries_) pool_->Unref(entry.blocks);
}

std::vector<std::pair<std::string, std::vector<BlockHash>>> PrefixIndex::Blocks() const {
  // A namespace copied once, its blocks' hashes after it (32 bytes each).
  std::vector<std::pair<std::string, std::vector<BlockHash>>> out;
  absl::flat_hash_map<absl::string_view, size_t> at;
  kvmem::MutexLock lock(&mu_);
  for (const auto& [key, entry] : entries_) {
    if (entry.payload != nullptr) continue;  // a document
    const absl::string_view ns(key.data(), key.size() - sizeof(BlockHash));
    auto [it, added] = at.try_emplace(ns, out.size());
    if (added) out.emplace_back(std::string(ns), std::vector<BlockHash>());
    BlockHash& hash = out[it->second].second.emplace_back();
    std::memcpy(hash.data(), key.data() + ns.size(), hash.size());
  }
  return out;
}

std::string PrefixIndex::Key(absl::string_view ns, const BlockHash& hash) {
  // The hash has a fixed length, so namespace + hash is unambiguous.
  std::string key(ns);
  key.append(reinterpret_cast<const char*>(hash.data()), hash.size());
  return key;
}

uint64_t PrefixIndex::EntryHostBytes(size_t ns_bytes, size_t streams) {
  // The node (key, entry), the key's and the parent key's text, the block list.
  return sizeof(std::string) + sizeof(Entry) + 2 * (ns_bytes + sizeof(BlockHash)) +
         streams * (sizeof(store::BlockId) + 16) + 4 * sizeof(void*);
}

void PrefixIndex::LinkNewest(Entry* e) {
  e->newer = nullptr;
  e->older = newest_leaf_;
  if (newest_leaf_ != nullptr) newest_leaf_->newer = e;
  newest_leaf_ = e;
  if (oldest_leaf_ == nullptr) oldest_leaf_ = e;
  e->listed = true;
}

void PrefixIndex::LinkAfter(Entry* e, Entry* older) {
  // Between `older` and the entry newer than it (the oldest leaf when `older` is null).
  Entry* newer = older == nullptr ? oldest_leaf_ : older->newer;
  e->older = older;
  e->newer = newer;
  (older != nullptr ? older->newer : oldest_leaf_) = e;
  (newer != nullptr ? newer->older : newest_leaf_) = e;
  e->listed = true;
}

void PrefixIndex::Unlink(Entry* e) {
  if (!e->listed) return;
  (e->older != nullptr ? e->older->newer : oldest_leaf_) = e->newer;
  (e->newer != nullptr ? e->newer->older : newest_leaf_) = e->older;
  e->newer = e->older = nullptr;
  e->listed = false;
}

bool PrefixIndex::OnlyIndexed(const Entry& e) const {
  for (store::BlockId id : e.blocks) {
    auto it = index_refs_.find(id);
    if (it == index_refs_.end() || pool_->refs(id) != it->second) return false;
  }
  return true;
}

void PrefixIndex::AddIndexRefs(const std::vector<store::BlockId>& ids) {
  for (store::BlockId id : ids) ++index_refs_[id];  // room reserved by the caller
}

void PrefixIndex::Touch(Entry* e) {
  if (!e->listed) return;  // not a leaf: its children go first anyway
  Unlink(e);
  LinkNewest(e);
}

bool PrefixIndex::Contains(absl::string_view ns, const BlockHash& hash) const {
  const std::string key = Key(ns, hash);
  kvmem::MutexLock lock(&mu_);
  return entries_.contains(key);
}

size_t PrefixIndex::MatchLocked(std::string& key, absl::Span<const BlockHash> hashes) {
  ++queries_;
  const size_t ns_bytes = key.size() - sizeof(BlockHash);
  size_t n = 0;
  for (; n < hashes.size(); ++n) {
    key.replace(ns_bytes, sizeof(BlockHash), reinterpret_cast<const char*>(hashes[n].data()),
                sizeof(BlockHash));
    if (!entries_.contains(key)) break;
  }
  if (n > 0) ++hits_;
  return n;
}

size_t PrefixIndex::Match(absl::string_view ns, absl::Span<const BlockHash> hashes) {
  std::string key = Key(ns, BlockHash{});
  kvmem::MutexLock lock(&mu_);
  return MatchLocked(key, hashes);
}

std::vector<std::vector<store::BlockId>> PrefixIndex::Map(absl::string_view ns,
                                                          absl::Span<const BlockHash> hashes,
                                                          size_t at_most, uint32_t block_tokens) {
  std::string key = Key(ns, BlockHash{});
  const size_t ns_bytes = ns.size();
  kvmem::MutexLock lock(&mu_);
  const size_t n = std::min(MatchLocked(key, hashes), at_most);
  // Everything that allocates first; then the references and the touches.
  std::vector<Entry*> found(n);
  std::vector<std::vector<store::BlockId>> mapped(n);
  for (size_t i = 0; i < n; ++i) {
    key.replace(ns_bytes, sizeof(BlockHash), reinterpret_cast<const char*>(hashes[i].data()),
                sizeof(BlockHash));
    found[i] = &entries_.find(key)->second;
    mapped[i] = found[i]->blocks;
  }
  for (size_t i = n; i-- > 0;) Touch(found[i]);
  for (const auto& blocks : mapped) pool_->Ref(blocks);
  reused_tokens_ += uint64_t{n} * block_tokens;
  return mapped;
}

bool PrefixIndex::Publish(absl::string_view ns, const BlockHash* parent, const BlockHash& hash,
                          absl::Span<const store::BlockId> blocks, absl::Span<const int32_t> tokens,
                          const std::string* salt) {
  std::string key = Key(ns, hash);
  std::string parent_key = parent == nullptr ? std::string() : Key(ns, *parent);
  std::vector<store::BlockId> ids(blocks.begin(), blocks.end());
  kvmem::MutexLock lock(&mu_);
  if (auto it = entries_.find(key); it != entries_.end()) {
    Touch(&it->second);
    return false;
  }
  Entry* p = nullptr;
  if (!parent_key.empty()) {
    auto it = entries_.find(parent_key);
    if (it != entries_.end()) {
      p = &it->second;
    } else {
      parent_key.clear();  // not reachable through its parent now; a leaf of its own
    }
  }
  // The steps that can throw come first; nothing after them can.
  index_refs_.reserve(index_refs_.size() + ids.size());
  auto [it, added] = entries_.try_emplace(std::move(key));
  Entry& e = it->second;
  e.key = &it->first;
  e.blocks = std::move(ids);
  e.parent_key = std::move(parent_key);
  LinkNewest(&e);
  if (p != nullptr && p->children++ == 0) Unlink(p);  // no longer a leaf
  AddIndexRefs(e.blocks);
  pool_->Ref(e.blocks);
  indexed_blocks_ += e.blocks.size();
  host_bytes_ += EntryHostBytes(ns.size(), e.blocks.size());
  // Under the lock: listeners hear of changes in the order they happen.
  if (events_ != nullptr && !tokens.empty()) events_->Stored({ns, parent, &hash, tokens, salt});
  return added;
}

bool PrefixIndex::PublishDocument(absl::string_view ns, const BlockHash& key,
                                  std::vector<store::BlockId> blocks,
                                  std::shared_ptr<const EntryPayload> payload) {
  // A separate key space: a document key never equals a block's.
  std::string k = absl::StrCat("document ", Key(ns, key));
  const uint64_t bytes = EntryHostBytes(k.size(), blocks.size()) + payload->host_bytes();
  kvmem::MutexLock lock(&mu_);
  if (auto it = entries_.find(k); it != entries_.end()) {
    Touch(&it->second);
    return false;
  }
  index_refs_.reserve(index_refs_.size() + blocks.size());
  auto [it, added] = entries_.try_emplace(std::move(k));
  Entry& e = it->second;
  e.key = &it->first;
  e.blocks = std::move(blocks);
  e.payload = std::move(payload);
  LinkNewest(&e);
  AddIndexRefs(e.blocks);
  pool_->Ref(e.blocks);
  indexed_blocks_ += e.blocks.size();
  host_bytes_ += bytes;
  return added;
}

PrefixIndex::MappedDocument PrefixIndex::MapDocument(absl::string_view ns, const BlockHash& key,
                                                     uint64_t tokens) {
  const std::string k = absl::StrCat("document ", Key(ns, key));
  kvmem::MutexLock lock(&mu_);
  ++queries_;
  auto it = entries_.find(k);
  if (it == entries_.end()) return {};
  MappedDocument mapped{it->second.payload, it->second.blocks};  // copied before any change
  ++hits_;
  Touch(&it->second);
  pool_->Ref(mapped.blocks);
  reused_tokens_ += tokens;
  return mapped;
}

bool PrefixIndex::ContainsDocument(absl::string_view ns, const BlockHash& key) const {
  const std::string k = absl::StrCat("document ", Key(ns, key));
  kvmem::MutexLock lock(&mu_);
  return entries_.contains(k);
}

uint64_t PrefixIndex::Reclaim(uint64_t bytes, store::TenantId tenant) {
  kvmem::MutexLock lock(&mu_);
  // Progress: free pages of the shared part (the whole pool without arenas), or (for a
  // tenant) what is charged to it.
  auto measure = [&] {
    return tenant == 0 ? pool_->region_free_bytes(0) : pool_->tenant_bytes(tenant);
  };
  const uint64_t before = measure();
  auto freed = [&] {
    const uint64_t now = measure();
    if (tenant == 0) return now > before ? now - before : 0;
    return before > now ? before - now : 0;
  };
  const bool arenas = pool_->arenas() > 0;
  auto charged_to_tenant = [&](const Entry& x) {
    for (store::BlockId id : x.blocks) {
      if (tenant != 0 ? pool_->block_tenant(id) != tenant : pool_->block_region(id) != 0) {
        return false;
      }
    }
    return true;
  };
  uint64_t dropped = 0;
  Entry* e = oldest_leaf_;
  while (e != nullptr && freed() < bytes) {
    Entry* next = e->newer;
    if (!OnlyIndexed(*e) || ((tenant != 0 || arenas) && !charged_to_tenant(*e))) {
      e = next;
      continue;
    }
    Entry* older = e->older;
    Unlink(e);
    const auto self = entries_.find(*e->key);  // no key copy
    if (!e->parent_key.empty()) {
      if (auto p = entries_.find(e->parent_key); p != entries_.end()) {
        // A parent whose last child went is a leaf now, and the next one to look at.
        if (--p->second.children == 0) {
          LinkAfter(&p->second, older);
          next = &p->second;
        }
      }
    }
    std::vector<store::BlockId> ids = std::move(e->blocks);
    const size_t ns_bytes = self->first.size() - sizeof(BlockHash);
    host_bytes_ -= EntryHostBytes(e->payload ? self->first.size() : ns_bytes, ids.size()) +
                   (e->payload ? e->payload->host_bytes() : 0);
    indexed_blocks_ -= ids.size();
    for (store::BlockId id : ids) {
      auto r = index_refs_.find(id);
      if (--r->second == 0) index_refs_.erase(r);
    }
    if (events_ != nullptr && e->payload == nullptr) {
      BlockHash hash;
      std::memcpy(hash.data(), self->first.data() + ns_bytes, hash.size());
      events_->Removed(absl::string_view(self->first).substr(0, ns_bytes), hash);
    }
    entries_.erase(self);
    for (store::BlockId id : ids) dropped += pool_->block_bytes(id);
    pool_->Unref(ids);
    e = next;
  }
  reclaimed_bytes_ += dropped;
  return dropped;
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
  s.host_bytes = host_bytes();
  for (const auto& [id, n] : index_refs_) {
    if (pool_->refs(id) != n) continue;
    ++s.cached_blocks;
    s.cached_bytes += pool_->block_bytes(id);
  }
  return s;
}

}  // namespace kvmem::prefix
