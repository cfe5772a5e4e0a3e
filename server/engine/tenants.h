#pragma once
// Tenants: a cache salt's tenant in the pool, registered with its quota on first use
// (EngineConfig::tenant_quota_bytes, tenant_quotas). A salt without a quota, and no salt,
// is tenant 0 (nothing counted).
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

  // The salt's tenant; RESOURCE_EXHAUSTED when the pool can register no more.
  absl::StatusOr<store::TenantId> For(absl::string_view salt);

 private:
  store::BlockPool* const pool_;
  const uint64_t default_quota_;
  const std::vector<std::pair<std::string, uint64_t>> quotas_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, store::TenantId> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::engine
