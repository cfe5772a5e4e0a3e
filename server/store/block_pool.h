#pragma once
// BlockPool: offset bookkeeping for the daemon's fixed-size pool.
//
// The pool is one allocation of `pool_bytes`, carved into pages of `page_bytes`. A page in
// use serves blocks of a single size class (block bytes rounded up to 64), so blocks of
// different layouts and precisions share the pool without external fragmentation; a page
// returns to the free list when its last block is freed. The pool never grows.
//
// Arenas (kvmemd --tenant-arena): the pool's last pages may be cut into arenas, each serving
// the blocks of one tenant alone (a tenant bound to an arena allocates only there; nobody
// else allocates there), so that a same-host client of that tenant maps its arena and
// nothing of the others'. The rest of the pool is the shared part.
//
// Blocks are reference counted from creation (Fork and prefix sharing map one physical block
// into several streams). Thread-safe: every method but offset and refs takes the pool's
// mutex; those two, which the decode path asks per block, read without it.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/common/mutex.h"

namespace kvmem::store {

using BlockId = uint32_t;
// Who a block's bytes are charged to (RegisterTenant); 0: nobody, no quota.
using TenantId = uint32_t;
inline constexpr uint32_t kBlockAlignment = 64;

// One arena: `pages` pages at the pool's end (after the arenas before it), `reserve_pages` of
// them kept for Use::kReclaim as the pool keeps its own; `name` for messages.
struct ArenaSpec {
  std::string name;
  uint32_t pages = 0;
  uint32_t reserve_pages = 0;
};

struct PoolUsage {
  uint64_t pool_bytes = 0;
  uint64_t page_bytes = 0;
  uint64_t pages_total = 0;
  uint64_t pages_used = 0;
  uint64_t blocks_used = 0;
  uint64_t block_bytes_used = 0;  // sum of live blocks' size-class bytes
  uint64_t reserve_pages = 0;
  uint64_t bad_unrefs = 0;  // Ref/Unref of ids not allocated: must stay 0
};

class BlockPool {
 public:
  // pool_bytes is rounded down to whole pages; at least one page is required, and at most
  // 2^32 - 1 blocks of the smallest size class may fit (BlockId is 32-bit and ids are
  // reused, so no id can wrap). `reserve_pages` free pages are kept for allocations that
  // reclaim memory (Use::kReclaim: quantization), so that a full pool can still shrink.
  // `arenas` take the pool's last pages, in order (arena i is region i + 1); the shared
  // part keeps the rest and `reserve_pages` of it, and must keep at least one page.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(uint64_t pool_bytes, uint64_t page_bytes,
                                                           uint32_t reserve_pages = 0,
                                                           std::vector<ArenaSpec> arenas = {});

  // What an allocation is for: kGrow may not take the last reserve_pages free pages,
  // kReclaim (work that frees more than it takes once committed) may.
  enum class Use { kGrow, kReclaim };

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Allocates `count` blocks of `block_bytes` each, all or none, each with one reference.
  // RESOURCE_EXHAUSTED names the pool and what was asked when it cannot.
  // The blocks are charged to `tenant` until freed; a kGrow allocation that would take the
  // tenant past its quota is RESOURCE_EXHAUSTED naming the tenant and the quota (and
  // reclaims nothing: the pool is not what is short).
  [[nodiscard]] absl::Status AllocateMany(uint32_t block_bytes, size_t count,
                                          std::vector<BlockId>* out, Use use = Use::kGrow,
                                          TenantId tenant = 0);
  // A tenant named `name` with a quota of pool bytes (0: none); at most kMaxTenants at once
  // (RESOURCE_EXHAUSTED naming `limit_flag`, the setting that bounds them). `arena` (1 for
  // the first of Create's arenas; 0: none) is where its blocks go, and no one else's; the
  // caller binds each arena to one tenant name.
  absl::StatusOr<TenantId> RegisterTenant(std::string name, uint64_t quota_bytes,
                                          absl::string_view limit_flag = "tenants",
                                          uint32_t arena = 0);
  // Frees a tenant's id for another (RegisterTenant) once no block is charged to it; false
  // (and nothing changes) while one is. The caller makes sure nothing allocates for it.
  bool UnregisterTenant(TenantId tenant);
  static constexpr size_t kMaxTenants = 1 << 16;
  // Pool bytes charged to the tenant now; the tenant a block is charged to.
  uint64_t tenant_bytes(TenantId tenant) const;
  TenantId block_tenant(BlockId id) const;
  // Adds a reference to each block.
  void Ref(absl::Span<const BlockId> ids);
  // Drops one reference from each block; returns how many blocks were freed. An id that
  // is not allocated (a double drop: an engine bug) is skipped, logged and counted in
  // PoolUsage::bad_unrefs, never wrapped around.
  size_t Unref(absl::Span<const BlockId> ids);

  // Without the pool's mutex. For a block the caller holds a reference to (so that it
  // cannot be freed meanwhile); a free or unknown id reads 0.
  uint64_t offset(BlockId id) const;
  uint32_t refs(BlockId id) const;
  // Pool bytes the block takes (its size class).
  uint32_t block_bytes(BlockId id) const;

