#pragma once
// Sequence and Stream: one request's cache as the engine holds it.
//
// A stream (layer, kv_head) keeps its retained slots in `blocks`, each holding a contiguous
// run of live slots [start, start + count); the stream's slot order is block order. The
// per-slot vectors (positions, scores, ...) are aligned with the slots in that order.
#include <algorithm>
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
#include "server/common/slot_column.h"
#include "server/engine/block_format.h"
#include "server/engine/layout.h"
#include "server/engine/stream_planner.h"
#include "server/policy/policy.h"
#include "server/prefix/prefix_hash.h"
#include "server/store/block_pool.h"
#include "server/store/slot_state.h"

namespace kvmem::engine {

struct HostShare;  // host_budget.h

// One stream's retained slots. Its per-slot vectors stay aligned by construction: they are
// changed only through the methods below, each of which changes all of them.
class Stream {
 public:
  size_t size() const { return positions_.size(); }
  const std::vector<StreamBlock>& blocks() const { return blocks_; }
  absl::Span<const int64_t> positions() const { return positions_.span(); }
  // [slot][history_rows]: the attention rows of past steps (policy.h).
  absl::Span<const float> history() const { return history_.span(); }
  // The per-token signals (NaN where the worker sent none); empty when the stream keeps none.
  absl::Span<const float> token_entropy() const { return token_entropy_.span(); }
  absl::Span<const float> layer_distance() const { return layer_distance_.span(); }
  // Whether the stream keeps the per-token signals: only for a policy that reads them
  // (PolicyDescriptor::append_signals), 8 bytes per slot saved for every other. Set while
  // the stream is empty (Sequence's constructor); copies keep it.
  bool token_signals() const { return token_signals_; }
  void set_token_signals(bool keep) { token_signals_ = keep; }
  // The step each slot arrived at; empty unless the policy reads it
  // (PolicyDescriptor::arrival_steps). Set as token_signals is; copies keep it.
  absl::Span<const int64_t> arrival_step() const { return arrival_step_.span(); }
  bool arrival_steps() const { return arrival_steps_; }
  void set_arrival_steps(bool keep) { arrival_steps_ = keep; }

  // Room for `more` slots in every per-slot vector (capacity grows geometrically), so that
  // AppendSlots, which a commit calls, never allocates. May throw; call it before commits.
  void Reserve(size_t more, uint32_t history_rows);
  // Appends slots to every per-slot vector (into reserved room): their positions, zero
  // history, the per-token signals. (Scores live in the sequence's SlotState.)
  void AppendSlots(absl::Span<const int64_t> positions, uint32_t history_rows,
                   absl::Span<const float> token_entropy, absl::Span<const float> layer_distance,
                   int64_t arrival);
  // Keeps only the slots listed (ascending) in every per-slot vector, closing them up
  // toward the end that moves fewer; slots that leave from the front go without moving the
  // rest. Never allocates (it only shrinks), so it cannot throw.
  void KeepSlots(const KeepSet& keep, uint32_t history_rows);
  // Exchanges entries [from, end) of the block list with `other` (a commit installing a
  // planned list, or with `from` > 0 a planned tail: an append plans only its stream's
  // last block and the ones it adds), and stamps `version` on every entry that changed:
  // one the plan marked (version 0: a new block id or slots written), one whose id the
  // old entries lack, or one whose run or precision differs from the same block's old
  // entry. So an entry whose version is not newer than v holds what it held at v.
  // Surviving blocks keep their order, which lets one walk pair them up. `other` gets
  // the old entries. Never allocates when the capacities were reserved: the list's for
  // from + other.size() (ReserveBlocks), other's for the old entries it takes.
  // With `to` as well, entries [from, to) are exchanged with `other` (a step's eviction
  // plans only the entries it changes), and the entries after them stay as they were,
  // moved up or down as a whole; a middle that grows needs the list's capacity for
  // size() - (to - from) + other.size() (an eviction's only shrinks).
  void SwapBlocks(std::vector<StreamBlock>& other, uint64_t version, size_t from = 0,
                  size_t to = SIZE_MAX);
  // What SwapBlocks does to a one-entry tail that is the last entry with `n` more slots
  // (a private layout block), without the list: the append of a token that fits.
  void GrowTail(uint32_t n, uint64_t version);
  void ReserveBlocks(size_t n) {
    if (blocks_.capacity() < n) blocks_.reserve(std::max(n, 2 * blocks_.capacity()));
  }
  // Bytes by which Reserve(more, ...) would raise host_bytes().
  uint64_t ReserveGrowth(size_t more, uint32_t history_rows) const;
  // The same for SwapBlocks(tail, _, from) of a tail of `tail_size` entries in a vector of
  // `tail_capacity` (with ReserveBlocks(from + tail_size) before it when from > 0).
  uint64_t BlockListGrowth(size_t from, size_t tail_size, size_t tail_capacity) const;
  // Live slots in layout blocks, live slots in quantized blocks, quantized blocks: what
  // KV bytes are made of (BlockFormat::KvBytes), kept by SwapBlocks.
  uint64_t layout_slots() const { return layout_slots_; }
  uint64_t quantized_slots() const { return quantized_slots_; }
  uint64_t quantized_blocks() const { return quantized_blocks_; }
  // The version of the last commit that changed the block list at all (blocks dropped
  // included).
  uint64_t changed_version() const { return changed_version_; }
  // The version of the change before the last one (0: none).
  uint64_t previous_changed_version() const { return previous_changed_version_; }
  // A run of entries the changes since the last MarkPublished before them left as they
  // were (same block, run and precision): entry i of [begin, end) was entry i - shift of
  // the list published at untouched_base(), so that a client holding that version holds
  // it there. A decode step's run (its append, then its eviction, published together) is
  // the entries between its evicted head and its appended tail: a delta names them
  // without reading them (Engine::TableDelta).
  struct UntouchedRun {
    size_t begin = 0, end = 0;
    ptrdiff_t shift = 0;
    size_t size() const { return end - begin; }
  };
  uint64_t untouched_base() const { return untouched_base_; }
  const UntouchedRun& untouched() const { return untouched_; }
  // Records each entry's index as published_index[which] (`version`, which the stream's
  // sequence publishes: Sequence::Publish). Only the entries from the first one that moved
  // or is new since the last call for `which` are written. The next change starts a new
  // untouched run from this list.
  void MarkPublished(int which, uint64_t version);

