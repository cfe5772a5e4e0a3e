#include "server/engine/tenants.h"

#include "server/common/mutex.h"

namespace kvmem::engine {

absl::StatusOr<store::TenantId> Tenants::For(absl::string_view salt) {
  if (salt.empty()) return store::TenantId{0};
  uint64_t quota = default_quota_;
  for (const auto& [name, bytes] : quotas_) {
    if (name == salt) quota = bytes;
  }
  if (quota == 0) return store::TenantId{0};  // nothing to count: no registry entry
  kvmem::MutexLock lock(&mu_);
  if (auto it = tenants_.find(salt); it != tenants_.end()) return it->second;
  absl::StatusOr<store::TenantId> id = pool_->RegisterTenant(std::string(salt), quota);
  if (!id.ok()) return id.status();
  tenants_.emplace(std::string(salt), *id);
  return *id;
}

}  // namespace kvmem::engine
