#include "server/engine/append_session.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/block_layout.h"
#include "server/engine/decision_applier.h"
#include "server/engine/guard.h"
#include "server/engine/input_checks.h"

namespace kvmem::engine {

absl::StatusOr<std::unique_ptr<AppendSession>> AppendSession::Begin(const AppendRooms& rooms,
                                                                    SequenceRef ref, bool hold_lock,
                                                                    bool publish) {
  Sequence& seq = *ref;
  seq.mu.AssertHeld();  // callers pass a locked sequence
  if (absl::Status s = SequenceRegistry::NotAppending(seq); !s.ok()) return s;
  if (absl::Status s = rooms.registry->EndLapsedExport(seq); !s.ok()) return s;
  const int64_t last_position = seq.last_position();
  // Made first: a throw here must not leave the sequence marked as appending for good.
  auto session =
      std::unique_ptr<AppendSession>(new AppendSession(rooms, std::move(ref), hold_lock, publish));
  seq.set_append_open(true);
  session->last_position_ = last_position;
  if (!hold_lock) session->seq_.UnlockNow();  // each Add and the Commit lock it themselves
  return session;
}

AppendSession::AppendSession(const AppendRooms& rooms, SequenceRef seq, bool hold_lock,
                             bool publish)
    : rooms_(rooms),
      started_(std::chrono::steady_clock::now()),
      staged_reservation_(rooms.budget->Empty(seq->shared_host_share())),
      seq_(std::move(seq)),
      hold_lock_(hold_lock),
      publish_(publish) {}

AppendSession::~AppendSession() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (committed_) return;
  std::optional<kvmem::MutexLock> lock;
  if (!hold_lock_) lock.emplace(&seq_->mu);
  seq_->set_append_open(false);
  // Slots appended for a commit that did not come (past every length: DropNewest only
  // shortens the book).
  if (slots_appended_) seq_->slots()->DropNewest(static_cast<uint32_t>(positions_.size()));
  rooms_.pool->Unref(batch_.allocated);
}

absl::Status AppendSession::Add(const AppendChunk& chunk) {
  absl::Status s = GuardHostMemory("Append", [&] { return AddLocked(chunk); });
  if (!s.ok()) broken_ = s;
  return s;
}

absl::Status AppendSession::AddLocked(const AppendChunk& chunk) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (!broken_.ok()) return broken_;
  std::optional<kvmem::MutexLock> lock;
  if (!hold_lock_) lock.emplace(&seq_->mu);
  Sequence& seq = *seq_;
  if (absl::Status s = SequenceRegistry::Unusable(seq); !s.ok()) return s;
  if (absl::Status s = CheckAndReserve(seq, chunk, /*written=*/false); !s.ok()) return s;
  const size_t n = chunk.positions.size();
  if (tails_only_ && TailsFit(seq, n)) {
    if (absl::Status s = WriteTails(seq, chunk); !s.ok()) return s;
  } else {
    if (absl::Status s = PlanBlocks(seq, chunk); !s.ok()) return s;
  }
  Stage(chunk);
  return absl::OkStatus();
}

absl::Status AppendSession::CheckAndReserve(const Sequence& seq, const AppendChunk& chunk,
                                            bool written) {
  if (absl::Status s =
          CheckChunk(seq, rooms_.max_append_bytes, chunk, chunks_, &last_position_, written);
      !s.ok()) {
    return s;
  }
  const size_t n = chunk.positions.size();
  // What the chunk stages on the host until Commit (position, token id, two signals).
  // Reserved until the session ends: staged bytes count against the budget although no
  // sequence holds them yet.
  const uint64_t staged_after = (staged_bytes() + n * (8 + 4 + 4 + 4)) * 2;
  if (staged_after > staged_reservation_.bytes()) {
    return staged_reservation_.Grow(staged_after - staged_reservation_.bytes(), "Append");
  }
  return absl::OkStatus();
}