  // Records one step's attention row in history column `column` (0 past the row's end).
  void RecordHistory(absl::Span<const float> row, size_t column, uint32_t history_rows);

  // Drops every slot and block (Release; the caller has dropped the block references).
  void Clear() { *this = Stream{}; }
  // Becomes a copy of `other`'s slots and blocks as a new table of its own: every entry
  // stamped `version` and no index published yet (a shared compressed document mapped
  // into a new sequence). May throw; call it before the sequence is visible.
  void AdoptFrom(const Stream& other, uint64_t version);
  // Becomes a stream moved from another kvmemd (sequence_move.h): its slots' values as they
  // were there, and `blocks` (this daemon's ids) as a new table stamped `version` with no
  // index published yet. The caller has checked that each column holds one value per slot
  // (history: history_rows; the token signals and arrival steps only where this stream
  // keeps them) and that the blocks' runs hold every slot. May throw (then nothing
  // changed); call it before the sequence is visible.
  void LoadMoved(std::vector<StreamBlock> blocks, uint64_t version, std::vector<int64_t> positions,
                 std::vector<float> history, std::vector<float> token_entropy,
                 std::vector<float> layer_distance, std::vector<int64_t> arrival_steps);
  // Host bytes of the per-slot vectors and the block list, by capacity.
  uint64_t host_bytes() const;

 private:
  // A change that stamped `version`: entries from `touched_from` on are new, moved or
  // changed, the old entries [.., to) were replaced and the ones after it moved by `moved`.
  // Updates the untouched run and the changed versions.
  void RecordChange(uint64_t version, size_t old_size, size_t touched_from, size_t to,
                    ptrdiff_t moved);
  // Makes the list a new table of its own stamped `version`: no index published, no
  // history of changes (AdoptFrom, LoadMoved).
  void StartTable(uint64_t version);
  // Calls f(column, values per slot) on each per-slot column: what Reserve and KeepSlots
  // do to one, they do to all.
  template <typename F>
  void ForEachColumn(uint32_t history_rows, F&& f) {
    ForEachColumnOf(*this, history_rows, f);
  }
  template <typename F>
  void ForEachColumn(uint32_t history_rows, F&& f) const {
    ForEachColumnOf(*this, history_rows, f);
  }
  template <typename Self, typename F>
  static void ForEachColumnOf(Self& st, uint32_t history_rows, F& f) {
    f(st.positions_, size_t{1});
    f(st.history_, size_t{history_rows});
    if (st.token_signals_) {
      f(st.token_entropy_, size_t{1});
      f(st.layer_distance_, size_t{1});
    }
    if (st.arrival_steps_) f(st.arrival_step_, size_t{1});
  }

