#include "server/store/block_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvmem::store {
namespace {
uint32_t RoundUp(uint32_t bytes) {
  return (bytes + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;
}
}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(uint64_t pool_bytes,
                                                             uint64_t page_bytes,
                                                             uint32_t reserve_pages,
                                                             std::vector<ArenaSpec> arenas) {
  if (page_bytes < kBlockAlignment || page_bytes % kBlockAlignment != 0 ||
      page_bytes > (1ull << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("page_bytes: ", page_bytes,
                                                   " must be a multiple of ", kBlockAlignment,
                                                   " in [", kBlockAlignment, ", 1 GiB]"));
  }
  const uint64_t pages = pool_bytes / page_bytes;
  if (pages == 0 || pages > 0xffffffffull) {
    return absl::InvalidArgumentError(absl::StrCat("pool_bytes: ", pool_bytes,
                                                   " must hold between 1 and 2^32-1 pages of ",
                                                   page_bytes, " bytes"));
  }
  if (pages * (page_bytes / kBlockAlignment) > 0xffffffffull) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool_bytes: ", pool_bytes, " would hold more than 2^32 - 1 blocks of ", kBlockAlignment,
        " bytes (block ids are 32-bit); at most ", 0xffffffffull * kBlockAlignment, " bytes"));
  }
  uint64_t arena_pages = 0;
  for (const ArenaSpec& a : arenas) {
    if (a.pages == 0 || a.reserve_pages >= a.pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tenant-arena: ", a.name, ": ", a.pages, " pages of ", page_bytes, " bytes, ",
          a.reserve_pages, " of them kept for quantization (--reclaim-reserve-pages): too few"));
    }
    arena_pages += a.pages;
  }
  if (arena_pages >= pages) {
    return absl::InvalidArgumentError(absl::StrCat("arenas: ", arena_pages, " pages of ",
                                                   page_bytes, " bytes leave none of the ",
                                                   "pool's ", pages, " to the shared part"));
  }
  const uint64_t shared_pages = pages - arena_pages;
  if (reserve_pages >= shared_pages && reserve_pages > 0) {
    return absl::InvalidArgumentError(absl::StrCat("reserve_pages: ", reserve_pages,
                                                   " must be less than the pool's ", shared_pages,
                                                   arenas.empty() ? " pages" : " shared pages"));
  }
  std::vector<Bounds> bounds = {{"", 0, static_cast<uint32_t>(shared_pages), reserve_pages}};
  for (ArenaSpec& a : arenas) {
    const Bounds& before = bounds.back();
    bounds.push_back(
        {std::move(a.name), before.first_page + before.pages, a.pages, a.reserve_pages});
  }
  return std::unique_ptr<BlockPool>(
      new BlockPool(page_bytes, static_cast<uint32_t>(pages), std::move(bounds)));
}

BlockPool::BlockPool(uint64_t page_bytes, uint32_t num_pages, std::vector<Bounds> bounds)
    : page_bytes_(page_bytes),
      num_pages_(num_pages),
      bounds_(std::move(bounds)),
      num_chunks_((uint64_t{num_pages} * (page_bytes / kBlockAlignment) + kIdsPerChunk - 1) /
                  kIdsPerChunk),
      chunks_(std::make_unique<std::atomic<IdState*>[]>(num_chunks_)) {
  pages_.resize(num_pages);
  regions_.resize(bounds_.size());
  for (size_t r = 0; r < bounds_.size(); ++r) {
    std::vector<uint32_t>& free = regions_[r].free_pages;
    free.reserve(bounds_[r].pages);
    for (uint32_t p = bounds_[r].first_page + bounds_[r].pages; p-- > bounds_[r].first_page;) {
      free.push_back(p);
    }
  }
}

uint32_t BlockPool::RegionOf(uint32_t page) const {
  // The last region starting at or before the page (regions are in page order).
  auto after = std::upper_bound(bounds_.begin(), bounds_.end(), page,
                                [](uint32_t p, const Bounds& b) { return p < b.first_page; });
  return static_cast<uint32_t>(after - bounds_.begin() - 1);
}