void AppendSession::Stage(const AppendChunk& chunk) {
  const size_t n = chunk.positions.size();
  positions_.insert(positions_.end(), chunk.positions.begin(), chunk.positions.end());
  if (chunk.token_ids.empty()) {
    token_ids_.insert(token_ids_.end(), n, -1);
  } else {
    token_ids_.insert(token_ids_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
  }
  if (chunk.token_entropy.empty()) {
    token_entropy_.insert(token_entropy_.end(), n, std::nanf(""));
  } else {
    token_entropy_.insert(token_entropy_.end(), chunk.token_entropy.begin(),
                          chunk.token_entropy.end());
  }
  if (chunk.layer_distance.empty()) {
    layer_distance_.insert(layer_distance_.end(), n, std::nanf(""));
  } else {
    layer_distance_.insert(layer_distance_.end(), chunk.layer_distance.begin(),
                           chunk.layer_distance.end());
  }
  ++chunks_;
}

absl::Status AppendSession::AddWritten(const AppendChunk& chunk, uint64_t plan_id) {
  absl::Status s = GuardHostMemory("Append", [&] {
    if (!broken_.ok()) return broken_;
    if (!hold_lock_ || chunks_ != 0 || rooms_.plans == nullptr) {
      return absl::InternalError("append: tokens written in place need a fresh locked session");
    }
    seq_->mu.AssertHeld();
    return AddWrittenLocked(chunk, plan_id);
  });
  if (!s.ok()) broken_ = s;
  return s;
}

absl::Status AppendSession::AddWrittenLocked(const AppendChunk& chunk, uint64_t plan_id) {
  Sequence& seq = *seq_;
  seq.mu.AssertHeld();  // seq_'s, which the analysis does not see through the reference
  if (absl::Status s = SequenceRegistry::Unusable(seq); !s.ok()) return s;
  const size_t n = chunk.positions.size();
  if (absl::Status s = rooms_.plans->CheckCommit(seq, plan_id, n); !s.ok()) return s;
  if (absl::Status s = CheckAndReserve(seq, chunk, /*written=*/true); !s.ok()) return s;
  const Sequence::WritePlan& plan = *seq.plan();
  bool all_tails = true;
  for (const Sequence::WritePlan::Target& t : plan.streams) all_tails = all_tails && !t.fresh;
  if (all_tails) {
    tail_slots_ = static_cast<uint32_t>(n);  // the tails hold the tokens: the decode step
  } else {
    // The session's own reference on each fresh block (the plan keeps its own until the
    // commit): an uncommitted session gives back only its own.
    std::vector<store::BlockId> fresh;
    for (const Sequence::WritePlan::Target& t : plan.streams) {
      if (t.fresh) fresh.push_back(t.block);
    }
    batch_.allocated.reserve(fresh.size());
    StartPlans(seq);
    for (size_t s = 0; s < plan.streams.size(); ++s) {
      const Sequence::WritePlan::Target& t = plan.streams[s];
      if (t.fresh) {
        new_blocks_[s].push_back(StreamBlock{t.block, 0, static_cast<uint32_t>(n)});
      } else {
        new_blocks_[s].back().count += static_cast<uint32_t>(n);
        new_blocks_[s].back().version = 0;  // slots written: stamped by the commit
      }
    }
    rooms_.pool->Ref(fresh);
    batch_.allocated.insert(batch_.allocated.end(), fresh.begin(), fresh.end());
  }
  Stage(chunk);
  written_ = true;
  return absl::OkStatus();
}

bool AppendSession::TailsFit(const Sequence& seq, size_t n) const {
  const uint32_t B = seq.format().block_tokens();
  for (const Stream& st : seq.streams()) {
    if (st.blocks().empty()) return false;
    const StreamBlock& last = st.blocks().back();
    if (last.precision != Precision::kLayout || last.start + last.count + tail_slots_ + n > B ||
        rooms_.pool->refs(last.id) > 1) {
      return false;
    }
  }
  return true;
}

absl::Status AppendSession::WriteTails(const Sequence& seq, const AppendChunk& chunk) {
  const uint32_t B = seq.format().block_tokens();
  const uint64_t row = seq.layout().row_bytes();
  const size_t n = chunk.positions.size();
  const kernels::LayoutBlock plane{B, row};
  std::vector<store::WriteOp> writes;
  writes.reserve(2 * seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const StreamBlock& last = seq.streams()[s].blocks().back();
    const uint32_t slot = last.start + last.count + tail_slots_;
    const uint64_t off = rooms_.pool->offset(last.id);
    const uint64_t src = uint64_t{s} * n * row;  // stream s of [L][H][n][D]
    writes.push_back({chunk.k.data() + src, off + plane.k_offset(slot), n * row});
    writes.push_back({chunk.v.data() + src, off + plane.v_offset(slot), n * row});
  }
  if (defer_writes_) {
    deferred_.writes.insert(deferred_.writes.end(), writes.begin(), writes.end());
  } else {
    absl::Status io = rooms_.backend->Write(writes);
    if (io.ok()) io = rooms_.backend->Synchronize();
    if (!io.ok()) return io;
  }
  tail_slots_ += static_cast<uint32_t>(n);
  return absl::OkStatus();
}

void AppendSession::StartPlans(const Sequence& seq) {
  new_blocks_.resize(seq.streams().size());
  tail_from_.resize(seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const std::vector<StreamBlock>& blocks = seq.streams()[s].blocks();
    const size_t from = blocks.empty() ? 0 : blocks.size() - 1;
    tail_from_[s] = from;
    new_blocks_[s].assign(blocks.begin() + static_cast<ptrdiff_t>(from), blocks.end());
    // What the earlier chunks wrote into the last block's free tail, as the plan's own.
    if (!new_blocks_[s].empty()) new_blocks_[s].back().count += tail_slots_;
  }
  tails_only_ = false;
}

absl::Status AppendSession::PlanBlocks(const Sequence& seq, const AppendChunk& chunk) {
  if (tails_only_) StartPlans(seq);
  const size_t n = chunk.positions.size();
  // Blocks for this chunk (and the copy of a shared last block), all or none.
  OpBatch batch;
  StreamPlanner planner(seq.format(), rooms_.pool, &batch, rooms_.failpoints, seq.tenant());
  uint64_t needed = 0;
  for (const std::vector<StreamBlock>& blocks : new_blocks_) {
    needed += planner.BlocksForAppend(blocks, n);
  }
  std::vector<store::BlockId> reserve;
  Failpoints* failpoints = rooms_.failpoints;
  if (failpoints != nullptr && needed > 0 && failpoints->Hit(Failpoints::kAllocate)) {
    return absl::ResourceExhaustedError("pool: allocation failed (failpoint)");
  }
  // Room first (at least doubling), so that the blocks, once taken, are noted without a throw.
  if (batch_.allocated.capacity() - batch_.allocated.size() < needed) {
    batch_.allocated.reserve(
        std::max(batch_.allocated.size() + needed, 2 * batch_.allocated.capacity()));
  }
  if (absl::Status s = rooms_.pool->AllocateMany(
          static_cast<uint32_t>(seq.format().block_bytes(Precision::kLayout)), needed, &reserve,
          store::BlockPool::Use::kGrow, seq.tenant());
      !s.ok()) {
    return s;
  }
  // From here the blocks are the session's: the destructor gives them back on failure.
  batch_.allocated.insert(batch_.allocated.end(), reserve.begin(), reserve.end());
  if (needed > 0) Failpoints::ThrowIfHit(failpoints, Failpoints::kHostAlloc);
  planner.Reserve(std::move(reserve));
  const uint64_t row = seq.layout().row_bytes();
  for (size_t s = 0; s < new_blocks_.size(); ++s) {
    const uint64_t src = uint64_t{s} * n * row;  // stream s of [L][H][n][D]
    const AppendRun run{chunk.k.data() + src, chunk.v.data() + src, static_cast<uint32_t>(n)};
    if (absl::Status st = planner.Append(new_blocks_[s], absl::MakeConstSpan(&run, 1)); !st.ok()) {
      return st;
    }
  }
  // The count above may have included a copy of a shared last block that another sequence
  // released meanwhile (sharing can end without this sequence's lock, never begin): the
  // plan then wrote in place, and the block set aside for the copy goes back.
  for (store::BlockId unused : planner.unused_reserve()) {
    batch_.allocated.erase(std::find(batch_.allocated.begin(), batch_.allocated.end(), unused));
    rooms_.pool->Unref({unused});
  }
  batch_.dropped.insert(batch_.dropped.end(), batch.dropped.begin(), batch.dropped.end());
  // Written now, where no table looks: the session's blocks or a private block's free tail
  // (a shared last block is copied into a session block first: the moves). In a batch,
  // with the other sessions' (WriteMany).
  if (defer_writes_) {
    deferred_.moves.insert(deferred_.moves.end(), batch.moves.begin(), batch.moves.end());
    deferred_.writes.insert(deferred_.writes.end(), batch.writes.begin(), batch.writes.end());
    return absl::OkStatus();
  }
  absl::Status io = rooms_.backend->Move(batch.moves);
  if (io.ok()) io = rooms_.backend->Write(batch.writes);
  if (io.ok()) io = rooms_.backend->Synchronize();
  if (!io.ok()) return io;
  for (const store::MoveOp& op : batch.moves) rooms_.telemetry->bytes_moved += op.bytes;

  return absl::OkStatus();
}

absl::StatusOr<AppendResult> AppendSession::Commit(const std::optional<HeldTable>& held) {
  return GuardHostMemory("Append", [&] { return CommitLocked(held); });
}

absl::Status AppendSession::PrepareCommit() {
  absl::Status s = GuardHostMemory("Append", [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!broken_.ok()) return broken_;
    std::optional<kvmem::MutexLock> lock;
    if (!hold_lock_) lock.emplace(&seq_->mu);
    if (absl::Status s = SequenceRegistry::Unusable(*seq_); !s.ok()) return s;
    return PrepareLocked();
  });
  if (!s.ok()) broken_ = s;
  return s;
}