  std::vector<StreamBlock> blocks_;
  uint64_t changed_version_ = 0;
  uint64_t previous_changed_version_ = 0;
  UntouchedRun untouched_;
  uint64_t untouched_base_ = 0;  // the published version untouched_ is relative to
  uint64_t marked_version_ = 0;  // the version of the last MarkPublished
  bool run_fresh_ = true;        // no change since the last MarkPublished
  uint64_t layout_slots_ = 0, quantized_slots_ = 0, quantized_blocks_ = 0;
  // Per published slot: entries [0, n) sit where they sat at its last MarkPublished.
  size_t reindex_from_[2] = {0, 0};
  SlotColumn<int64_t> positions_;
  SlotColumn<float> history_;  // history_rows values per slot
  bool token_signals_ = true;
  bool arrival_steps_ = true;
  SlotColumn<float> token_entropy_;
  SlotColumn<float> layer_distance_;
  SlotColumn<int64_t> arrival_step_;
};

// Quantization of a sequence: blocks whose slots all lie before the last `recent_tokens`
// of their stream are stored as `type`.
struct QuantConfig {
  std::optional<kernels::QuantType> type;
  uint32_t recent_tokens = 128;
};

// One request's cache. Its identity is fixed at creation; its state changes only under `mu`
// and only through the methods below, which keep:
// - one Stream per (layer, kv_head) from construction to release (each Stream keeps its own
//   per-slot vectors aligned), and a SlotState, where the policy steps on the device, as
//   long as each stream (CheckInvariants checks both after a commit);
// - poisoned for good once poisoned, the reason and the lock-free flag agreeing;
// - table versions that only grow, and published versions that are versions it had;
// - nothing held once released.
class Sequence {
 public:
  Sequence(uint64_t id, Layout layout, std::string policy_name, policy::ParamOverrides params,
           std::unique_ptr<policy::Policy> policy, QuantConfig quant, absl::Duration lease,
           uint32_t epoch_slot, uint64_t parent_id = 0, store::TenantId tenant = 0,
           std::string owner = {})
      : id_(id),
        layout_(layout),
        format_(layout, quant.type),
        quant_(quant),
        policy_name_(std::move(policy_name)),
        policy_params_(std::move(params)),
        policy_(std::move(policy)),
        lease_(lease),
        epoch_slot_(epoch_slot),
        parent_id_(parent_id),
        tenant_(tenant),
        owner_(std::move(owner)),
        streams_(layout.num_streams()) {
    for (Stream& st : streams_) {
      st.set_token_signals(policy_->descriptor().append_signals != 0);
      st.set_arrival_steps(policy_->descriptor().arrival_steps);
    }
  }
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // Identity.
  uint64_t id() const { return id_; }
  const Layout& layout() const { return layout_; }
  const BlockFormat& format() const { return format_; }
  const QuantConfig& quant() const { return quant_; }
  const std::string& policy_name() const { return policy_name_; }
  const policy::ParamOverrides& policy_params() const { return policy_params_; }
  const policy::Policy& policy() const { return *policy_; }
  absl::Duration lease() const { return lease_; }
  uint32_t epoch_slot() const { return epoch_slot_; }
  uint64_t parent_id() const { return parent_id_; }
  // Whose quota the blocks it allocates count against (its cache salt's).
  store::TenantId tenant() const { return tenant_; }
  // The authenticated tenant that created it (PromptPrefix::owner); never changes.
  const std::string& owner() const { return owner_; }
  // Its tenant's share of the host budget (set once, before the sequence is published).
  HostShare* host_share() const { return host_share_.get(); }
  const std::shared_ptr<HostShare>& shared_host_share() const { return host_share_; }
  void set_host_share(std::shared_ptr<HostShare> share) { host_share_ = std::move(share); }

