#pragma once
// WritePlans: K/V written in place (DESIGN.md, data plane 4). A plan says where the next
// `tokens` tokens of every stream of a sequence go: the free tail of the stream's private
// last block when they fit there, else a fresh block of the plan's own. A same-host client
// writes the K/V rows there itself and then commits "n tokens written at plan P" (an
// AppendSession's AddWritten) with no K/V bytes in the call.
//
// Contract:
// - One plan per sequence; making one drops the one before. The plan holds a pool
//   reference on every block it names, so none is freed or reused while a client may write
//   into it: a write through a plan lands in slots no table names, whatever happens to the
//   sequence meanwhile, until the plan is committed, replaced or the sequence released.
// - A commit is accepted only for the sequence's current plan, made on the table version
//   the sequence still has (nothing changed a block list since) and whose tail blocks are
//   still private; anything else is FAILED_PRECONDITION and changes nothing (the plan
//   stays for a retry only when it is still current and valid).
// - The daemon does not read the K/V a client wrote (not for finiteness either): a plan is
//   opt-in (kvmemd --in_place_writes) and serves one trust domain.
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "server/engine/failpoints.h"
#include "server/engine/sequence.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// A plan as its client sees it.
struct PlanView {
  uint64_t id = 0;
  uint32_t tokens = 0;
  // Per stream (layer * H + kv_head): the pool offset of the block and the slot of the first
  // token; token i's K row is at block_offsets[s] + slot * row_bytes + i * row_bytes, its V
  // row block_tokens rows further (kernels/block_layout.h).
  std::vector<uint64_t> block_offsets;
  std::vector<uint32_t> first_slots;
};

class WritePlans {
 public:
  WritePlans(store::BlockPool* pool, Failpoints* failpoints)
      : pool_(pool), failpoints_(failpoints) {}

  // A new plan for `tokens` (1 to the block's tokens) more tokens of every stream; the
  // sequence's plan before it goes. RESOURCE_EXHAUSTED when the pool has no fresh blocks
  // for it (the sequence then has no plan).
  absl::StatusOr<PlanView> Make(Sequence& seq, uint32_t tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Whether `n` tokens written at plan `id` may commit now (see the contract).
  absl::Status CheckCommit(const Sequence& seq, uint64_t id, size_t n) const
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Gives back the plan's references (after its commit, or to drop it).
  void Drop(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  store::BlockPool* pool() const { return pool_; }

 private:
  store::BlockPool* const pool_;
  Failpoints* const failpoints_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace kvmem::engine