absl::Status AppendSession::PrepareLocked() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Sequence& seq = *seq_;
  seq.mu.AssertHeld();  // by the session, or by the call
  const uint64_t total = positions_.size();
  if (total == 0) return absl::InvalidArgumentError("positions: at least one token is required");
  const uint32_t history_rows = seq.policy().history_rows();
  // What the room below takes, exactly.
  uint64_t growth = seq.SlotGrowth(total);
  for (size_t s = 0; s < new_blocks_.size(); ++s) {  // (no plans: the lists keep their length)
    growth += seq.streams()[s].BlockListGrowth(tail_from_[s], new_blocks_[s].size(),
                                               new_blocks_[s].capacity());
  }
  absl::StatusOr<HostReservation> host =
      rooms_.budget->Reserve(growth, "Append", seq.shared_host_share());
  if (!host.ok()) return host.status();
  absl::StatusOr<HostReservation> device =
      rooms_.budget->ReserveDevice(seq.DeviceSlotGrowth(total), "Append", seq.shared_host_share());
  if (!device.ok()) return device.status();
  commit_reservation_.emplace(*std::move(host));
  device_reservation_.emplace(*std::move(device));
  // Room for the new slots in every per-slot vector, before anything changes: the commit
  // then only fills reserved capacity and cannot throw.
  // (Capacity grows geometrically: one token per call must not copy every vector.)
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    seq.stream(s).Reserve(total, history_rows);
    // (From 0 the new list is swapped in whole: nothing to make room in.)
    if (!tails_only_ && tail_from_[s] > 0) {
      seq.stream(s).ReserveBlocks(tail_from_[s] + new_blocks_[s].size());
    }
  }
  seq.ReserveTokens(total);
  prepared_ = true;
  return absl::OkStatus();
}

