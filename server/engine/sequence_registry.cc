#include "server/engine/sequence_registry.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvmem::engine {
namespace {

absl::Status NoSequence(uint64_t sequence_id) {
  return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", sequence_id,
                                          " (never created, released, or its lease lapsed)"));
}

}  // namespace

SequenceRef::SequenceRef(SequenceRef&& other) noexcept
    : seq_(std::move(other.seq_)), locked_(other.locked_) {
  other.locked_ = false;
}

SequenceRef::~SequenceRef() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (seq_ == nullptr) return;
  if (locked_) kvmem::Unlock(&seq_->mu);
  seq_->LeaveCall();
}

uint64_t SequenceRegistry::FirstId() {
  // 1 + 4096 k for a random k below 2^40: ids stay below 2^53 (exact in a double, for
  // JSON) for 2^40 sequences, and two daemons' first ids coincide once in 2^40.
  std::random_device random;
  const uint64_t k = ((uint64_t{random()} << 32) | random()) & ((uint64_t{1} << 40) - 1);
  return 1 + 4096 * k;
}

uint64_t SequenceRegistry::NewId() {
  kvmem::MutexLock lock(&mu_);
  return next_id_++;
}

void SequenceRegistry::Insert(const std::shared_ptr<Sequence>& seq) {
  kvmem::MutexLock lock(&mu_);
  sequences_.emplace(seq->id(), seq);
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceRegistry::Take(uint64_t sequence_id) {
  kvmem::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return NoSequence(sequence_id);
  std::shared_ptr<Sequence> seq = std::move(it->second);
  sequences_.erase(it);
  return seq;
}

std::vector<std::shared_ptr<Sequence>> SequenceRegistry::TakeAll() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> all;
  {
    kvmem::MutexLock lock(&mu_);
    all.swap(sequences_);
  }
  std::vector<std::shared_ptr<Sequence>> out;
  out.reserve(all.size());
  for (auto& [id, seq] : all) out.push_back(std::move(seq));
  return out;
}

std::vector<std::shared_ptr<Sequence>> SequenceRegistry::All() const {
  kvmem::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Sequence>> all;
  all.reserve(sequences_.size());
  for (const auto& [id, seq] : sequences_) all.push_back(seq);
  return all;
}

size_t SequenceRegistry::size() const {
  kvmem::MutexLock lock(&mu_);
  return sequences_.size();
}

absl::Status SequenceRegistry::CheckOwner(uint64_t sequence_id, absl::string_view owner) const {
  kvmem::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  // The owner never changes (a const member): read without the sequence's lock.
  if (it == sequences_.end() || it->second->owner() != owner) return NoSequence(sequence_id);
  return absl::OkStatus();
}

absl::StatusOr<SequenceRef> SequenceRegistry::Find(uint64_t sequence_id) {
  kvmem::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return NoSequence(sequence_id);
  // Counted under the registry lock, which the reaper holds while it reads the count.
  it->second->EnterCall();
  return SequenceRef(it->second);
}

absl::Status SequenceRegistry::Unusable(const Sequence& seq) {
  if (seq.released()) {
    return absl::NotFoundError(absl::StrCat("sequence_id: sequence ", seq.id(), " was released"));
  }
  if (seq.poisoned()) {
    return absl::DataLossError(absl::StrCat("sequence ", seq.id(), " is poisoned (",
                                            seq.poison_reason(),
                                            "); its cache can no longer be trusted: release it"));
  }
  return absl::OkStatus();
}

absl::Status SequenceRegistry::NotAppending(const Sequence& seq) {
  if (!seq.append_open()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("sequence_id: sequence ", seq.id(),
                   " has an AppendStream open; other changes wait until it ends"));
}

