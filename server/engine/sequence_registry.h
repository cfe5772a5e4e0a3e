#pragma once
// SequenceRegistry: every live sequence by id, the calls in flight on each, and leases.
// Finding a sequence counts a call on it (SequenceRef) under the registry lock, which the
// lease reaper takes too, so a sequence with a call in flight never lapses. The registry
// lock is never held while waiting for a sequence's lock (lock order: Sequence::mu, then
// the registry's).
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/common/mutex.h"
#include "server/engine/clock.h"
#include "server/engine/sequence.h"

namespace kvmem::engine {

// A found sequence, counted in its calls in flight until the handle goes (so that the lease
// reaper leaves it alone), locked or not.
class SequenceRef {
 public:
  explicit SequenceRef(std::shared_ptr<Sequence> seq) : seq_(std::move(seq)) {}
  SequenceRef(SequenceRef&& other) noexcept;
  SequenceRef& operator=(SequenceRef&&) = delete;
  ~SequenceRef();
  void LockNow() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    kvmem::Lock(&seq_->mu);
    locked_ = true;
  }
  void UnlockNow() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (locked_) kvmem::Unlock(&seq_->mu);
    locked_ = false;
  }
  Sequence& operator*() const { return *seq_; }
  Sequence* operator->() const { return seq_.get(); }

 private:
  std::shared_ptr<Sequence> seq_;
  bool locked_ = false;
};

class SequenceRegistry {
 public:
  SequenceRegistry(const Clock* clock, absl::Duration default_lease, absl::Duration max_lease)
      : clock_(clock), default_lease_(default_lease), max_lease_(max_lease) {}

  uint64_t NewId();
  void Insert(const std::shared_ptr<Sequence>& seq);
  // Removes the sequence; NOT_FOUND if it is not there.
  absl::StatusOr<std::shared_ptr<Sequence>> Take(uint64_t sequence_id);
  std::vector<std::shared_ptr<Sequence>> TakeAll();
  // Every sequence now (unlocked), and how many.
  std::vector<std::shared_ptr<Sequence>> All() const;
  size_t size() const;

  // OK when sequence `sequence_id` is there and belongs to `owner` (Sequence::owner); else
  // the NOT_FOUND of an id never created, whichever it is: another tenant's id tells its
  // caller nothing.
  absl::Status CheckOwner(uint64_t sequence_id, absl::string_view owner) const;
  // Finds a sequence without locking it; NOT_FOUND if it is gone.
  absl::StatusOr<SequenceRef> Find(uint64_t sequence_id);
  // Finds and locks a sequence that may be used: NOT_FOUND if it is gone (or released),
  // DATA_LOSS if it was poisoned.
  absl::StatusOr<SequenceRef> Lock(uint64_t sequence_id);
  // Lock() for a call that changes the sequence: also FAILED_PRECONDITION while an
  // AppendSession is open on it or while it is frozen for a move (NotMoving).
  absl::StatusOr<SequenceRef> LockForChange(uint64_t sequence_id);
  // The error for a locked sequence that can no longer serve (released or poisoned).
  static absl::Status Unusable(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // FAILED_PRECONDITION while an AppendSession is open on the sequence.
  static absl::Status NotAppending(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // FAILED_PRECONDITION while the sequence is frozen for a move to another kvmemd
  // (Sequence::move_export, until its hold lapses).
  absl::Status NotMoving(const Sequence& seq) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // NotMoving for a call about to change the sequence: an export whose hold has lapsed ends
  // here, its block references given back through `unref` (set_unref), so that blocks a
  // lapsed export held do not outlive what the sequence does next.
  absl::Status EndLapsedExport(Sequence& seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // How EndLapsedExport gives references back (the engine's pool). Set before use.
  void set_unref(std::function<void(const std::vector<store::BlockId>&)> unref) {
    unref_ = std::move(unref);
  }

  // A requested lease checked against the limits; zero asks for the default.
  absl::StatusOr<absl::Duration> ResolveLease(absl::Duration lease) const;
  absl::Time Now() const { return clock_->Now(); }
  // Moves the sequence's lease deadline to now + its lease.
  void Renew(Sequence& seq) const;
  // Renews each sequence's lease; per id, OK or why not (NOT_FOUND, DATA_LOSS). A lease
  // renewed here cannot lapse before the time it reports: the renewal and the reaper's
  // check take the same lock.
  // With `owner`, another owner's sequence is answered as an unknown one.
  std::vector<absl::Status> KeepAlive(absl::Span<const uint64_t> sequence_ids,
                                      const std::string* owner = nullptr);
  // Removes and returns every sequence whose lease has lapsed and has no call in flight.
  std::vector<std::shared_ptr<Sequence>> TakeExpired();

 private:
  const Clock* const clock_;
  std::function<void(const std::vector<store::BlockId>&)> unref_;
  const absl::Duration default_lease_;
  const absl::Duration max_lease_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  // From a random start per daemon (FirstId): a kvmemd restarted under its clients gives
  // no id they held to another sequence, so that a call naming one finds NOT_FOUND instead
  // of another request's cache.
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = FirstId();
  static uint64_t FirstId();
};

}  // namespace kvmem::engine
