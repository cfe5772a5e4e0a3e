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
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/block_format.h"
#include "server/engine/layout.h"
#include "server/engine/stream_planner.h"
#include "server/policy/policy.h"
#include "server/store/block_pool.h"
#include "server/store/slot_state.h"

namespace kvmem::engine {

// One stream's retained slots. Its per-slot vectors stay aligned by construction: they are
// changed only through the methods below, each of which changes all of them.
class Stream {
 public:
  size_t size() const { return positions_.size(); }
  const std::vector<StreamBlock>& blocks() const { return blocks_; }
  absl::Span<const int64_t> positions() const { return positions_; }
  // Policy score state (EMA or accumulated attention); empty while the scores live in the
  // sequence's SlotState (policies with a kernel step), except during a Compress.
  absl::Span<const float> scores() const { return scores_; }
  // [slot][history_rows]: the attention rows of past steps (policy.h).
  absl::Span<const float> history() const { return history_; }
  absl::Span<const float> token_entropy() const { return token_entropy_; }    // NaN: not sent
  absl::Span<const float> layer_distance() const { return layer_distance_; }  // NaN: not sent
  absl::Span<const int64_t> arrival_step() const { return arrival_step_; }

  // Room for `more` slots in every per-slot vector (capacity grows geometrically), so that
  // AppendSlots, which a commit calls, never allocates. May throw; call it before commits.
  void Reserve(size_t more, bool host_scores, uint32_t history_rows);
  // Appends slots to every per-slot vector (into reserved room): their positions, the
  // initial score when the scores live here, zero history, the per-token signals.
  void AppendSlots(absl::Span<const int64_t> positions, std::optional<float> initial_score,
                   uint32_t history_rows, absl::Span<const float> token_entropy,
                   absl::Span<const float> layer_distance, int64_t arrival);
  // Keeps only the slots listed (ascending) in every per-slot vector. Never allocates (it
  // only shrinks), so it cannot throw.
  void KeepSlots(const std::vector<uint32_t>& keep, uint32_t history_rows);
  // Exchanges entries [from, end) of the block list with `other` (a commit installing a
  // planned list, or with `from` > 0 a planned tail: an append plans only its stream's
  // last block and the ones it adds), and stamps `version` on every entry that changed:
  // one the plan marked (version 0: a new block id or slots written), one whose id the
  // old entries lack, or one whose run or precision differs from the same block's old
  // entry. So an entry whose version is not newer than v holds what it held at v.
  // Surviving blocks keep their order, which lets one walk pair them up. `other` gets
  // the old entries. Never allocates when the capacities were reserved: the list's for
  // from + other.size() (ReserveBlocks), other's for the old entries it takes.
  void SwapBlocks(std::vector<StreamBlock>& other, uint64_t version, size_t from = 0);
  void ReserveBlocks(size_t n) {
    if (blocks_.capacity() < n) blocks_.reserve(std::max(n, 2 * blocks_.capacity()));
  }
  // Live slots in layout blocks, live slots in quantized blocks, quantized blocks: what
  // KV bytes are made of (BlockFormat::KvBytes), kept by SwapBlocks.
  uint64_t layout_slots() const { return layout_slots_; }
  uint64_t quantized_slots() const { return quantized_slots_; }
  uint64_t quantized_blocks() const { return quantized_blocks_; }
  // The version of the last commit that changed the block list at all (blocks dropped
  // included).
  uint64_t changed_version() const { return changed_version_; }
  // Records each entry's index as published_index[which] (a version the stream's sequence
  // publishes, Engine::PublishVersion). Only the entries from the first one that moved or
  // is new since the last call for `which` are written.
  void MarkPublished(int which);

  // A policy call's staging: the next scores, one per slot (policy.h). CommitScores makes
  // them the scores; DropStaging gives the memory back.
  absl::Span<float> StageScores();
  void CommitScores() { scores_.swap(next_scores_); }
  void DropStaging() { next_scores_ = {}; }
  // Records one step's attention row in history column `column` (0 past the row's end).
  void RecordHistory(absl::Span<const float> row, size_t column, uint32_t history_rows);
  // Scores that live in a SlotState, brought over for a host call (one per slot) and
  // taken back after it.
  void LoadScores(std::vector<float> scores) { scores_ = std::move(scores); }
  std::vector<float> TakeScores() { return std::exchange(scores_, {}); }

  // Drops every slot and block (Release; the caller has dropped the block references).
  void Clear() { *this = Stream{}; }
  // Host bytes of the per-slot vectors and the block list, by capacity.
  uint64_t host_bytes() const;

 private:
  std::vector<StreamBlock> blocks_;
  uint64_t changed_version_ = 0;
  uint64_t layout_slots_ = 0, quantized_slots_ = 0, quantized_blocks_ = 0;
  // Per published slot: entries [0, n) sit where they sat at its last MarkPublished.
  size_t reindex_from_[2] = {0, 0};
  std::vector<int64_t> positions_;
  std::vector<float> scores_;
  std::vector<float> next_scores_;
  std::vector<float> history_;
  std::vector<float> token_entropy_;
  std::vector<float> layer_distance_;
  std::vector<int64_t> arrival_step_;
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
  // The table version: a new value (unique across sequences) at every commit that changes
  // a block list; each block carries the version at which it last changed.
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  // The table versions at the end of the last two calls that changed it (0: none), and
  // which of the two is the newer. A client holding either gets a delta (the index of
  // every entry it holds is kept for both: StreamBlock::published_index), any other
  // version the whole table. Two, because a call's response carries the update from the
  // version its client held before the call.
  uint64_t published_version[2] ABSL_GUARDED_BY(mu) = {0, 0};
  int newest_published ABSL_GUARDED_BY(mu) = 0;

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