absl::Status SequenceRegistry::NotMoving(const Sequence& seq) const {
  const Sequence::MoveExport& e = seq.move_export();
  if (e.id == 0) return absl::OkStatus();
  const int64_t left_ns = e.until_ns - absl::ToUnixNanos(clock_->Now());
  if (left_ns <= 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "sequence_id: sequence ", seq.id(),
      " is being moved to another kvmemd (ExportSequence); changes wait until the move ends "
      "(FinishExport, or its hold lapses in ",
      (left_ns + 999'999'999) / 1'000'000'000, " s)"));
}

absl::Status SequenceRegistry::EndLapsedExport(Sequence& seq) const {
  if (absl::Status s = NotMoving(seq); !s.ok()) return s;
  if (seq.move_export().id != 0) {
    std::vector<store::BlockId> held = seq.EndMoveExport();
    if (unref_) unref_(held);
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceRef> SequenceRegistry::Lock(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> found = Find(sequence_id);
  if (!found.ok()) return found.status();
  SequenceRef ref(std::move(*found));
  ref.LockNow();
  Sequence& seq = *ref;
  seq.mu.AssertHeld();
  if (absl::Status s = Unusable(seq); !s.ok()) return s;
  return ref;
}

absl::StatusOr<SequenceRef> SequenceRegistry::LockForChange(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref;
  Sequence& seq = **ref;
  seq.mu.AssertHeld();  // locked by Lock
  if (absl::Status s = NotAppending(seq); !s.ok()) return s;
  if (absl::Status s = EndLapsedExport(seq); !s.ok()) return s;
  return ref;
}

absl::StatusOr<absl::Duration> SequenceRegistry::ResolveLease(absl::Duration lease) const {
  if (lease == absl::ZeroDuration()) return default_lease_;
  if (lease < absl::ZeroDuration() || lease > max_lease_) {
    return absl::InvalidArgumentError(absl::StrCat("lease_seconds: ", absl::ToDoubleSeconds(lease),
                                                   " is outside [1, ",
                                                   absl::ToDoubleSeconds(max_lease_), "]"));
  }
  return lease;
}

void SequenceRegistry::Renew(Sequence& seq) const {
  seq.set_lease_deadline_ns(
      std::max(absl::ToUnixNanos(clock_->Now() + seq.lease()), seq.lease_floor_ns()));
}

std::vector<absl::Status> SequenceRegistry::KeepAlive(absl::Span<const uint64_t> sequence_ids,
                                                      const std::string* owner) {
  // Renewed under the registry lock: the reaper, which takes it too, sees either the
  // sequence gone (NOT_FOUND here) or its new deadline. Only outcomes are noted under it; the
  // messages are written after, so that a long list holds the lock for lookups only.
  enum class Renewal { kRenewed, kUnknown, kPoisoned };
  std::vector<Renewal> renewals(sequence_ids.size(), Renewal::kRenewed);
  {
    kvmem::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (size_t i = 0; i < sequence_ids.size(); ++i) {
      auto it = sequences_.find(sequence_ids[i]);
      if (it == sequences_.end() || (owner != nullptr && it->second->owner() != *owner)) {
        renewals[i] = Renewal::kUnknown;
      } else if (it->second->poisoned_relaxed()) {
        // Not renewed: a poisoned sequence is kept only until its client releases it or its
        // lease lapses, so that its blocks come back either way.
        renewals[i] = Renewal::kPoisoned;
      } else {
        it->second->set_lease_deadline_ns(absl::ToUnixNanos(now + it->second->lease()));
      }
    }
  }
  std::vector<absl::Status> results;
  results.reserve(sequence_ids.size());
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    switch (renewals[i]) {
      case Renewal::kRenewed:
        results.push_back(absl::OkStatus());
        break;
      case Renewal::kUnknown:
        results.push_back(
            absl::NotFoundError(absl::StrCat("sequence_ids[", i, "]: no sequence ", sequence_ids[i],
                                             " (never created, released, or its lease lapsed)")));
        break;
      case Renewal::kPoisoned:
        results.push_back(absl::DataLossError(absl::StrCat(
            "sequence_ids[", i, "]: sequence ", sequence_ids[i], " is poisoned; release it")));
        break;
    }
  }
  return results;
}

std::vector<std::shared_ptr<Sequence>> SequenceRegistry::TakeExpired() {
  const int64_t now = absl::ToUnixNanos(clock_->Now());
  std::vector<std::shared_ptr<Sequence>> expired;
  kvmem::MutexLock lock(&mu_);
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    // A sequence with calls in flight is left alone: each renews it when it finishes.
    // Calls take their count under this lock, so none can start on a sequence taken here.
    if (it->second->lease_deadline_ns() < now && it->second->calls_in_flight() == 0) {
      expired.push_back(std::move(it->second));
      sequences_.erase(it++);
    } else {
      ++it;
    }
  }
  return expired;
}

}  // namespace kvmem::engine
