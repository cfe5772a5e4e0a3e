#pragma once
// PrefixIndex: published prompt blocks, by namespace and block hash (prefix_hash.h).
//
// An entry is one block-sized token range of a published prompt: the pool block holding it
// in every stream of the layout. The index holds one pool reference on each of those blocks,
// so a published block outlives the sequence that published it; sequences that map an
// entry add their own references (under the index lock, so no entry a sequence is mapping
// can be reclaimed meanwhile). Blocks only the index holds (pool refs == 1) are the cache:
// reclaimed when the pool is full or past its high watermark, least recently used first
// and only from a chain's end (a chain is only ever matched from its first block, so a
// parent goes after its children).
//
// Published blocks are immutable: every holder has refs > 1 on them, so the stream planner
// copies before it edits (copy-on-write); nobody can take a new reference on a block only
// the index holds except through the index.
//
// Changes never half-apply: whatever can throw (a key, an entry) is built before the first
// change, and the leaf list is intrusive, so reclaiming allocates nothing.
//
// Lock order: Sequence::mu -> PrefixIndex::mu_ -> BlockPool's mutex. Thread-safe.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/prefix/index_events.h"
#include "server/prefix/prefix_hash.h"
#include "server/store/block_pool.h"

namespace kvmem::prefix {

// What a document entry carries besides its blocks (the engine's frozen copy of a
// compressed sequence's state).
class EntryPayload {
 public:
  virtual ~EntryPayload() = default;
  virtual uint64_t host_bytes() const = 0;
};

struct PrefixStats {
  uint64_t queries = 0;          // lookups and creations that named a prompt
  uint64_t hits = 0;             // of those, the ones that matched at least one block
  uint64_t reused_tokens = 0;    // tokens mapped into new sequences
  uint64_t entries = 0;          // published block ranges
  uint64_t cached_blocks = 0;    // pool blocks only the index holds (reclaimable)
  uint64_t cached_bytes = 0;     // their size-class bytes
  uint64_t indexed_blocks = 0;   // pool blocks the index holds a reference on
  uint64_t reclaimed_bytes = 0;  // pool bytes of the blocks reclaimed (total)
  uint64_t host_bytes = 0;       // the index's own memory
};

class PrefixIndex {
 public:
  explicit PrefixIndex(store::BlockPool* pool) : pool_(pool) {}
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;
  ~PrefixIndex();

  // Whether `hash` is published in `ns` (no counters touched).
  bool Contains(absl::string_view ns, const BlockHash& hash) const;

  // How many of `hashes` (a chain, in order) are published in `ns`, from the first one.
  // Pins nothing. Counts a query (and a hit).
  size_t Match(absl::string_view ns, absl::Span<const BlockHash> hashes);

  // Match, then references (pool Ref) the blocks of the first `at_most` matched entries
  // for the caller, and returns them: [entry][stream]. Counts a query, a hit and the
  // tokens reused (`block_tokens` per entry).
  std::vector<std::vector<store::BlockId>> Map(absl::string_view ns,
                                               absl::Span<const BlockHash> hashes, size_t at_most,
                                               uint32_t block_tokens);

  // Publishes entry `hash` (whose parent in the chain is `parent`: null for block 0) with
  // the given blocks (one per stream), taking a reference on each; an entry already
  // published under that hash is kept as it is (it holds the same tokens) and only touched.
  // Returns whether it was added.
  // With `tokens` (the block's), a new entry is announced to the events listener.
  bool Publish(absl::string_view ns, const BlockHash* parent, const BlockHash& hash,
               absl::Span<const store::BlockId> blocks, absl::Span<const int32_t> tokens = {},
               const std::string* salt = nullptr);
  // Every published block (documents aside) as it stands now, by namespace.
  std::vector<std::pair<std::string, std::vector<BlockHash>>> Blocks() const;
  // Who hears of entries published and reclaimed (null: nobody); set before the index is
  // shared.
  void set_events(IndexEvents* events) { events_ = events; }

  // A shared compressed document: every block its streams hold (`blocks`, each once per
  // reference the payload's tables make) and the payload that describes them, under `key`
  // (a hash of the document's tokens and representation) in `ns`. A document stands alone
  // (no chain). Returns whether it was added (a document already there is kept).
  bool PublishDocument(absl::string_view ns, const BlockHash& key,
                       std::vector<store::BlockId> blocks,
                       std::shared_ptr<const EntryPayload> payload);
  // The document's payload with a reference on each of its blocks taken for the caller
  // (who gives them back through the payload's tables), or null. Counts a query, a hit
  // and `tokens` reused.
  struct MappedDocument {
    std::shared_ptr<const EntryPayload> payload;  // null: not published
    std::vector<store::BlockId> blocks;           // referenced for the caller
  };
  MappedDocument MapDocument(absl::string_view ns, const BlockHash& key, uint64_t tokens);
  bool ContainsDocument(absl::string_view ns, const BlockHash& key) const;

  // Drops entries whose blocks only the index holds, least recently used chain end first,
  // until the pool has `bytes` more bytes of free pages or nothing more can go; returns
  // the pool bytes of the blocks it dropped (0: nothing could go). With a tenant: only
  // entries whose blocks are all charged to it, until its charge fell by `bytes`. Without
  // one, and the pool cut into arenas (store::BlockPool): only entries whose blocks all lie
  // in the shared part, until it has `bytes` more free (an arena's are its tenant's).
  uint64_t Reclaim(uint64_t bytes, store::TenantId tenant = 0);

  // The index's own memory (keys, entries, block lists), read without the lock.
  uint64_t host_bytes() const { return host_bytes_.load(std::memory_order_relaxed); }
  // Host bytes one more entry of `streams` blocks in `ns` takes.
  static uint64_t EntryHostBytes(size_t ns_bytes, size_t streams);

  PrefixStats stats() const;

 private:
  struct Entry {
    std::vector<store::BlockId> blocks;
    std::shared_ptr<const EntryPayload> payload;  // documents only
    const std::string* key = nullptr;             // its own, in the map (node_hash_map: stable)
    std::string parent_key;  // empty: no parent counted (block 0, or its parent was gone)
    uint32_t children = 0;   // entries that counted this one as their parent
    // The leaf list (entries without children: the reclaim candidates), newest first;
    // intrusive, so that moving and unlinking never allocate.
    Entry* newer = nullptr;
    Entry* older = nullptr;
    bool listed = false;
  };
  static std::string Key(absl::string_view ns, const BlockHash& hash);
  // Links `e` as the newest leaf, or right after `older` (null: as the oldest).
  void LinkNewest(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LinkAfter(Entry* e, Entry* older) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unlink(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t MatchLocked(std::string& key, absl::Span<const BlockHash> hashes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  store::BlockPool* const pool_;
  IndexEvents* events_ = nullptr;
  mutable absl::Mutex mu_;
  absl::node_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // key: ns + hash
  // References the index holds per block (entries may share blocks: a document and the
  // prefix blocks it kept): a block is only cached when these are all it has.
  absl::flat_hash_map<store::BlockId, uint32_t> index_refs_ ABSL_GUARDED_BY(mu_);
  bool OnlyIndexed(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddIndexRefs(const std::vector<store::BlockId>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Entry* newest_leaf_ ABSL_GUARDED_BY(mu_) = nullptr;
  Entry* oldest_leaf_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t queries_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t indexed_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reclaimed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> host_bytes_{0};
};

}  // namespace kvmem::prefix
