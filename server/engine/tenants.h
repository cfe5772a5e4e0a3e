#pragma once
// Tenants: who a sequence's pool bytes are charged to, registered with its quota
// (EngineConfig::tenant_quota_bytes, tenant_quotas) while it holds anything. The key is the
// authenticated tenant when kvmemd checks tokens, else the cache salt ("" included); a key
// without a quota is tenant 0 (nothing counted, nothing registered).
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
  Tenants(store::BlockPool* pool, uint64_t default_quota,
          std::vector<std::pair<std::string, uint64_t>> quotas)
      : pool_(pool), default_quota_(default_quota), quotas_(std::move(quotas)) {}

  // The key's tenant, held once more; RESOURCE_EXHAUSTED when kMaxTenants others hold a
  // sequence or pool bytes.
  absl::StatusOr<store::TenantId> Acquire(absl::string_view key);
  // One more hold of a tenant held already (a fork's).
  void AddHold(store::TenantId id);
  // Gives a hold back (a released sequence's).
  void Release(store::TenantId id);
  // Tenants registered now (held, or charged pool bytes).
  size_t registered() const;

 private:
  struct Entry {
    store::TenantId id = 0;
    uint64_t holds = 0;
  };
  // Unregisters every tenant no sequence holds and no block is charged to.
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  store::BlockPool* const pool_;
  const uint64_t default_quota_;
  const std::vector<std::pair<std::string, uint64_t>> quotas_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> tenants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<store::TenantId, std::string> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::engine
