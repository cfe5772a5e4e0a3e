#pragma once
// HostBudget: the host memory sequences hold outside the pool (per-stream and per-slot
// vectors, slot states, the prefix index's entries), against --host-metadata-bytes.
// A call reserves what it may take before it takes it (HostReservation), so that concurrent
// calls cannot all pass one check and together overshoot the budget; what a sequence really
// holds is brought up to date by Account() under its lock. Lock-free (atomics), but for the
// map of tenants' shares.
//
// A tenant's share (EngineConfig::tenant_host_metadata_bytes): what its sequences hold and
// what its calls in flight were promised, bounded apart from the daemon's budget, so that one
// tenant cannot take all of it. The prefix index's entries and published documents are the
// index's (reclaimed as the pool's cache), counted in the daemon's budget only.
//
// Slot states in device memory (a GPU backend's: SlotState::in_device_memory) are not host
// memory: they count against a budget of their own (--device-metadata-bytes), reserved and
// accounted the same way (ReserveDevice); a tenant's share (below) bounds its host and
// device bytes together.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/sequence.h"

namespace kvmem::engine {

class HostBudget;

struct HostShare {
  explicit HostShare(std::string k) : key(std::move(k)) {}
  const std::string key;              // the tenant's (Engine::TenantKey)
  std::atomic<uint64_t> used{0};      // what its sequences hold (Account)
  std::atomic<uint64_t> reserved{0};  // promised to its calls in flight
};

// Host bytes a call may still take, counted against the budget from the moment they are
// granted until the reservation goes (by then what the call took is accounted). Grows.
class HostReservation {
 public:
  HostReservation() = default;
  HostReservation(HostReservation&& other) noexcept
      : budget_(std::exchange(other.budget_, nullptr)),
        share_(std::move(other.share_)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_) {}
  HostReservation& operator=(HostReservation&& other) noexcept {
    std::swap(budget_, other.budget_);
    std::swap(share_, other.share_);
    std::swap(bytes_, other.bytes_);
    std::swap(device_, other.device_);
    return *this;
  }
  ~HostReservation();
  // RESOURCE_EXHAUSTED (naming `what` and --host-metadata-bytes, or the tenant and
  // --tenant-host-metadata-bytes) unless `more` bytes fit both.
  absl::Status Grow(uint64_t more, absl::string_view what);
  uint64_t bytes() const { return bytes_; }

 private:
  friend class HostBudget;
  HostReservation(HostBudget* budget, std::shared_ptr<HostShare> share, bool device = false)
      : budget_(budget), share_(std::move(share)), device_(device) {}
  HostBudget* budget_ = nullptr;
  std::shared_ptr<HostShare> share_;  // null: counted in the daemon's budget only
  uint64_t bytes_ = 0;
  bool device_ = false;  // of the device budget (ReserveDevice)
};

class HostBudget {
 public:
  // `budget_bytes`: the limit; `other_bytes`: host bytes held elsewhere that count too (the
  // prefix index's entries); `tenant_bytes`: each tenant's share (0: no limit apart).
  // `device_bytes`: the budget of slot states in device memory.
  HostBudget(uint64_t budget_bytes, std::function<uint64_t()> other_bytes,
             uint64_t tenant_bytes = 0, uint64_t device_bytes = ~uint64_t{0})
      : budget_(budget_bytes),
        tenant_budget_(tenant_bytes),
        device_budget_(device_bytes),
        other_bytes_(std::move(other_bytes)) {}

  // The share of the tenant `key`: the same object while any sequence or call holds it.
  std::shared_ptr<HostShare> ShareOf(const std::string& key);
  // A reservation of `more` bytes, or RESOURCE_EXHAUSTED; counted in `share` too (a
  // sequence's, Sequence::host_share) when given.
  absl::StatusOr<HostReservation> Reserve(uint64_t more, absl::string_view what,
                                          std::shared_ptr<HostShare> share = nullptr);
  // The same of the device budget (RESOURCE_EXHAUSTED naming --device-metadata-bytes).
  absl::StatusOr<HostReservation> ReserveDevice(uint64_t more, absl::string_view what,
                                                std::shared_ptr<HostShare> share = nullptr);
  // An empty reservation, to grow later.
  HostReservation Empty(std::shared_ptr<HostShare> share = nullptr) {
    return HostReservation(this, std::move(share));
  }
  // Brings the totals (and the sequence's share) up to date with the sequence's slot state
  // size and host metadata.
  void Account(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  uint64_t budget() const { return budget_; }
  uint64_t tenant_budget() const { return tenant_budget_; }
  uint64_t host_bytes() const { return host_bytes_.load(); }
  // Slot states in host memory, and in device memory.
  uint64_t slot_state_bytes() const { return slot_state_bytes_.load(); }
  uint64_t device_slot_state_bytes() const { return device_slot_bytes_.load(); }
  uint64_t device_budget() const { return device_budget_; }

 private:
  friend class HostReservation;
  absl::Status Grow(HostReservation& reservation, uint64_t more, absl::string_view what);

  const uint64_t budget_;
  const uint64_t tenant_budget_;
  const uint64_t device_budget_;
  const std::function<uint64_t()> other_bytes_;
  absl::Mutex shares_mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<HostShare>> shares_ ABSL_GUARDED_BY(shares_mu_);
  size_t sweep_at_ ABSL_GUARDED_BY(shares_mu_) = 64;  // the map's size that sweeps it next
  std::atomic<uint64_t> slot_state_bytes_{0};
  std::atomic<uint64_t> host_bytes_{0};     // Sequence::host_bytes() of every sequence
  std::atomic<uint64_t> host_reserved_{0};  // granted to calls in flight
  std::atomic<uint64_t> device_slot_bytes_{0};
  std::atomic<uint64_t> device_reserved_{0};
};

}  // namespace kvmem::engine