void AppendSession::WriteMany(absl::Span<AppendSession* const> sessions) {
  std::vector<AppendSession*> writers;
  std::vector<absl::Span<const store::MoveOp>> moves;
  std::vector<store::WriteOp> writes;
  try {
    for (AppendSession* session : sessions) {
      const OpBatch& d = session->deferred_;
      if (!session->broken_.ok() || (d.moves.empty() && d.writes.empty())) continue;
      writers.push_back(session);
      moves.push_back(d.moves);
      writes.insert(writes.end(), d.writes.begin(), d.writes.end());
    }
  } catch (const std::bad_alloc&) {
    writers.clear();  // nothing written: every session with writes ends
    for (AppendSession* session : sessions) {
      if (!session->deferred_.moves.empty() || !session->deferred_.writes.empty()) {
        session->broken_ = absl::ResourceExhaustedError("Append: out of host memory");
      }
    }
    return;
  }
  if (writers.empty()) return;
  // Sessions write only into blocks of their own (a shared block is copied first), so the
  // moves of all (disjoint batches), then the writes of all, keep each session's order.
  const AppendRooms& rooms = writers[0]->rooms_;
  absl::Status io = rooms.backend->MoveDisjoint(moves);
  if (io.ok()) io = rooms.backend->Write(writes);
  if (io.ok()) io = rooms.backend->Synchronize();
  for (AppendSession* session : writers) {
    if (!io.ok()) {
      // Each alone, then (one session's bytes must not fail the others): the copies land
      // where no table looks, so running them again is safe.
      const OpBatch& d = session->deferred_;
      absl::Status alone = rooms.backend->Move(d.moves);
      if (alone.ok()) alone = rooms.backend->Write(d.writes);
      if (alone.ok()) alone = rooms.backend->Synchronize();
      if (!alone.ok()) {
        session->broken_ = alone;
        continue;
      }
    }
    for (const store::MoveOp& op : session->deferred_.moves) {
      rooms.telemetry->bytes_moved += op.bytes;
    }
    session->deferred_.moves.clear();
    session->deferred_.writes.clear();
  }
}

