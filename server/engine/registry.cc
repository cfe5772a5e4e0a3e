// The registry: finding and locking sequences, poisoning, leases and their reaper, and the
// accounting of host memory outside the pool.
#include "absl/strings/str_cat.h"
#include "server/engine/engine.h"
#include "spdlog/spdlog.h"

namespace kvmem::engine {

Engine::SequenceRef::SequenceRef(SequenceRef&& other) noexcept
    : seq_(std::move(other.seq_)), locked_(other.locked_) {
  other.locked_ = false;
}

Engine::SequenceRef::~SequenceRef() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (seq_ == nullptr) return;
  if (locked_) kvmem::Unlock(&seq_->mu);
  seq_->LeaveCall();
}

absl::StatusOr<Engine::SequenceRef> Engine::Find(uint64_t sequence_id) {
  kvmem::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", sequence_id,
                                            " (never created, released, or its lease lapsed)"));
  }
  // Counted under the registry lock, which the reaper holds while it reads the count.
  it->second->EnterCall();
  return SequenceRef(it->second);
}

absl::Status Engine::Unusable(const Sequence& seq) {
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

absl::StatusOr<Engine::SequenceRef> Engine::Lock(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> found = Find(sequence_id);
  if (!found.ok()) return found.status();
  SequenceRef ref(std::move(*found));
  ref.LockNow();
  if (absl::Status s = Unusable(*ref); !s.ok()) return s;
  return ref;
}

absl::StatusOr<Engine::SequenceRef> Engine::LockForChange(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref;
  if (absl::Status s = NotAppending(**ref); !s.ok()) return s;
  return ref;
}

absl::Status Engine::Poison(Sequence& seq, const absl::Status& why) {
  if (seq.Poison(why.message())) {
    ++sequences_poisoned_;
    spdlog::error("sequence {} poisoned: {}", seq.id(), why.ToString());
  }
  // Odd for good: readers of any table of this sequence fail from now on.
  board_->BeginWrite(seq.epoch_slot(), seq.epoch());
  return Unusable(seq);
}

absl::StatusOr<absl::Duration> Engine::ResolveLease(absl::Duration lease) const {
  if (lease == absl::ZeroDuration()) return config_.default_lease;
  if (lease < absl::ZeroDuration() || lease > config_.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat("lease_seconds: ", absl::ToDoubleSeconds(lease),
                                                   " is outside [1, ",
                                                   absl::ToDoubleSeconds(config_.max_lease), "]"));
  }
  return lease;
}

void Engine::Renew(Sequence& seq) {
  seq.set_lease_deadline_ns(absl::ToUnixNanos(clock_->Now() + seq.lease()));
}

absl::StatusOr<CreateResult> Engine::Register(const std::shared_ptr<Sequence>& seq) {
  Renew(*seq);
  CreateResult result{0, static_cast<uint32_t>(absl::ToInt64Seconds(seq->lease())),
                      seq->layout().block_tokens, seq->epoch_slot()};
  {
    kvmem::MutexLock lock(&seq->mu);
    result.epoch = seq->epoch();
    result.version = seq->version();
    seq->NoteAnswered(result.version);  // the client is told it: it may hold it
  }
  kvmem::MutexLock lock(&mu_);
  result.sequence_id = seq->id();
  sequences_.emplace(seq->id(), seq);
  ++telemetry_.sequences_created;
  return result;
}

absl::StatusOr<store::TenantId> Engine::TenantFor(absl::string_view salt) {
  if (salt.empty()) return store::TenantId{0};
  uint64_t quota = config_.tenant_quota_bytes;
  for (const auto& [name, bytes] : config_.tenant_quotas) {
    if (name == salt) quota = bytes;
  }
  if (quota == 0) return store::TenantId{0};  // nothing to count: no registry entry
  kvmem::MutexLock lock(&tenants_mu_);
  if (auto it = tenants_.find(salt); it != tenants_.end()) return it->second;
  absl::StatusOr<store::TenantId> id = pool_->RegisterTenant(std::string(salt), quota);
  if (!id.ok()) return id.status();
  tenants_.emplace(std::string(salt), *id);
  return *id;
}