absl::StatusOr<BlockId> BlockPool::AllocateOneLocked(uint32_t class_bytes, Use use, uint32_t r) {
  Region& region = regions_[r];
  // Room for a new id first, before any page changes: if making it throws (host memory),
  // nothing changed.
  if (free_ids_.empty()) {
    const size_t next = blocks_.size();
    // Every id the pool can hand out is in use: so is every byte of it.
    if (next >= uint64_t{num_chunks_} * kIdsPerChunk) {
      return absl::ResourceExhaustedError("no free block id");
    }
    if (State(static_cast<BlockId>(next)) == nullptr) {
      owned_chunks_.push_back(std::make_unique<IdState[]>(kIdsPerChunk));
      chunks_[next / kIdsPerChunk].store(owned_chunks_.back().get(), std::memory_order_release);
    }
    if (blocks_.size() == blocks_.capacity()) blocks_.reserve(2 * blocks_.size() + 64);
    // FreeLocked's push_back then never allocates: there are never more free ids than ids.
    if (free_ids_.capacity() < blocks_.capacity()) free_ids_.reserve(blocks_.capacity());
  }
  uint32_t page_index;
  auto partial = region.partial.find(class_bytes);
  if (partial != region.partial.end() && !partial->second.empty()) {
    page_index = *partial->second.begin();
  } else {
    if (region.free_pages.size() <= (use == Use::kReclaim ? 0 : bounds_[r].reserve_pages)) {
      return absl::ResourceExhaustedError("no free page");
    }
    // What may throw first, while the page is still free (class 0, on the free list).
    const uint32_t candidate = region.free_pages.back();
    Page& page = pages_[candidate];
    const uint32_t slots = static_cast<uint32_t>(page_bytes_ / class_bytes);
    page.free_slots.resize(slots);
    for (uint32_t s = 0; s < slots; ++s) page.free_slots[s] = slots - 1 - s;
    region.partial[class_bytes].insert(candidate);
    page_index = candidate;
    region.free_pages.pop_back();
    ++pages_used_;
    page.class_bytes = class_bytes;
    page.used = 0;
  }
  Page& page = pages_[page_index];
  const uint32_t slot = page.free_slots.back();
  page.free_slots.pop_back();
  ++page.used;
  if (page.free_slots.empty()) region.partial[class_bytes].erase(page_index);

  BlockId id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<BlockId>(blocks_.size());
    blocks_.emplace_back();  // into the room made above
  }
  blocks_[id] = Block{class_bytes, 0};
  IdState* state = State(id);
  state->offset.store(page_index * page_bytes_ + uint64_t{slot} * class_bytes,
                      std::memory_order_relaxed);
  state->refs.store(1, std::memory_order_relaxed);
  ++blocks_used_;
  block_bytes_used_ += class_bytes;
  return id;
}

void BlockPool::FreeLocked(BlockId id) {
  Block& block = blocks_[id];
  IdState* state = State(id);
  const uint64_t offset = state->offset.load(std::memory_order_relaxed);
  const uint32_t page_index = static_cast<uint32_t>(offset / page_bytes_);
  Page& page = pages_[page_index];
  Region& region = regions_[RegionOf(page_index)];
  page.free_slots.push_back(static_cast<uint32_t>((offset % page_bytes_) / block.class_bytes));
  --page.used;
  if (page.used == 0) {
    region.partial[page.class_bytes].erase(page_index);
    page.class_bytes = 0;
    page.free_slots.clear();
    page.free_slots.shrink_to_fit();
    region.free_pages.push_back(page_index);
    --pages_used_;
  } else {
    region.partial[page.class_bytes].insert(page_index);
  }
  --blocks_used_;
  block_bytes_used_ -= block.class_bytes;
  tenants_[block.tenant].used -= block.class_bytes;
  block = Block{};
  state->offset.store(0, std::memory_order_relaxed);
  state->refs.store(0, std::memory_order_relaxed);
  free_ids_.push_back(id);
}

absl::StatusOr<TenantId> BlockPool::RegisterTenant(std::string name, uint64_t quota_bytes,
                                                   absl::string_view limit_flag, uint32_t arena) {
  if (arena >= bounds_.size()) {
    return absl::InternalError(absl::StrCat("tenants: no arena ", arena, " (", arenas(), ")"));
  }
  kvmem::MutexLock lock(&mu_);
  if (!free_tenants_.empty()) {
    const TenantId id = free_tenants_.back();
    if (tenants_[id].used != 0) {  // never: UnregisterTenant frees only an id charged nothing
      return absl::InternalError(absl::StrCat("tenants: id ", id, " is free but charged"));
    }
    free_tenants_.pop_back();
    tenants_[id] = Tenant{std::move(name), quota_bytes, 0, true, arena};
    return id;
  }
  if (tenants_.size() >= kMaxTenants + 1) {  // [0] is nobody
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenants: ", kMaxTenants, " tenants hold pool bytes or sequences now (", limit_flag, ")"));
  }
  free_tenants_.reserve(tenants_.size() + 1);  // so that UnregisterTenant never allocates
  tenants_.push_back(Tenant{std::move(name), quota_bytes, 0, true, arena});
  return static_cast<TenantId>(tenants_.size() - 1);
}

