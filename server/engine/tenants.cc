#include "server/engine/tenants.h"

#include "server/common/mutex.h"

namespace kvmem::engine {

absl::StatusOr<store::TenantId> Tenants::Acquire(absl::string_view key) {
  uint64_t quota = default_quota_;
  for (const auto& [name, bytes] : quotas_) {
    if (name == key) quota = bytes;
  }
  if (quota == 0) return store::TenantId{0};  // nothing to count: no registry entry
  kvmem::MutexLock lock(&mu_);
  if (auto it = tenants_.find(key); it != tenants_.end()) {
    ++it->second.holds;
    return it->second.id;
  }
  absl::StatusOr<store::TenantId> id =
      pool_->RegisterTenant(std::string(key), quota, "--tenant-quota-bytes");
  if (!id.ok() && absl::IsResourceExhausted(id.status())) {
    SweepLocked();
    id = pool_->RegisterTenant(std::string(key), quota, "--tenant-quota-bytes");
  }
  if (!id.ok()) return id.status();
  tenants_.emplace(std::string(key), Entry{*id, 1});
  keys_.emplace(*id, std::string(key));
  return *id;
}

void Tenants::AddHold(store::TenantId id) {
  if (id == 0) return;
  kvmem::MutexLock lock(&mu_);
  auto key = keys_.find(id);
  if (key != keys_.end()) ++tenants_[key->second].holds;
}

void Tenants::Release(store::TenantId id) {
  if (id == 0) return;
  kvmem::MutexLock lock(&mu_);
  auto key = keys_.find(id);
  if (key == keys_.end()) return;
  auto it = tenants_.find(key->second);
  if (it->second.holds > 0) --it->second.holds;
  if (it->second.holds == 0 && pool_->UnregisterTenant(id)) {
    tenants_.erase(it);
    keys_.erase(key);
  }
}

void Tenants::SweepLocked() {
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    if (it->second.holds == 0 && pool_->UnregisterTenant(it->second.id)) {
      keys_.erase(it->second.id);
      tenants_.erase(it++);
    } else {
      ++it;
    }
  }
}

size_t Tenants::registered() const {
  kvmem::MutexLock lock(&mu_);
  return tenants_.size();
}

}  // namespace kvmem::engine
