#pragma once
// AppendSession: the append transaction. Each chunk is checked and written into blocks the
// session owns as it arrives (new blocks, or the free tail of a private last block: nothing
// a table names), so no chunk waits in memory; Commit makes them all the sequence's at once,
// into capacity reserved before anything changes. Destroyed uncommitted (an error, a
// cancelled or broken stream), it gives its blocks back and the sequence is as it was.
// While a session is open, other changes to the sequence are FAILED_PRECONDITION; reads go
// on. A decode step's token fits every stream's last block: it is written into the free
// tails and the commit lengthens each last entry, without planning new block lists.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/engine/engine_types.h"
#include "server/engine/failpoints.h"
#include "server/engine/host_budget.h"
#include "server/engine/prefix_publisher.h"
#include "server/engine/sequence.h"
#include "server/engine/sequence_registry.h"
#include "server/engine/stream_planner.h"
#include "server/engine/table_versions.h"
#include "server/engine/telemetry.h"
#include "server/engine/write_plans.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// What an append works with (owned by the Engine, which outlives every session).
struct AppendRooms {
  store::BlockPool* pool = nullptr;
  store::Backend* backend = nullptr;
  HostBudget* budget = nullptr;
  TableVersions* versions = nullptr;
  const SequenceRegistry* registry = nullptr;
  PrefixPublisher* publisher = nullptr;
  Telemetry* telemetry = nullptr;
  Failpoints* failpoints = nullptr;
  WritePlans* plans = nullptr;
  uint64_t max_append_bytes = 0;
};

class AppendSession {
 public:
  // Opens a session on a locked sequence. `hold_lock`: the lock stays held until the session
  // ends (a unary Append, a batch entry); else each Add and the Commit take it. `publish`:
  // the commit publishes the new version (false inside a folded step, which does so once
  // at its end). FAILED_PRECONDITION if a session is open already.
  static absl::StatusOr<std::unique_ptr<AppendSession>> Begin(const AppendRooms& rooms,
                                                              SequenceRef ref, bool hold_lock,
                                                              bool publish = true);
  ~AppendSession();
  AppendSession(const AppendSession&) = delete;
  AppendSession& operator=(const AppendSession&) = delete;

  // Any error ends the session: later calls return it, nothing is applied.
  absl::Status Add(const AppendChunk& chunk);
  // The session's only chunk, its K/V written in place by the client at the sequence's
  // write plan `plan_id` (WritePlans): `chunk` carries positions and per-token signals but
  // no K/V. The commit takes the planned slots and gives the plan back; a session that ends
  // uncommitted leaves the plan as it was. Needs a session that holds the lock.
  absl::Status AddWritten(const AppendChunk& chunk, uint64_t plan_id);
  // Applies every chunk; with `held`, the result carries the update of that table.
  absl::StatusOr<AppendResult> Commit(const std::optional<HeldTable>& held = std::nullopt);

  // For the sessions of a batch (StepBatch), Commit in parts: PrepareCommit takes what the
  // commit needs (host budget, room in every per-slot vector); AppendSlotsOfMany appends
  // the new slots of every prepared session's slot state together (store::
  // AppendSlotStates: one round trip per CUDA device), a session whose append fails ending
  // with that error; then each Commit completes. An error ends the session.
  absl::Status PrepareCommit();
  static void AppendSlotsOfMany(absl::Span<AppendSession* const> sessions);
  // Also for a batch: after DeferWrites, Add leaves the chunk's K/V (and the copy of a
  // shared last block) to WriteMany, which writes every session's at once (one move, one
  // write and one synchronization on the backend) before the commits; a session whose
  // writes fail ends with that error. The chunks must live until then.
  void DeferWrites() { defer_writes_ = true; }
  static void WriteMany(absl::Span<AppendSession* const> sessions);

 private:
  AppendSession(const AppendRooms& rooms, SequenceRef seq, bool hold_lock, bool publish);
  absl::Status AddLocked(const AppendChunk& chunk);
  absl::Status AddWrittenLocked(const AppendChunk& chunk, uint64_t plan_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq_->mu);
  // Checks the chunk and reserves what staging it takes (the first half of every Add).
  absl::Status CheckAndReserve(const Sequence& seq, const AppendChunk& chunk, bool written)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Stages the chunk's positions, ids and signals for the commit (the second half).
  void Stage(const AppendChunk& chunk);
  // PrepareCommit's work, under the sequence's lock.
  absl::Status PrepareLocked();
  absl::StatusOr<AppendResult> CommitLocked(const std::optional<HeldTable>& held);
  // Whether `n` more slots fit every stream's last block after what the session wrote
  // there: a private layout block (its free tail is nothing a table names).
  bool TailsFit(const Sequence& seq, size_t n) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Writes the chunk into those free tails.
  absl::Status WriteTails(const Sequence& seq, const AppendChunk& chunk)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Plans each stream's tail (its last entry, what the tails took included) from here on.
  void StartPlans(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Writes the chunk into blocks the plans take (allocated, or copied when shared).
  absl::Status PlanBlocks(const Sequence& seq, const AppendChunk& chunk)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  uint64_t staged_bytes() const {
    return positions_.capacity() * 8 +
           (token_ids_.capacity() + token_entropy_.capacity() + layer_distance_.capacity()) * 4;
  }

  const AppendRooms rooms_;
  // For the append's latency (monotonic: the injectable clock is for leases).
  const std::chrono::steady_clock::time_point started_;
  HostReservation staged_reservation_;  // what the staged vectors may take, until the end
  SequenceRef seq_;  // counted in flight (the reaper waits); locked throughout if hold_lock_
  const bool hold_lock_;
  const bool publish_;
  OpBatch batch_;  // allocated: every block the session took; dropped: copied-on-write
  // While every chunk fitted the streams' last blocks: no plans, and the slots written into
  // each last block's free tail.
  bool tails_only_ = true;
  uint32_t tail_slots_ = 0;
  // Once a chunk did not: stream s's planned tail, its entries from tail_from_[s] on (the
  // last block when the plans started, then what the chunks added), all the plan touches.
  std::vector<std::vector<StreamBlock>> new_blocks_;
  std::vector<size_t> tail_from_;
  std::vector<int64_t> positions_;
  std::vector<int32_t> token_ids_;
  std::vector<float> token_entropy_, layer_distance_;
  int64_t last_position_ = -1;
  size_t chunks_ = 0;
  bool written_ = false;  // the chunk was written in place: the commit gives the plan back
  absl::Status broken_;
  bool defer_writes_ = false;
  OpBatch deferred_;                                   // moves and writes left to WriteMany
  bool prepared_ = false;                              // PrepareCommit took what Commit needs
  std::optional<HostReservation> commit_reservation_;  // the commit's host memory
  std::optional<HostReservation> device_reservation_;  // its slot state's device memory
  bool slots_appended_ = false;  // the slot state holds the new slots (its length grew)
  bool committed_ = false;
};

}  // namespace kvmem::engine
