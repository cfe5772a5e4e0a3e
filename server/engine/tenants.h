#pragma once
// Tenants: who a sequence belongs to for its quotas. The key is the authenticated tenant
// (PromptPrefix::owner) when kvmemd checks identities, else the cache salt ("" included).
// A key with a byte quota (EngineConfig::tenant_quota_bytes, tenant_quotas) is registered
// with the pool, which charges its blocks to it; with tenant_max_sequences, every key's
// sequences are counted and one past the limit is refused. A key with an arena
// (EngineConfig::tenant_arenas) is registered too, bound to its arena: its blocks go there.
//
// A tenant is held by each of its sequences (Acquire, AddHold, Release). One no sequence
// holds stays registered while blocks are charged to it (cached prompt blocks) and is
// unregistered when a new tenant needs its room: the registry holds at most
// store::BlockPool::kMaxTenants tenants, each of which holds a sequence or pool bytes.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

class Tenants {
 public:
  // `arenas[i]` is the tenant bound to the pool's arena i + 1.
  Tenants(store::BlockPool* pool, uint64_t default_quota,
          std::vector<std::pair<std::string, uint64_t>> quotas, uint32_t max_sequences,
          std::vector<std::string> arenas = {})
      : pool_(pool),
        default_quota_(default_quota),
        quotas_(std::move(quotas)),
        max_sequences_(max_sequences),
        arenas_(std::move(arenas)) {}

  // The pool's arena of the key (0: none, its blocks go to the shared part).
  uint32_t ArenaOf(absl::string_view key) const;

  // The key's pool tenant (0: no byte quota), held once more for a new sequence;
  // RESOURCE_EXHAUSTED when the key holds max_sequences already, or when kMaxTenants others
  // hold a sequence or pool bytes.
  absl::StatusOr<store::TenantId> Acquire(absl::string_view key);
  // One more hold of a key held already (a fork's); RESOURCE_EXHAUSTED past max_sequences.
  absl::Status AddHold(absl::string_view key);
  // Gives a hold back (a released sequence's).
  void Release(absl::string_view key);
  // Tenants registered now (held, or charged pool bytes).
  size_t registered() const;

 private:
  struct Entry {
    store::TenantId id = 0;  // the pool's, 0 without a byte quota
    uint32_t holds = 0;
  };
  uint64_t QuotaOf(absl::string_view key) const;
  absl::Status TooMany(absl::string_view key) const;
  // Unregisters every tenant no sequence holds and no block is charged to.
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  store::BlockPool* const pool_;
  const uint64_t default_quota_;
  const std::vector<std::pair<std::string, uint64_t>> quotas_;
  const uint32_t max_sequences_;
  const std::vector<std::string> arenas_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::engine