bool BlockPool::UnregisterTenant(TenantId tenant) {
  kvmem::MutexLock lock(&mu_);
  if (tenant >= tenants_.size() || !tenants_[tenant].registered || tenants_[tenant].used != 0) {
    return false;
  }
  tenants_[tenant] = Tenant{};
  free_tenants_.push_back(tenant);
  return true;
}

TenantId BlockPool::block_tenant(BlockId id) const {
  kvmem::MutexLock lock(&mu_);
  return Live(id) ? blocks_[id].tenant : 0;
}

uint64_t BlockPool::tenant_bytes(TenantId tenant) const {
  kvmem::MutexLock lock(&mu_);
  return tenant < tenants_.size() ? tenants_[tenant].used : 0;
}

absl::Status BlockPool::AllocateMany(uint32_t block_bytes, size_t count, std::vector<BlockId>* out,
                                     Use use, TenantId tenant) {
  if (block_bytes == 0 || block_bytes > page_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_bytes: ", block_bytes, " must be in [1, page_bytes=", page_bytes_, "]"));
  }
  const uint32_t class_bytes = RoundUp(block_bytes);
  for (;;) {
    uint64_t deficit = 0;
    bool over_quota = false;
    absl::Status s =
        AllocateManyOnce(block_bytes, class_bytes, count, out, use, tenant, &deficit, &over_quota);
    if (s.ok() || !absl::IsResourceExhausted(s) || !reclaimer_) return s;
    // An ask its part of the pool (the shared part, or its arena) could not hold leaves the
    // cache alone.
    if (uint64_t{count} * class_bytes >
        uint64_t{bounds_[tenant_region(tenant)].pages} * page_bytes_) {
      return s;
    }
    if (over_quota) {
      // What is cached and charged to the tenant goes first, then the refusal.
      if (reclaimer_(deficit, tenant) == 0) return s;
      continue;
    }
    if (reclaimer_(deficit, 0) == 0) return s;
  }
}

absl::Status BlockPool::AllocateManyOnce(uint32_t block_bytes, uint32_t class_bytes, size_t count,
                                         std::vector<BlockId>* out, Use use, TenantId tenant,
                                         uint64_t* deficit, bool* over_quota) {
  kvmem::MutexLock lock(&mu_);
  if (tenant >= tenants_.size()) {
    spdlog::critical("block pool: allocation for tenant {}, which is not registered (engine bug)",
                     tenant);
    tenant = 0;
  }
  Tenant& charged = tenants_[tenant];
  const uint64_t asked = uint64_t{count} * class_bytes;
  if (use == Use::kGrow && charged.quota > 0 && charged.used + asked > charged.quota) {
    *deficit = charged.used + asked - charged.quota;
    *over_quota = true;
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", charged.name.substr(0, 64), "' holds ", charged.used, " bytes of the pool; ",
        asked, " more would pass its quota of ", charged.quota, " bytes (--tenant-quota-bytes)"));
  }
  const size_t first = out->size();
  if (out->capacity() < first + count) {  // so that no push_back below throws with blocks taken
    out->reserve(std::max(first + count, 2 * out->capacity()));
  }
  const uint32_t r = charged.region;
  const Region& region = regions_[r];
  const Bounds& bounds = bounds_[r];
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<BlockId> id = AllocateOneLocked(class_bytes, use, r);
    if (!id.ok()) {
      for (size_t j = first; j < out->size(); ++j) FreeLocked((*out)[j]);
      out->resize(first);
      // What is missing, as the pool stands again: the free slots of this size class in
      // partly used pages and the free pages this use may take count against the ask.
      uint64_t room = 0;
      if (auto p = region.partial.find(class_bytes); p != region.partial.end()) {
        for (uint32_t page : p->second) room += pages_[page].free_slots.size() * class_bytes;
      }
      const uint64_t usable = use == Use::kReclaim ? 0 : bounds.reserve_pages;
      const uint64_t free_pages = region.free_pages.size();
      if (free_pages > usable) {
        room += (free_pages - usable) * (page_bytes_ / class_bytes) * class_bytes;
      }
      *deficit = asked > room ? asked - room : class_bytes;
      // A full arena is its tenant's alone to make room in (the reclaimer frees what is
      // cached and charged to the tenant), as a quota is.
      *over_quota = r != 0;
      const std::string where =
          r != 0         ? absl::StrCat(bounds.name, " of ", uint64_t{bounds.pages} * page_bytes_,
                                        " bytes (--tenant-arena)")
          : arenas() > 0 ? absl::StrCat("the shared part of the pool (",
                                        uint64_t{bounds.pages} * page_bytes_, " bytes)")
                         : absl::StrCat("the pool of ", pool_bytes(), " bytes");
      // With arenas, nothing of the other parts: counts over the pool would tell one tenant
      // about the others.
      return absl::ResourceExhaustedError(absl::StrCat(
          "pool: asked for ", count, " blocks of ", block_bytes, " bytes (", count * class_bytes,
          " bytes) but ", where, " has ", free_pages, " free pages of ", page_bytes_, " bytes (",
          bounds.reserve_pages, " kept for quantization)",
          arenas() > 0 ? "" : absl::StrCat(" and ", blocks_used_, " blocks in use")));
    }
    out->push_back(*id);
    // Charged block by block, so that a rollback (FreeLocked) credits exactly what was.
    blocks_[*id].tenant = tenant;
    charged.used += class_bytes;
  }
  return absl::OkStatus();
}