  // Read and written without `mu`. The lease deadline is read by the reaper; calls in
  // flight are those that found this sequence and have not finished, which the reaper
  // leaves alone (they renew the lease when they finish).
  int64_t lease_deadline_ns() const { return lease_deadline_ns_.load(std::memory_order_relaxed); }
  void set_lease_deadline_ns(int64_t ns) {
    lease_deadline_ns_.store(ns, std::memory_order_relaxed);
  }
  // A deadline no renewal sets the lease below (a move's hold: Engine::BeginExport), so that
  // a frozen sequence does not lapse while the receiver commits its copy.
  int64_t lease_floor_ns() const { return lease_floor_ns_.load(std::memory_order_relaxed); }
  void set_lease_floor_ns(int64_t ns) { lease_floor_ns_.store(ns, std::memory_order_relaxed); }
  void EnterCall() { calls_in_flight_.fetch_add(1, std::memory_order_acq_rel); }
  void LeaveCall() { calls_in_flight_.fetch_sub(1, std::memory_order_acq_rel); }
  int32_t calls_in_flight() const { return calls_in_flight_.load(std::memory_order_acquire); }
  // Poisoned(), for readers that hold only the registry lock (KeepAlive).
  bool poisoned_relaxed() const { return poisoned_flag_.load(std::memory_order_acquire); }

  mutable absl::Mutex mu;

