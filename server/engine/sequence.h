#pragma once
// Sequence and Stream: one request's cache as the engine holds it.
//
// A stream (layer, kv_head) keeps its retained slots in `blocks`, each holding a contiguous
// run of live slots [start, start + count); the stream's slot order is block order. The
// per-slot vectors (positions, scores, ...) are aligned with the slots in that order.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/block_format.h"
#include "server/engine/layout.h"
#include "server/engine/stream_planner.h"
#include "server/policy/policy.h"
#include "server/store/block_pool.h"
#include "server/store/slot_state.h"

namespace kvmem::engine {

struct Stream {
  std::vector<StreamBlock> blocks;
  std::vector<int64_t> positions;
  std::vector<float> scores;          // policy score state (EMA or accumulated attention)
  std::vector<float> next_scores;     // staging for a call's new scores (policy.h)
  std::vector<float> history;         // [slot][history_rows]: past attention rows (policy.h)
  std::vector<float> token_entropy;   // NaN where not sent
  std::vector<float> layer_distance;  // NaN where not sent
  std::vector<int64_t> arrival_step;

  size_t size() const { return positions.size(); }
  // Keeps only the slots listed (ascending) in every per-slot vector; `history_rows` is the
  // width of `history`. Never allocates (it only shrinks), so it cannot throw.
  void KeepSlots(const std::vector<uint32_t>& keep, uint32_t history_rows);
  // Host bytes of the per-slot vectors and the block list, by capacity.
  uint64_t host_bytes() const;
};

// Quantization of a sequence: blocks whose slots all lie before the last `recent_tokens`
// of their stream are stored as `type`.
struct QuantConfig {
  std::optional<kernels::QuantType> type;
  uint32_t recent_tokens = 128;
};

struct Sequence {
  Sequence(uint64_t id, Layout layout, std::string policy_name, policy::ParamOverrides params,
           std::unique_ptr<policy::Policy> policy, QuantConfig quant, absl::Duration lease,
           uint32_t epoch_slot)
      : id(id),
        layout(layout),
        format(layout, quant.type),
        quant(quant),
        policy_name(std::move(policy_name)),
        policy_params(std::move(params)),
        policy(std::move(policy)),
        lease(lease),
        epoch_slot(epoch_slot) {}

  const uint64_t id;
  const Layout layout;
  const BlockFormat format;
  const QuantConfig quant;
  const std::string policy_name;
  const policy::ParamOverrides policy_params;
  const std::unique_ptr<policy::Policy> policy;
  const absl::Duration lease;
  const uint32_t epoch_slot;
  uint64_t parent_id = 0;
  // Read by the lease reaper without the sequence lock.
  std::atomic<int64_t> lease_deadline_ns{0};

  // Calls that found this sequence and have not finished; the lease reaper leaves a
  // sequence with calls in flight alone (they renew the lease when they finish).
  std::atomic<int32_t> calls_in_flight{0};

  absl::Mutex mu;
  bool released ABSL_GUARDED_BY(mu) = false;
  // Set when a mutation failed past its point of no return: the blocks may no longer hold
  // what the tables say, so every later call but Release answers DATA_LOSS with this.
  std::string poisoned ABSL_GUARDED_BY(mu);
  // Set with `poisoned`, read without the lock (KeepAlive holds only the registry lock).
  std::atomic<bool> poisoned_flag{false};
  int64_t policy_mark ABSL_GUARDED_BY(mu) = -1;  // CallContext::mark
  bool append_open ABSL_GUARDED_BY(mu) = false;  // an Engine::AppendSession is open
  // References a poisoned sequence holds that no stream names (Engine::KeepOrphans).
  std::vector<store::BlockId> orphan_blocks ABSL_GUARDED_BY(mu);
  std::vector<Stream> streams ABSL_GUARDED_BY(mu);  // index = layer * H + kv_head
  // Where the scores live when the policy has a kernel step (Stream::scores is then empty
  // between calls); null otherwise.
  std::unique_ptr<store::SlotState> slots ABSL_GUARDED_BY(mu);
  uint64_t slot_bytes_accounted ABSL_GUARDED_BY(mu) = 0;  // in Engine's slot_state_bytes_
  uint64_t host_bytes_accounted ABSL_GUARDED_BY(mu) = 0;  // in Engine's host_bytes_
  std::vector<int32_t> token_ids ABSL_GUARDED_BY(mu);
  int64_t last_position ABSL_GUARDED_BY(mu) = -1;
  uint64_t appended ABSL_GUARDED_BY(mu) = 0;
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  uint64_t steps ABSL_GUARDED_BY(mu) = 0;

  uint32_t max_stream_tokens() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  uint64_t retained_slots() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // KV bytes held (ALGORITHMS.md): retained slots x 2 (K,V) x bytes per element, plus the
  // scales of quantized blocks.
  uint64_t kv_bytes() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  uint64_t block_count() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // Pool bytes of the blocks referenced (shared blocks counted in full).
  uint64_t block_bytes_held() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // Host memory this sequence holds outside the pool: its per-stream and per-slot metadata
  // (SlotState memory is counted separately, where it lives).
  uint64_t host_bytes() const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // The invariants every committed state keeps: per stream, every per-slot vector has one
  // entry per retained slot (history: history_rows each; scores: none while they live in
  // the SlotState, whose lengths then agree), positions increase, and the blocks' live
  // slots add up to the retained slots, each block's run inside the block. INTERNAL naming
  // the first broken one.
  absl::Status CheckInvariants(uint32_t history_rows) const ABSL_SHARED_LOCKS_REQUIRED(mu);
};

}  // namespace kvmem::engine
