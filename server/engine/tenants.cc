#include "server/engine/tenants.h"

#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace kvmem::engine {

uint64_t Tenants::QuotaOf(absl::string_view key) const {
  uint64_t quota = default_quota_;
  for (const auto& [name, bytes] : quotas_) {
    if (name == key) quota = bytes;
  }
  return quota;
}

uint32_t Tenants::ArenaOf(absl::string_view key) const {
  for (size_t i = 0; i < arenas_.size(); ++i) {
    if (arenas_[i] == key) return static_cast<uint32_t>(i + 1);
  }
  return 0;
}

absl::Status Tenants::TooMany(absl::string_view key) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("tenant '", key.substr(0, 64), "' holds ", max_sequences_,
                   " sequences, its limit (--tenant-max-sequences)"));
}

absl::StatusOr<store::TenantId> Tenants::Acquire(absl::string_view key) {
  const uint64_t quota = QuotaOf(key);
  const uint32_t arena = ArenaOf(key);
  if (quota == 0 && max_sequences_ == 0 && arena == 0) return store::TenantId{0};  // none
  kvmem::MutexLock lock(&mu_);
  if (auto it = tenants_.find(key); it != tenants_.end()) {
    if (max_sequences_ > 0 && it->second.holds >= max_sequences_) return TooMany(key);
    ++it->second.holds;
    return it->second.id;
  }
  store::TenantId id = 0;
  if (quota > 0 || arena > 0) {
    absl::StatusOr<store::TenantId> registered =
        pool_->RegisterTenant(std::string(key), quota, "--tenant-quota-bytes", arena);
    if (!registered.ok() && absl::IsResourceExhausted(registered.status())) {
      SweepLocked();
      registered = pool_->RegisterTenant(std::string(key), quota, "--tenant-quota-bytes", arena);
    }
    if (!registered.ok()) return registered.status();
    id = *registered;
  } else if (tenants_.size() >= store::BlockPool::kMaxTenants) {
    SweepLocked();
    if (tenants_.size() >= store::BlockPool::kMaxTenants) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tenants: ", store::BlockPool::kMaxTenants, " hold sequences now"));
    }
  }
  tenants_.emplace(std::string(key), Entry{id, 1});
  return id;
}

absl::Status Tenants::AddHold(absl::string_view key) {
  kvmem::MutexLock lock(&mu_);
  auto it = tenants_.find(key);
  if (it == tenants_.end()) return absl::OkStatus();  // not counted (no quota, no limit)
  if (max_sequences_ > 0 && it->second.holds >= max_sequences_) return TooMany(key);
  ++it->second.holds;
  return absl::OkStatus();
}

void Tenants::Release(absl::string_view key) {
  kvmem::MutexLock lock(&mu_);
  auto it = tenants_.find(key);
  if (it == tenants_.end()) return;
  if (it->second.holds > 0) --it->second.holds;
  if (it->second.holds > 0) return;
  if (it->second.id == 0 || pool_->UnregisterTenant(it->second.id)) tenants_.erase(it);
}

void Tenants::SweepLocked() {
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    const Entry& e = it->second;
    if (e.holds == 0 && (e.id == 0 || pool_->UnregisterTenant(e.id))) {
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
