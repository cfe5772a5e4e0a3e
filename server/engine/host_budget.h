#pragma once
// HostBudget: the host memory sequences hold outside the pool (per-stream and per-slot
// vectors, slot states, the prefix index's entries), against --host-metadata-bytes.
// A call reserves what it may take before it takes it (HostReservation), so that concurrent
// calls cannot all pass one check and together overshoot the budget; what a sequence really
// holds is brought up to date by Account() under its lock. Lock-free (atomics).
#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/sequence.h"

namespace kvmem::engine {

class HostBudget;

// Host bytes a call may still take, counted against the budget from the moment they are
// granted until the reservation goes (by then what the call took is accounted). Grows.
class HostReservation {
 public:
  HostReservation() = default;
  HostReservation(HostReservation&& other) noexcept
      : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  HostReservation& operator=(HostReservation&& other) noexcept {
    std::swap(budget_, other.budget_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~HostReservation();
  // RESOURCE_EXHAUSTED (naming `what` and --host-metadata-bytes) unless `more` bytes fit.
  absl::Status Grow(uint64_t more, absl::string_view what);
  uint64_t bytes() const { return bytes_; }

 private:
  friend class HostBudget;
  explicit HostReservation(HostBudget* budget) : budget_(budget) {}
  HostBudget* budget_ = nullptr;
  uint64_t bytes_ = 0;
};

class HostBudget {
 public:
  // `budget_bytes`: the limit; `other_bytes`: host bytes held elsewhere that count too (the
  // prefix index's entries).
  HostBudget(uint64_t budget_bytes, std::function<uint64_t()> other_bytes)
      : budget_(budget_bytes), other_bytes_(std::move(other_bytes)) {}

  // A reservation of `more` bytes, or RESOURCE_EXHAUSTED.
  absl::StatusOr<HostReservation> Reserve(uint64_t more, absl::string_view what);
  // An empty reservation, to grow later.
  HostReservation Empty() { return HostReservation(this); }
  // Brings the totals up to date with the sequence's slot state size and host metadata.
  void Account(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  uint64_t budget() const { return budget_; }
  uint64_t host_bytes() const { return host_bytes_.load(); }
  uint64_t slot_state_bytes() const { return slot_state_bytes_.load(); }

 private:
  friend class HostReservation;
  absl::Status Grow(HostReservation& reservation, uint64_t more, absl::string_view what);

  const uint64_t budget_;
  const std::function<uint64_t()> other_bytes_;
  std::atomic<uint64_t> slot_state_bytes_{0};
  std::atomic<uint64_t> host_bytes_{0};     // Sequence::host_bytes() of every sequence
  std::atomic<uint64_t> host_reserved_{0};  // granted to calls in flight
};

}  // namespace kvmem::engine