void BlockPool::Ref(absl::Span<const BlockId> ids) {
  kvmem::MutexLock lock(&mu_);
  for (BlockId id : ids) {
    if (!Live(id)) {
      ++bad_unrefs_;
      spdlog::critical("block pool: Ref of block {}, which is not allocated (engine bug)", id);
      continue;
    }
    State(id)->refs.fetch_add(1, std::memory_order_relaxed);
  }
}

size_t BlockPool::Unref(absl::Span<const BlockId> ids) {
  kvmem::MutexLock lock(&mu_);
  size_t freed = 0;
  for (BlockId id : ids) {
    if (!Live(id)) {
      ++bad_unrefs_;
      spdlog::critical("block pool: Unref of block {}, which is not allocated (engine bug)", id);
      continue;
    }
    // acq_rel, with refs()' acquire: a planner that reads 1 (and so writes the block in
    // place) comes after the other holder's last use of it.
    if (State(id)->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      FreeLocked(id);
      ++freed;
    }
  }
  return freed;
}

uint64_t BlockPool::offset(BlockId id) const {
  const IdState* state = State(id);
  return state == nullptr ? 0 : state->offset.load(std::memory_order_relaxed);
}

uint32_t BlockPool::block_bytes(BlockId id) const {
  kvmem::MutexLock lock(&mu_);
  return Live(id) ? blocks_[id].class_bytes : 0;
}

uint32_t BlockPool::refs(BlockId id) const {
  const IdState* state = State(id);
  return state == nullptr ? 0 : state->refs.load(std::memory_order_acquire);
}

PoolUsage BlockPool::usage() const {
  kvmem::MutexLock lock(&mu_);
  return PoolUsage{pool_bytes(), page_bytes_,       num_pages_,     pages_used_,
                   blocks_used_, block_bytes_used_, ReservePages(), bad_unrefs_};
}

uint64_t BlockPool::free_bytes() const {
  kvmem::MutexLock lock(&mu_);
  uint64_t pages = 0;
  for (const Region& r : regions_) pages += r.free_pages.size();
  return pages * page_bytes_;
}

uint64_t BlockPool::region_free_bytes(uint32_t region) const {
  kvmem::MutexLock lock(&mu_);
  return region < regions_.size() ? regions_[region].free_pages.size() * page_bytes_ : 0;
}

uint32_t BlockPool::tenant_region(TenantId tenant) const {
  kvmem::MutexLock lock(&mu_);
  return tenant < tenants_.size() ? tenants_[tenant].region : 0;
}

BlockPool::RegionUsage BlockPool::region_usage(uint32_t region) const {
  RegionUsage u;
  if (region >= bounds_.size()) return u;
  kvmem::MutexLock lock(&mu_);
  u.pages = bounds_[region].pages;
  u.pages_used = u.pages - regions_[region].free_pages.size();
  for (TenantId t = 1; region != 0 && t < tenants_.size(); ++t) {
    if (tenants_[t].registered && tenants_[t].region == region) u.tenant = t;
  }
  return u;
}

uint64_t BlockPool::ReservePages() const {
  uint64_t pages = 0;
  for (const Bounds& b : bounds_) pages += b.reserve_pages;
  return pages;
}

}  // namespace kvmem::store