  // The state, under `mu`.
  absl::Span<const Stream> streams() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return streams_; }
  size_t num_streams() const { return layout_.num_streams(); }
  // A stream to change: only a commit, under a write section where the change is visible
  // to readers, and only through Stream's methods, which keep it aligned.
  Stream& stream(size_t s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return streams_[s]; }
  // The one home of the scores, for a policy that keeps them (PolicyDescriptor::
  // initial_score; null for one that does not): the backend's SlotState (device memory on
  // a GPU) when the policy steps there (kernel_step), else a host one, whose scores host
  // policy code reads and stages in place (store::HostScores).
  store::SlotState* slots() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return slots_.get(); }
  void set_slots(std::unique_ptr<store::SlotState> slots, bool kernel_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    slots_ = std::move(slots);
    kernel_step_ = kernel_step && slots_ != nullptr;
  }
  // Every Step runs the policy's kernel step in the SlotState (Policy::has_kernel_step,
  // EngineConfig::device_step), not its host code.
  bool kernel_step() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return kernel_step_; }

  bool released() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return released_; }
  // Set when a mutation failed past its point of no return: the blocks may no longer hold
  // what the tables say, so every later call but Release answers DATA_LOSS with the reason.
  bool poisoned() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return !poison_reason_.empty(); }
  const std::string& poison_reason() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return poison_reason_; }
  // Records the reason (capped; the first one stays). Returns whether this poisoned it.
  bool Poison(absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  int64_t policy_mark() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return policy_mark_;
  }  // CallContext::mark
  void set_policy_mark(int64_t mark) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { policy_mark_ = mark; }
  bool append_open() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return append_open_;
  }  // an AppendSession
  void set_append_open(bool open) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { append_open_ = open; }

  // Scratch for a step's new block lists (Engine::ApplyDecision), one per stream: after a
  // commit each holds the list it replaced, whose room the next step reuses instead of
  // allocating a list per stream per step. What they hold between calls means nothing;
  // counted in host_bytes.
  std::vector<std::vector<StreamBlock>>& spare_lists() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return spare_lists_;
  }

  // An in-place write plan (WritePlans): where the next `tokens` tokens of every stream go,
  // made on table `version`. The plan holds one pool reference on every block it names
  // (`held`), so that none is freed or reused while a client may be writing into it.
  struct WritePlan {
    struct Target {
      store::BlockId block = 0;
      uint32_t slot = 0;   // the first of the `tokens` slots
      bool fresh = false;  // a block of the plan's own (else the stream's private last block)
    };
    uint64_t id = 0;
    uint64_t version = 0;
    uint32_t tokens = 0;
    std::vector<Target> streams;
    std::vector<store::BlockId> held;
  };
  const std::optional<WritePlan>& plan() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return plan_; }
  void set_plan(WritePlan plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { plan_ = std::move(plan); }
  // The plan's references, for the caller to give back; no plan after it.
  std::vector<store::BlockId> TakePlan() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<store::BlockId> held;
    if (plan_) held = std::move(plan_->held);
    plan_.reset();
    return held;
  }

  // References a poisoned sequence holds that no stream names (Engine::KeepOrphans).
  void AddOrphan(store::BlockId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    orphan_blocks_.push_back(id);
  }
  std::vector<store::BlockId> TakeOrphans() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return std::exchange(orphan_blocks_, {});
  }

  // The bytes of this sequence in the engine's totals (Engine::AccountSlotState).
  uint64_t slot_bytes_accounted() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return slot_bytes_accounted_;
  }
  uint64_t host_bytes_accounted() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return host_bytes_accounted_;
  }
  // Whether slot_bytes_accounted() went to the device budget (the slot state's place, kept
  // after the state goes so that its bytes leave the same total).
  bool slots_accounted_on_device() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return slots_accounted_on_device_;
  }
  void set_accounted(uint64_t slot_bytes, uint64_t host_bytes, bool slots_on_device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    slot_bytes_accounted_ = slot_bytes;
    host_bytes_accounted_ = host_bytes;
    slots_accounted_on_device_ = slots_on_device;
  }

  absl::Span<const int32_t> token_ids() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return token_ids_; }
  int64_t last_position() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return last_position_; }
  uint64_t appended() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return appended_; }
  // Room for `more` token ids, so that RecordAppend does not allocate. May throw.
  void ReserveTokens(size_t more) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Bytes by which making room for `tokens` more slots (ReserveTokens, every stream's
  // Reserve, the slot state's Append) would raise host_bytes() and a host slot state's
  // bytes; a vector that must grow doubles, so one token can take as much as the sequence
  // holds. DeviceSlotGrowth: the same of a slot state in device memory.
  uint64_t SlotGrowth(size_t tokens) const ABSL_SHARED_LOCKS_REQUIRED(mu);
  uint64_t DeviceSlotGrowth(size_t tokens) const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // An append's commit: its token ids and last position (into reserved room).
  void RecordAppend(absl::Span<const int32_t> token_ids, int64_t last_position, uint64_t tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  uint64_t steps() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return steps_; }
  // Counts a step; returns its index.
  uint64_t CountStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return steps_++; }

  // The seqlock generation of the tables (EpochBoard): changed by every write section.
  uint64_t epoch() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return epoch_; }
  void set_epoch(uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { epoch_ = epoch; }
  // The table version: a new value (unique across sequences, growing) at every commit that
  // changes a block list; each block carries the version at which it last changed.
  uint64_t version() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return version_; }
  void set_version(uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Records the current version as one a client may hold (at the end of every call that
  // changed it). The one published before stays known too: a client holding either gets a
  // delta (the index of every entry it holds is kept for both: StreamBlock::published_index),
  // any other version the whole table. Two, because a call's response carries the update
  // from the version its client held before the call.
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Which of the two published versions `version` is (StreamBlock::published_index), or -1.
  int PublishedSlot(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu);
  // The newest version a client has been told of (in a table or a table update). A version
  // a client says it holds past this one is one it cannot hold (a guess at the next value
  // of the engine-wide counter): it gets the whole table, never a delta from it, which could
  // name as current a version whose changes it lacks. Noted under a shared lock too.
  uint64_t answered_version() const { return answered_version_.load(std::memory_order_relaxed); }
  void NoteAnswered(uint64_t version) const {
    uint64_t seen = answered_version_.load(std::memory_order_relaxed);
    while (version > seen &&
           !answered_version_.compare_exchange_weak(seen, version, std::memory_order_relaxed)) {
    }
  }

  // A fork's child takes its parent's state (not its identity, epoch or accounting): the
  // same streams (block references are the caller's to add), tokens, steps, mark, version
  // and published versions, so that a client may carry the parent's table over. `slots`:
  // the child's copy of the parent's SlotState (or null when it has none).
  void CopyStateFrom(const Sequence& parent, std::unique_ptr<store::SlotState> slots)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) ABSL_SHARED_LOCKS_REQUIRED(parent.mu);
  // Release: drops every stream, the SlotState and the orphans (the caller has dropped the
  // streams' block references and takes the orphans first).
  void Clear() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Prefix sharing: the namespace and salt its prompt blocks are published under, whether
  // they are published as they fill, and the hash chain of its leading full blocks as far
  // as it was computed (block i: hashes()[i]); how many of those blocks are published.
  struct PrefixState {
    std::string ns;
    std::string model;  // what `ns` was made for (a move carries it: sequence_move.h)
    std::string salt;
    bool auto_publish = false;
    std::vector<prefix::BlockHash> hashes;
    size_t published_blocks = 0;
    // Its last change was a Compress of its appended tokens, with no step before it: its
    // cache is a compressed document others may map (Publish with compressed_document).
    bool compressed_document = false;
    uint32_t compressions = 0;  // Compress calls applied since its last append
    // Its first tokens were mapped from published blocks, not computed here: a compression
    // of it did not see their queries, so it is never published as a document.
    bool mapped_prefix = false;
  };
  const PrefixState& prefix() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return prefix_; }
  PrefixState& mutable_prefix() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return prefix_; }

  // A sequence moved here from another kvmemd (sequence_move.h) takes the holder's token
  // ids, last position, appended tokens, steps and policy mark.
  void AdoptMoved(std::vector<int32_t> token_ids, int64_t last_position, uint64_t appended,
                  uint64_t steps, int64_t policy_mark) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    token_ids_ = std::move(token_ids);
    last_position_ = last_position;
    appended_ = appended;
    steps_ = steps;
    policy_mark_ = policy_mark;
  }
  // A move to another kvmemd in progress (Engine::BeginExport): its id, and until when
  // (the registry clock's Unix ns) the sequence is frozen for it. id 0: none.
  // `held`: pool references on the blocks its pieces named by offset (a reader gets them
  // later), for the caller to give back when the export ends.
  struct MoveExport {
    uint64_t id = 0;
    int64_t until_ns = 0;
    std::vector<store::BlockId> held;
  };
  const MoveExport& move_export() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return move_export_; }
  MoveExport& mutable_move_export() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return move_export_; }
  // Ends the export (if any); returns its references for the caller to give back.
  std::vector<store::BlockId> EndMoveExport() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return std::exchange(move_export_, {}).held;
  }

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
  // The invariants every committed state keeps: one stream per (layer, kv_head); per
  // stream, every per-slot vector has one entry per retained slot (history: history_rows
  // each; scores: none while they live in the SlotState, whose lengths then agree),
  // positions increase, and the blocks' live slots add up to the retained slots, each
  // block's run inside the block; the published versions are not newer than the version.
  // INTERNAL naming the first broken one.
  absl::Status CheckInvariants() const ABSL_SHARED_LOCKS_REQUIRED(mu);

 private:
  const uint64_t id_;
  const Layout layout_;
  const BlockFormat format_;
  const QuantConfig quant_;
  const std::string policy_name_;
  const policy::ParamOverrides policy_params_;
  const std::unique_ptr<policy::Policy> policy_;
  const absl::Duration lease_;
  const uint32_t epoch_slot_;
  const uint64_t parent_id_;
  const store::TenantId tenant_;
  const std::string owner_;
  std::shared_ptr<HostShare> host_share_;
  std::atomic<int64_t> lease_deadline_ns_{0};
  std::atomic<int64_t> lease_floor_ns_{0};
  std::atomic<int32_t> calls_in_flight_{0};
  std::atomic<bool> poisoned_flag_{false};

  std::vector<Stream> streams_ ABSL_GUARDED_BY(mu);  // index = layer * H + kv_head
  std::unique_ptr<store::SlotState> slots_ ABSL_GUARDED_BY(mu);
  bool kernel_step_ ABSL_GUARDED_BY(mu) = false;
  bool released_ ABSL_GUARDED_BY(mu) = false;
  std::string poison_reason_ ABSL_GUARDED_BY(mu);
  int64_t policy_mark_ ABSL_GUARDED_BY(mu) = -1;
  bool append_open_ ABSL_GUARDED_BY(mu) = false;
  std::vector<store::BlockId> orphan_blocks_ ABSL_GUARDED_BY(mu);
  std::optional<WritePlan> plan_ ABSL_GUARDED_BY(mu);
  std::vector<std::vector<StreamBlock>> spare_lists_ ABSL_GUARDED_BY(mu);
  uint64_t slot_bytes_accounted_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t host_bytes_accounted_ ABSL_GUARDED_BY(mu) = 0;
  bool slots_accounted_on_device_ ABSL_GUARDED_BY(mu) = false;
  std::vector<int32_t> token_ids_ ABSL_GUARDED_BY(mu);
  int64_t last_position_ ABSL_GUARDED_BY(mu) = -1;
  uint64_t appended_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t epoch_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t steps_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t version_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t published_version_[2] ABSL_GUARDED_BY(mu) = {0, 0};
  mutable std::atomic<uint64_t> answered_version_{0};
  int newest_published_ ABSL_GUARDED_BY(mu) = 0;
  PrefixState prefix_ ABSL_GUARDED_BY(mu);
  MoveExport move_export_ ABSL_GUARDED_BY(mu);
};

}  // namespace kvmem::engine