void AppendSession::AppendSlotsOfMany(absl::Span<AppendSession* const> sessions) {
  std::vector<store::SlotAppendCall> calls;
  std::vector<AppendSession*> callers;
  for (AppendSession* session : sessions) {
    Sequence& seq = *session->seq_;
    seq.mu.AssertHeld();  // a batch's sessions hold their locks
    if (!session->prepared_ || !session->broken_.ok() || seq.slots() == nullptr) continue;
    const float initial_score = seq.policy().descriptor().initial_score.value_or(std::nanf(""));
    calls.push_back({seq.slots(), session->positions_, initial_score, absl::OkStatus()});
    callers.push_back(session);
  }
  store::AppendSlotStates(absl::MakeSpan(calls));
  for (size_t i = 0; i < calls.size(); ++i) {
    if (calls[i].status.ok()) {
      callers[i]->slots_appended_ = true;
    } else {
      callers[i]->broken_ = calls[i].status;
    }
  }
}

absl::StatusOr<AppendResult> AppendSession::CommitLocked(const std::optional<HeldTable>& held)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (!broken_.ok()) return broken_;
  if (!deferred_.moves.empty() || !deferred_.writes.empty()) {
    return absl::InternalError("append: its K/V was never written (no WriteMany)");
  }
  std::optional<kvmem::MutexLock> lock;
  if (!hold_lock_) lock.emplace(&seq_->mu);
  Sequence& seq = *seq_;
  if (absl::Status s = SequenceRegistry::Unusable(seq); !s.ok()) return s;
  if (!prepared_) {
    if (absl::Status s = PrepareLocked(); !s.ok()) return s;
  }
  const uint64_t total = positions_.size();
  // For the update: a held version past it is a guess at this call's own (TableVersions).
  const uint64_t version_before = seq.version();
  // The slot state exists only for a policy that keeps scores (Sequence::slots).
  const float initial_score = seq.policy().descriptor().initial_score.value_or(std::nanf(""));
  const uint32_t history_rows = seq.policy().history_rows();
  if (seq.slots() && !slots_appended_) {
    if (absl::Status s = seq.slots()->Append(positions_, initial_score); !s.ok()) return s;
    slots_appended_ = true;
  }
  // A copy-on-write makes the table stop naming a shared block: the epoch must change (a
  // reader of the old table must fail before the block's other owners free it), in a
  // write section. Plain appends leave every table-visible byte as it was.
  std::optional<TableVersions::WriteSection> section;
  if (!batch_.dropped.empty()) section.emplace(rooms_.versions, &seq);

  // Nothing here should throw; if something does, the streams may disagree, so the
  // sequence is poisoned on the way out (and keeps what no stream names for Release).
  size_t swapped = 0;  // streams [0, swapped) hold their new block list
  absl::Cleanup poison_on_unwind = [&] {
    seq.mu.AssertHeld();
    if (!tails_only_) KeepOrphans(seq, batch_, new_blocks_, swapped, tail_from_);
    committed_ = true;  // the orphans are the sequence's now
    rooms_.versions->Poison(seq, absl::InternalError("append: its commit was interrupted"))
        .IgnoreError();
  };
  const int64_t arrival = static_cast<int64_t>(seq.steps());
  const uint64_t version = rooms_.versions->NewVersion(seq);
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    if (s == seq.streams().size() / 2) {
      Failpoints::ThrowIfHit(rooms_.failpoints, Failpoints::kCommit);
    }
    Stream& st = seq.stream(s);
    if (tails_only_) {
      st.GrowTail(tail_slots_, version);
    } else {
      st.SwapBlocks(new_blocks_[s], version, tail_from_[s]);
    }
    swapped = s + 1;
    st.AppendSlots(positions_, history_rows, token_entropy_, layer_distance_, arrival);
  }
  seq.RecordAppend(token_ids_, last_position_, total);
  seq.mutable_prefix().compressed_document = false;
  seq.mutable_prefix().compressions = 0;
  // Inside the section: readers of the old table already see the odd word.
  rooms_.pool->Unref(batch_.dropped);
  if (written_) rooms_.plans->Drop(seq);  // its slots are the table's now
  std::move(poison_on_unwind).Cancel();
  committed_ = true;
  seq.set_append_open(false);
  if (section) section->Commit();
  rooms_.budget->Account(seq);
  commit_reservation_.reset();  // what it held is accounted now
  device_reservation_.reset();
  rooms_.telemetry->tokens_appended += total;
  if (PolicyTelemetry* t = rooms_.telemetry->For(seq.policy_name())) {
    t->tokens_appended += total;
    t->append_seconds.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  }
  rooms_.registry->Renew(seq);
  if (publish_) rooms_.versions->Publish(seq);
  // A prompt's blocks, published as they fill (PromptPrefix::auto_publish). Not the
  // append's failure when they cannot be (token ids not sent): they stay unpublished.
  if (seq.prefix().auto_publish) {
    try {
      rooms_.publisher->Publish(seq, UINT64_MAX).IgnoreError();
    } catch (const std::bad_alloc&) {
      // The append stands; the blocks stay unpublished (a later append tries again).
    }
  }
  return AppendResult{seq.appended(), seq.max_stream_tokens(),
                      seq.epoch(),    seq.kv_bytes(),
                      seq.version(),  rooms_.versions->Answer(seq, held, version_before)};
}

}  // namespace kvmem::engine
