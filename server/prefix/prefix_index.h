#pragma once
// PrefixIndex: published prompt blocks, by namespace and block hash (prefix_hash.h).
//
// An entry is one block-sized token range of a published prompt: the pool block holding it
// in every stream of the layout. The index holds one pool reference on each of those blocks,
// so a published block outlives the sequence that published it; sequences that map an
// entry add their own references (under the index lock, so no entry a sequence is mapping
// can be reclaimed meanwhile). Blocks only the index holds (pool refs == 1) are the cache:
// reclaimed least recently used first, leaves of a chain before their parents (a chain is
// only ever matched from its first block), when an allocation finds the pool full.
//
// Published blocks are immutable: every holder has refs > 1 on them, so the stream planner
// copies before it edits (copy-on-write); nobody can take a new reference on a block only
// the index holds except through the index.
//
// Lock order: Sequence::mu -> PrefixIndex::mu_ -> BlockPool's mutex. Thread-safe.
#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/prefix/prefix_hash.h"
#include "server/store/block_pool.h"

namespace kvmem::prefix {

struct PrefixStats {
  uint64_t queries = 0;          // lookups and creations that named a prompt
  uint64_t hits = 0;             // of those, the ones that matched at least one block
  uint64_t reused_tokens = 0;    // tokens mapped into new sequences
  uint64_t entries = 0;          // published block ranges
  uint64_t cached_blocks = 0;    // pool blocks only the index holds (reclaimable)
  uint64_t indexed_blocks = 0;   // pool blocks the index holds a reference on
  uint64_t reclaimed_bytes = 0;  // pool bytes given back by reclaiming (total)
  uint64_t host_bytes = 0;       // the index's own memory
};

class PrefixIndex {
 public:
  explicit PrefixIndex(store::BlockPool* pool) : pool_(pool) {}
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;
  ~PrefixIndex();

  // How many of `hashes` (a chain, in order) are published in `ns`, from the first one.
  // Pins nothing. Counts a query (and a hit).
  size_t Match(absl::string_view ns, absl::Span<const BlockHash> hashes);

  // Match, then references (pool Ref) the blocks of the first `at_most` matched entries
  // for the caller, and returns them: [entry][stream]. Counts a query, a hit and the
  // tokens reused (`block_tokens` per entry).
  std::vector<std::vector<store::BlockId>> Map(absl::string_view ns,
                                               absl::Span<const BlockHash> hashes, size_t at_most,
                                               uint32_t block_tokens);

  // Publishes entry `hash` (whose parent in the chain is `parent`, the root hash for block
  // 0) with the given blocks (one per stream), taking a reference on each; an entry already
  // published under that hash is kept as it is (it holds the same tokens) and only touched.
  // Returns whether it was added.
  bool Publish(absl::string_view ns, const BlockHash& parent, const BlockHash& hash,
               absl::Span<const store::BlockId> blocks);

  // Drops entries whose blocks only the index holds, least recently used leaf first, until
  // `bytes` pool bytes were freed or nothing more can be; returns the bytes freed.
  uint64_t Reclaim(uint64_t bytes);

  PrefixStats stats() const;

 private:
  struct Key {
    std::string ns;
    BlockHash hash;
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.ns,
                        absl::string_view(reinterpret_cast<const char*>(k.hash.data()), 32));
    }
    bool operator==(const Key& o) const { return hash == o.hash && ns == o.ns; }
  };
  struct Entry {
    std::vector<store::BlockId> blocks;
    BlockHash parent;
    uint32_t children = 0;         // entries whose parent this is
    std::list<Key>::iterator lru;  // in lru_
  };

  uint64_t EntryHostBytes(const Key& key, const Entry& e) const;
  void Touch(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t MatchLocked(absl::string_view ns, absl::Span<const BlockHash> hashes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  store::BlockPool* const pool_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<Key> lru_ ABSL_GUARDED_BY(mu_);  // front: most recently used
  uint64_t queries_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t indexed_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reclaimed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t host_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::prefix
