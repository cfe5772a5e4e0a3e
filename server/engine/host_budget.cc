#include "server/engine/host_budget.h"

#include "absl/strings/str_cat.h"

namespace kvmem::engine {

HostReservation::~HostReservation() {
  if (budget_ != nullptr) budget_->host_reserved_ -= bytes_;
}

absl::Status HostReservation::Grow(uint64_t more, absl::string_view what) {
  return budget_->Grow(*this, more, what);
}

absl::Status HostBudget::Grow(HostReservation& reservation, uint64_t more, absl::string_view what) {
  // Reserved first, then checked against what is in use: of two racing calls, at least the
  // second sees the first's bytes and fails, so the sum never passes the budget.
  const uint64_t reserved = host_reserved_.fetch_add(more) + more;
  const uint64_t used = host_bytes_.load() + slot_state_bytes_.load() + other_bytes_();
  if (more > budget_ || used + reserved > budget_) {
    host_reserved_ -= more;
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", more, " more bytes of host metadata; ", used + reserved - more,
        " of the budget of ", budget_, " bytes are in use or promised to calls in flight",
        " (--host-metadata-bytes)"));
  }
  reservation.bytes_ += more;
  return absl::OkStatus();
}

absl::StatusOr<HostReservation> HostBudget::Reserve(uint64_t more, absl::string_view what) {
  HostReservation reservation(this);
  if (absl::Status s = reservation.Grow(more, what); !s.ok()) return s;
  return reservation;
}

void HostBudget::Account(Sequence& seq) {
  const uint64_t slot_bytes = seq.slots() ? seq.slots()->bytes() : 0;
  const uint64_t host = seq.released() ? 0 : seq.host_bytes();
  // Modular: shrinking subtracts.
  slot_state_bytes_ += slot_bytes - seq.slot_bytes_accounted();
  host_bytes_ += host - seq.host_bytes_accounted();
  seq.set_accounted(slot_bytes, host);
}

}  // namespace kvmem::engine