  // Called, without the pool's lock, when an allocation finds the pool full: frees what it
  // can of what is cached (the prefix index's unreferenced blocks) toward `bytes` and
  // returns the bytes it freed; the allocation then tries again, until it succeeds or the
  // reclaimer frees nothing. Set before the pool is shared.
  // With a tenant (not 0), the allocation was refused for that tenant's quota: the
  // reclaimer frees what is cached and charged to it, toward `bytes` of its charge.
  using Reclaimer = std::function<uint64_t(uint64_t bytes, TenantId tenant)>;
  void set_reclaimer(Reclaimer reclaimer) { reclaimer_ = std::move(reclaimer); }
  PoolUsage usage() const;
  uint64_t pool_bytes() const { return page_bytes_ * num_pages_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t free_bytes() const;
  // Arena a's first byte in the pool and its bytes (a in [1, arenas()]).
  uint32_t arenas() const { return static_cast<uint32_t>(bounds_.size() - 1); }
  uint64_t arena_offset(uint32_t arena) const {
    return uint64_t{bounds_[arena].first_page} * page_bytes_;
  }
  uint64_t arena_bytes(uint32_t arena) const {
    return uint64_t{bounds_[arena].pages} * page_bytes_;
  }
  // Pool bytes of arena a (0: the shared part) that no block holds.
  uint64_t region_free_bytes(uint32_t region) const;
  // Where a block lies: 0 (the shared part) or its arena. Without the pool's mutex, for a
  // block the caller holds a reference to (as offset).
  uint32_t block_region(BlockId id) const {
    return RegionOf(static_cast<uint32_t>(offset(id) / page_bytes_));
  }
  // The region a tenant's blocks go to (0 for the shared part, or an unknown tenant).
  uint32_t tenant_region(TenantId tenant) const;
  // A region's pages, those in use, and the tenant bound to it now (an arena's; 0: none).
  struct RegionUsage {
    uint64_t pages = 0, pages_used = 0;
    TenantId tenant = 0;
  };
  RegionUsage region_usage(uint32_t region) const;

 private:
  // The shared part (region 0) or an arena: where it lies, which never changes ...
  struct Bounds {
    std::string name;  // "" for the shared part
    uint32_t first_page = 0, pages = 0, reserve_pages = 0;
  };
  // ... and its free pages and partial pages.
  struct Region {
    std::vector<uint32_t> free_pages;  // stack, lowest index on top
    // Pages with at least one free slot, per size class; lowest page first keeps pages dense.
    std::map<uint32_t, std::set<uint32_t>> partial;
  };
  BlockPool(uint64_t page_bytes, uint32_t num_pages, std::vector<Bounds> bounds);
  uint32_t RegionOf(uint32_t page) const;
  // Pages kept for quantization, over every region.
  uint64_t ReservePages() const;
  bool Live(BlockId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return id < blocks_.size() && State(id)->refs.load(std::memory_order_relaxed) > 0;
  }

  struct Page {
    uint32_t class_bytes = 0;  // 0 = free page
    uint32_t used = 0;
    std::vector<uint32_t> free_slots;  // slot indices, popped from the back
  };
  struct Block {
    uint32_t class_bytes = 0;
    TenantId tenant = 0;
  };
  // An id's offset and references, read without the mutex (written under it): in chunks of
  // kIdsPerChunk that, once made, neither move nor go away, so that a reader never sees one
  // reallocated under it.
  struct IdState {
    std::atomic<uint64_t> offset{0};
    std::atomic<uint32_t> refs{0};  // 0 = id is free
  };
  static constexpr uint32_t kIdsPerChunk = 1 << 14;
  // The id's state; nullptr past the ids made so far.
  IdState* State(BlockId id) const {
    if (id / kIdsPerChunk >= num_chunks_) return nullptr;
    IdState* chunk = chunks_[id / kIdsPerChunk].load(std::memory_order_acquire);
    return chunk == nullptr ? nullptr : chunk + id % kIdsPerChunk;
  }
  struct Tenant {
    std::string name;
    uint64_t quota = 0;  // 0: none
    uint64_t used = 0;
    bool registered = false;  // [0] and unregistered ids are not
    uint32_t region = 0;      // where its blocks go: 0, the shared part, or its arena
  };

  // AllocateMany without reclaiming; on RESOURCE_EXHAUSTED, *deficit is about how many more
  // bytes it would have needed.
  // `over_quota`: set when the tenant's quota, not the pool, refused it.
  absl::Status AllocateManyOnce(uint32_t block_bytes, uint32_t class_bytes, size_t count,
                                std::vector<BlockId>* out, Use use, TenantId tenant,
                                uint64_t* deficit, bool* over_quota);
  absl::StatusOr<BlockId> AllocateOneLocked(uint32_t class_bytes, Use use, uint32_t region)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t page_bytes_;
  const uint32_t num_pages_;
  Reclaimer reclaimer_;
  mutable absl::Mutex mu_;
  uint64_t bad_unrefs_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Page> pages_ ABSL_GUARDED_BY(mu_);
  // [0]: the shared part; then the arenas, in page order.
  const std::vector<Bounds> bounds_;
  std::vector<Region> regions_ ABSL_GUARDED_BY(mu_);
  std::vector<Block> blocks_ ABSL_GUARDED_BY(mu_);
  // Room for every id the pool can hand out (one per 64 bytes of pool at most).
  const size_t num_chunks_;
  const std::unique_ptr<std::atomic<IdState*>[]> chunks_;
  std::vector<std::unique_ptr<IdState[]>> owned_chunks_ ABSL_GUARDED_BY(mu_);
  std::vector<Tenant> tenants_ ABSL_GUARDED_BY(mu_) = {Tenant{}};  // [0]: nobody
  std::vector<TenantId> free_tenants_ ABSL_GUARDED_BY(mu_);        // unregistered ids
  std::vector<BlockId> free_ids_ ABSL_GUARDED_BY(mu_);
  uint64_t blocks_used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t block_bytes_used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pages_used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::store
