#include "server/engine/host_budget.h"

#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace kvmem::engine {

HostReservation::~HostReservation() {
  if (budget_ != nullptr) (device_ ? budget_->device_reserved_ : budget_->host_reserved_) -= bytes_;
  if (share_ != nullptr) share_->reserved -= bytes_;
}

absl::Status HostReservation::Grow(uint64_t more, absl::string_view what) {
  return budget_->Grow(*this, more, what);
}

absl::Status HostBudget::Grow(HostReservation& reservation, uint64_t more, absl::string_view what) {
  // Reserved first, then checked against what is in use: of two racing calls, at least the
  // second sees the first's bytes and fails, so the sum never passes the budget.
  const bool device = reservation.device_;
  std::atomic<uint64_t>& reserved_total = device ? device_reserved_ : host_reserved_;
  const uint64_t reserved = reserved_total.fetch_add(more) + more;
  const uint64_t used = device ? device_slot_bytes_.load()
                               : host_bytes_.load() + slot_state_bytes_.load() + other_bytes_();
  const uint64_t limit = device ? device_budget_ : budget_;
  if (more > limit || used + reserved > limit) {
    reserved_total -= more;
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": needs ", more,
                     device ? " more bytes of device memory for slot states; "
                            : " more bytes of host metadata; ",
                     used + reserved - more, " of the budget of ", limit,
                     " bytes are in use or promised to calls in flight",
                     device ? " (--device-metadata-bytes)" : " (--host-metadata-bytes)"));
  }
  HostShare* share = reservation.share_.get();
  if (share != nullptr && tenant_budget_ != 0) {
    // The same order within the tenant's share.
    const uint64_t promised = share->reserved.fetch_add(more) + more;
    const uint64_t held = share->used.load();
    if (more > tenant_budget_ || held + promised > tenant_budget_) {
      share->reserved -= more;
      reserved_total -= more;
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": needs ", more,
          device ? " more bytes of device memory for slot states; tenant '"
                 : " more bytes of host metadata; tenant '",
          share->key.substr(0, 64), "' has ", held + promised - more, " of its ", tenant_budget_,
          " bytes in use or promised to calls in flight (--tenant-host-metadata-bytes, which",
          " bounds a tenant's host and device metadata together)"));
    }
  } else if (share != nullptr) {
    share->reserved += more;
  }
  reservation.bytes_ += more;
  return absl::OkStatus();
}

absl::StatusOr<HostReservation> HostBudget::Reserve(uint64_t more, absl::string_view what,
                                                    std::shared_ptr<HostShare> share) {
  HostReservation reservation(this, std::move(share));
  if (absl::Status s = reservation.Grow(more, what); !s.ok()) return s;
  return reservation;
}

std::shared_ptr<HostShare> HostBudget::ShareOf(const std::string& key) {
  kvmem::MutexLock lock(&shares_mu_);
  std::weak_ptr<HostShare>& slot = shares_[key];
  if (std::shared_ptr<HostShare> live = slot.lock()) return live;
  auto share = std::make_shared<HostShare>(key);
  slot = share;
  // Shares no sequence or call holds any more go when the map has doubled since the last
  // sweep: at most twice the live ones are kept (each held by a registered tenant's
  // sequence or call).
  if (shares_.size() >= sweep_at_) {
    absl::erase_if(shares_, [](const auto& entry) { return entry.second.expired(); });
    sweep_at_ = std::max<size_t>(64, 2 * shares_.size());
  }
  return share;
}

absl::StatusOr<HostReservation> HostBudget::ReserveDevice(uint64_t more, absl::string_view what,
                                                          std::shared_ptr<HostShare> share) {
  HostReservation reservation(this, std::move(share), /*device=*/true);
  if (absl::Status s = reservation.Grow(more, what); !s.ok()) return s;
  return reservation;
}

void HostBudget::Account(Sequence& seq) {
  const uint64_t slot_bytes = seq.slots() ? seq.slots()->bytes() : 0;
  const uint64_t host = seq.released() ? 0 : seq.host_bytes();
  // Modular: shrinking subtracts.
  const uint64_t slot_delta = slot_bytes - seq.slot_bytes_accounted();
  const uint64_t host_delta = host - seq.host_bytes_accounted();
  host_bytes_ += host_delta;
  // A sequence's slot state lives where it was made for its whole life (once it is gone,
  // its bytes leave the total they were in).
  const bool device =
      seq.slots() != nullptr ? seq.slots()->in_device_memory() : seq.slots_accounted_on_device();
  (device ? device_slot_bytes_ : slot_state_bytes_) += slot_delta;
  // A tenant's share bounds both: what its sequences hold here and on the device.
  if (HostShare* share = seq.host_share()) share->used += slot_delta + host_delta;
  seq.set_accounted(slot_bytes, host, device);
}

}  // namespace kvmem::engine