absl::StatusOr<CreateResult> Engine::RegisterOrRelease(const std::shared_ptr<Sequence>& seq) {
  try {
    return Register(seq);
  } catch (...) {
    kvmem::MutexLock lock(&seq->mu);
    ReleaseLocked(*seq);
    throw;
  }
}

uint64_t Engine::NewVersion(Sequence& seq) {
  seq.set_version(next_version_.fetch_add(1));
  return seq.version();
}

uint64_t Engine::ReleaseLocked(Sequence& seq) {
  uint64_t freed = 0;
  board_->BeginWrite(seq.epoch_slot(), seq.epoch());
  freed += pool_->Unref(seq.TakeOrphans());
  for (const Stream& st : seq.streams()) {
    for (const StreamBlock& b : st.blocks()) freed += pool_->Unref({b.id});
  }
  seq.Clear();
  AccountSlotState(seq);
  board_->Release(seq.epoch_slot());
  return freed;
}

void Engine::AccountSlotState(Sequence& seq) {
  const uint64_t slot_bytes = seq.slots() ? seq.slots()->bytes() : 0;
  const uint64_t host = seq.released() ? 0 : seq.host_bytes();
  // Modular: shrinking subtracts.
  slot_state_bytes_ += slot_bytes - seq.slot_bytes_accounted();
  host_bytes_ += host - seq.host_bytes_accounted();
  seq.set_accounted(slot_bytes, host);
}

uint64_t Engine::host_budget() const {
  return config_.host_metadata_bytes > 0 ? config_.host_metadata_bytes
                                         : config_.pool_bytes / 2 + (64ull << 20);
}

Engine::HostReservation::~HostReservation() {
  if (engine_ != nullptr) engine_->host_reserved_ -= bytes_;
}

absl::Status Engine::HostReservation::Grow(uint64_t more, absl::string_view what) {
  Engine& e = *engine_;
  const uint64_t budget = e.host_budget();
  // Reserved first, then checked against what is in use: of two racing calls, at least the
  // second sees the first's bytes and fails, so the sum never passes the budget.
  const uint64_t reserved = e.host_reserved_.fetch_add(more) + more;
  const uint64_t used = e.host_bytes_.load() + e.slot_state_bytes_.load() + e.prefix_->host_bytes();
  if (more > budget || used + reserved > budget) {
    e.host_reserved_ -= more;
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", more, " more bytes of host metadata; ", used + reserved - more,
        " of the budget of ", budget, " bytes are in use or promised to calls in flight",
        " (--host-metadata-bytes)"));
  }
  bytes_ += more;
  return absl::OkStatus();
}

absl::StatusOr<Engine::HostReservation> Engine::ReserveHost(uint64_t more, absl::string_view what) {
  HostReservation reservation(this);
  if (absl::Status s = reservation.Grow(more, what); !s.ok()) return s;
  return reservation;
}

std::vector<absl::Status> Engine::KeepAlive(absl::Span<const uint64_t> sequence_ids) {
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
      if (it == sequences_.end()) {
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

uint32_t Engine::ExpireLeases() {
  const int64_t now = absl::ToUnixNanos(clock_->Now());
  std::vector<std::shared_ptr<Sequence>> expired;
  {
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
  }
  for (const auto& seq : expired) {
    kvmem::MutexLock lock(&seq->mu);
    const uint64_t freed = ReleaseLocked(*seq);
    spdlog::info("sequence {} released: lease of {}s lapsed ({} blocks freed)", seq->id(),
                 absl::ToInt64Seconds(seq->lease()), freed);
  }
  leases_expired_ += expired.size();
  return static_cast<uint32_t>(expired.size());
}

void Engine::RunLeaseReaper(absl::Duration period, absl::Notification* stop) {
  while (!stop->WaitForNotificationWithTimeout(period)) ExpireLeases();
}

}  // namespace kvmem::engine
