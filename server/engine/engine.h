#pragma once
// Engine: owns every sequence, the pool bookkeeping and the backend; applies policies.
//
// Lock order: Sequence::mu -> Engine::mu_ (the registry) -> BlockPool's mutex; the registry
// lock is never held while waiting for a sequence. Calls on different sequences run in
// parallel; calls on one sequence are serialized.
// Every method validates its whole input before changing anything: an error return means
// no state changed.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/common/mutex.h"
#include "server/engine/clock.h"
#include "server/engine/engine_types.h"
#include "server/engine/epoch_board.h"
#include "server/engine/failpoints.h"
#include "server/engine/layout.h"
#include "server/engine/sequence.h"
#include "server/engine/telemetry.h"
#include "server/policy/policy.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// Payloads of a stale-epoch error (absl::Status::GetPayload): the sequence's current epoch
// and table version, as decimal text.
inline constexpr absl::string_view kCurrentEpochPayload = "kvmem/current_epoch";
inline constexpr absl::string_view kCurrentVersionPayload = "kvmem/current_version";

class Engine {
 public:
  // Host metadata bytes a call may still take, counted against the budget from the moment
  // they are granted until the call ends (by then what it really took is accounted), so that
  // concurrent calls cannot all pass one check and together overshoot it. Grows; gives the
  // bytes back when destroyed.
  class HostReservation {
   public:
    HostReservation() = default;
    HostReservation(HostReservation&& other) noexcept
        : engine_(std::exchange(other.engine_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
    HostReservation& operator=(HostReservation&& other) noexcept {
      std::swap(engine_, other.engine_);
      std::swap(bytes_, other.bytes_);
      return *this;
    }
    ~HostReservation();
    // RESOURCE_EXHAUSTED (naming `what` and --host-metadata-bytes) unless `more` bytes fit.
    absl::Status Grow(uint64_t more, absl::string_view what);
    uint64_t bytes() const { return bytes_; }

   private:
    friend class Engine;
    explicit HostReservation(Engine* engine) : engine_(engine) {}
    Engine* engine_ = nullptr;
    uint64_t bytes_ = 0;
  };

  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                        std::unique_ptr<store::Backend> backend,
                                                        const Clock* clock);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  const EngineConfig& config() const { return config_; }
  const store::Backend& backend() const { return *backend_; }
  const EpochBoard& epoch_board() const { return *board_; }
  uint64_t pool_free_bytes() const { return pool_->free_bytes(); }

  // With a prompt (PromptPrefix::token_ids), the longest published prefix of it in the
  // same namespace and salt is mapped into the new sequence (CreateResult::
  // reused_prefix_tokens): whole blocks, leaving at least the prompt's last token to the
  // worker, so that it has logits to sample from.
  absl::StatusOr<CreateResult> CreateSequence(Layout layout, absl::string_view policy_name,
                                              const policy::ParamOverrides& params,
                                              QuantConfig quant, absl::Duration lease,
                                              const PromptPrefix& prompt = {});
  // Publishes the sequence's leading full blocks up to `up_to_tokens` (unset: all it has),
  // from its first block as far as they are whole in every stream (unevicted, unquantized,
  // at positions 0, 1, ...) and their token ids were sent; returns the tokens published
  // (also those published before). Publishing is idempotent.
  absl::StatusOr<uint64_t> Publish(uint64_t sequence_id, std::optional<uint64_t> up_to_tokens);
  // Publishes the sequence's whole cache as the compressed form of the tokens it appended
  // (a document), under its representation (policy, parameter overrides, quantization):
  // its last change must have been a Compress with no Step before it, its tokens at
  // positions 0, 1, ... with their ids. A later CreateSequence naming the same document
  // and representation maps it whole (PromptPrefix::document_tokens). Returns the tokens.
  absl::StatusOr<uint64_t> PublishDocument(uint64_t sequence_id);
  // How many tokens of the prompt a CreateSequence in this namespace and salt would reuse
  // now. Pins nothing.
  // With PromptPrefix::document_tokens, the representation is that of `policy_name`,
  // `params` and `quant`.
  absl::StatusOr<uint64_t> Lookup(Layout layout, const PromptPrefix& prompt,
                                  absl::string_view policy_name = "full",
                                  const policy::ParamOverrides& params = {},
                                  QuantConfig quant = {});
  // Appends the chunks in order, atomically: all are validated and their blocks allocated
  // before any byte is written.
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, absl::Span<const AppendChunk> chunks);
  // A found sequence, counted in its calls_in_flight until the handle goes (so that the
  // lease reaper leaves it alone), locked or not.
  class SequenceRef {
   public:
    explicit SequenceRef(std::shared_ptr<Sequence> seq) : seq_(std::move(seq)) {}
    SequenceRef(SequenceRef&& other) noexcept;
    void LockNow() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      kvmem::Lock(&seq_->mu);
      locked_ = true;
    }
    void UnlockNow() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (locked_) kvmem::Unlock(&seq_->mu);
      locked_ = false;
    }
    SequenceRef& operator=(SequenceRef&&) = delete;
    ~SequenceRef();
    Sequence& operator*() const { return *seq_; }
    Sequence* operator->() const { return seq_.get(); }

   private:
    std::shared_ptr<Sequence> seq_;
    bool locked_ = false;
  };
  // A streamed append (AppendStream): each chunk is checked and written into blocks the
  // session owns as it arrives, so no chunk waits in memory; nothing is visible until
  // Commit applies them all at once. Destroyed uncommitted (an error, a cancelled or
  // broken stream), it gives its blocks back and the sequence is as it was. While a
  // session is open, other changes to the sequence are FAILED_PRECONDITION; reads go on.
  class AppendSession {
   public:
    ~AppendSession();
    AppendSession(const AppendSession&) = delete;
    AppendSession& operator=(const AppendSession&) = delete;
    // Any error ends the session: later calls return it, nothing is applied.
    absl::Status Add(const AppendChunk& chunk);
    absl::StatusOr<AppendResult> Commit();

   private:
    friend class Engine;
    AppendSession(Engine* engine, SequenceRef seq);
    absl::Status AddLocked(const AppendChunk& chunk);
    absl::StatusOr<AppendResult> CommitLocked();
    // Whether `n` more slots fit every stream's last block after what the session wrote
    // there: a private layout block (its free tail is nothing a table names).
    bool TailsFit(const Sequence& seq, size_t n) const;
    // Writes the chunk into those free tails.
    absl::Status WriteTails(const Sequence& seq, const AppendChunk& chunk);
    // Plans each stream's tail (its last entry, what the tails took included) from here on.
    void StartPlans(const Sequence& seq);
    // Writes the chunk into blocks the plans take (allocated, or copied when shared).
    absl::Status PlanBlocks(const Sequence& seq, const AppendChunk& chunk);
    uint64_t staged_bytes() const {
      return positions_.capacity() * 8 +
             (token_ids_.capacity() + token_entropy_.capacity() + layer_distance_.capacity()) * 4;
    }

    Engine* const engine_;
    // For the append's latency (monotonic: the injectable clock is for leases).
    const std::chrono::steady_clock::time_point started_;
    HostReservation staged_reservation_;  // what the staged vectors may take, until the end
    SequenceRef seq_;      // counted in flight (the reaper waits); locked throughout if hold_lock_
    bool publish_ = true;  // false inside a folded step, which publishes once at its end
    bool hold_lock_ = false;  // a unary Append: the lock is held from Begin to the end
    OpBatch batch_;           // allocated: every block the session took; dropped: copied-on-write
    // While every chunk fitted the streams' last blocks: no plans, and the slots written
    // into each last block's free tail.
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
    absl::Status broken_;
    bool committed_ = false;
  };
  absl::StatusOr<std::unique_ptr<AppendSession>> BeginAppend(uint64_t sequence_id);

 private:
  absl::StatusOr<std::unique_ptr<AppendSession>> BeginAppend(uint64_t sequence_id, bool hold_lock);

 public:
  absl::StatusOr<StepResult> Step(uint64_t sequence_id, const StepInput& input);
  // The decode loop's call: per entry, the new token(s) appended and the step, with the
  // table update from the client's version. Entries run in parallel (different sequences;
  // a sequence named twice is INVALID_ARGUMENT for the whole batch, and nothing runs); one
  // entry's error never affects another's.
  absl::StatusOr<std::vector<StepOutcome>> StepBatch(absl::Span<const StepCall> calls);
  // What changed in the sequence's tables since `known_version`: a delta when that version
  // is one of the last two the sequence published (the current one, or the one before the
  // last call that changed it), else the whole table (also for a version of another
  // sequence, or 0 = none held). After a call that changed the table, `version_before` is
  // the table's version before it: a known version past it is one no answer can have carried
  // (a guess at the call's own), and gets the whole table too.
  static constexpr uint64_t kNoCall = ~uint64_t{0};
  absl::StatusOr<TableUpdate> GetTableUpdate(uint64_t sequence_id, uint64_t known_version,
                                             bool positions, uint64_t version_before = kNoCall);
  // The sequence's table version now.
  absl::StatusOr<uint64_t> TableVersion(uint64_t sequence_id);
  absl::StatusOr<CompressResult> Compress(uint64_t sequence_id, const CompressInput& input);
  absl::StatusOr<BlockTable> GetBlockTable(uint64_t sequence_id, bool positions = true);
  // Calls `sink` per stream of layers [layer_begin, layer_end) in order: once with the whole
  // stream, or, with `piece_bytes` > 0, once per piece of consecutive slots whose K+V and
  // positions (10 bytes each, their packed most) fit it (at least one slot a piece), so
  // that a read holds one piece in host memory, not a stream. The sequence lock is not held
  // while `sink` runs; any change of the table between pieces (its epoch or its version) is
  // ABORTED. A non-OK status from `sink` stops the read and is returned.
  absl::Status ReadKV(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                      uint32_t layer_end, const std::function<absl::Status(StreamKV&&)>& sink,
                      uint64_t piece_bytes = 0);
  absl::StatusOr<CreateResult> Fork(uint64_t sequence_id, absl::Duration lease);
  // Returns the number of blocks whose last reference this dropped.
  absl::StatusOr<uint64_t> Release(uint64_t sequence_id);
  // Renews each sequence's lease; per id, OK or why not (NOT_FOUND, DATA_LOSS). A lease
  // renewed here cannot lapse before the time it reports: the renewal and the reaper's
  // check take the same lock.
  std::vector<absl::Status> KeepAlive(absl::Span<const uint64_t> sequence_ids);
  // Releases every sequence whose lease has lapsed; returns how many.
  uint32_t ExpireLeases();
  // Past the high watermark of pages in use, gives cached prefix blocks back down to the
  // low one (EngineConfig::cache_high_watermark); returns the pool bytes freed. The daemon
  // runs it with the lease reaper.
  uint64_t ReclaimToWatermark();

 private:
  uint64_t ReclaimToWatermarkImpl();
  // Register, and if that throws, the sequence gives back what it holds (its blocks, its
  // epoch slot) before the exception goes on.
  absl::StatusOr<CreateResult> RegisterOrRelease(const std::shared_ptr<Sequence>& seq);

 public:
  // Runs ExpireLeases every `period` until `stop` is notified.
  void RunLeaseReaper(absl::Duration period, absl::Notification* stop);
  // Locks each sequence in turn (the memory totals are kept per stream): for Stats and
  // /metrics; PoolUsage is the pool alone.
  EngineStats Stats(bool include_sequences);
  store::PoolUsage PoolUsage() const { return pool_->usage(); }
  uint64_t PoolFreeBytes() const { return pool_->free_bytes(); }
  // Counters and histograms per policy since the daemon started (server/metrics reads them).
  const Telemetry& telemetry() const { return telemetry_; }
  // Everything a sequence holds, as text (per-slot metadata and scores, block list, K/V),
  // without the epoch: equal before and after a call exactly when the call changed nothing
  // a later call could see. For tests (state fingerprints around failures).
  absl::StatusOr<std::string> Fingerprint(uint64_t sequence_id);

 private:
  // Runs a public call so that host memory exhaustion (std::bad_alloc) comes back as
  // RESOURCE_EXHAUSTED instead of crossing the module boundary; a write section open when
  // it is thrown poisons its sequence on the way out.
  template <typename F>
  static auto Guard(absl::string_view what, F&& call) -> decltype(call()) {
    try {
      return call();
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": out of host memory (kvmemd could not allocate)"));
    }
  }
  absl::StatusOr<CreateResult> CreateSequenceImpl(Layout layout, absl::string_view policy_name,
                                                  const policy::ParamOverrides& params,
                                                  QuantConfig quant, absl::Duration lease,
                                                  const PromptPrefix& prompt);
  // Prefix sharing (prefix_sharing.cc). The namespace of a layout and model; a prompt's
  // sizes and token ids checked against the limits and the layout; the hashes of its
  // leading blocks the index holds now (never the block of its last token).
  static std::string PrefixNamespace(const Layout& layout, absl::string_view model);
  static absl::Status CheckPrompt(const Layout& layout, const PromptPrefix& prompt);
  absl::StatusOr<std::vector<prefix::BlockHash>> PublishedPrefix(const Layout& layout,
                                                                 const PromptPrefix& prompt) const;
  // Installs mapped prefix blocks ([block][stream], referenced for the sequence) in a new,
  // empty sequence as its first tokens, under `version`. An error changes nothing (the
  // references stay the caller's).
  absl::Status MapPrefix(Sequence& seq, const std::vector<std::vector<store::BlockId>>& mapped,
                         absl::Span<const int32_t> token_ids, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Shared compressed documents: a representation's name; a document's key; mapping a
  // found document into a new, empty sequence (an error changes nothing; the references
  // MapDocument took stay the caller's).
  static std::string Representation(absl::string_view policy_name,
                                    const policy::ParamOverrides& params, const QuantConfig& quant);
  absl::StatusOr<prefix::BlockHash> DocumentKey(absl::Span<const int32_t> tokens,
                                                absl::string_view representation,
                                                absl::string_view salt) const;
  absl::Status AdoptDocument(Sequence& seq, const prefix::EntryPayload& payload, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Publish on a locked sequence; returns the tokens published.
  absl::StatusOr<uint64_t> PublishLocked(Sequence& seq, uint64_t up_to_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  absl::StatusOr<uint64_t> PublishDocumentLocked(Sequence& seq)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  absl::StatusOr<AppendResult> AppendImpl(uint64_t sequence_id,
                                          absl::Span<const AppendChunk> chunks);
  absl::StatusOr<StepResult> StepImpl(uint64_t sequence_id, const StepInput& input);
  StepOutcome StepCallImpl(const StepCall& call);
  // A Step's input checked against the sequence (`pending` tokens appended before it runs):
  // the rows indexed by stream and the policy's context.
  struct PreparedStep {
    std::vector<absl::Span<const float>> rows;
    policy::CallContext ctx;
  };
  // `table_version`: the client's held table (StepInput's, else a batch entry's).
  absl::StatusOr<PreparedStep> PrepareStep(Sequence& seq, const StepInput& input, size_t pending,
                                           uint64_t table_version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  absl::StatusOr<StepResult> RunStep(Sequence& seq, const PreparedStep& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // FAILED_PRECONDITION `message`, carrying the current epoch and version as payloads
  // (kCurrentEpochPayload, kCurrentVersionPayload) for the caller's error details.
  static absl::Status StaleEpoch(const Sequence& seq, absl::string_view message,
                                 absl::StatusCode code = absl::StatusCode::kFailedPrecondition)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // A fresh version for a commit that changes block lists (it becomes seq.version()).
  uint64_t NewVersion(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Records seq.version() as one a client may hold: at the end of every call that changed it
  // (the one before stays known too: Sequence::published_version).
  void PublishVersion(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  TableUpdate TableDelta(const Sequence& seq, uint64_t known_version, bool positions,
                         uint64_t version_before) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  absl::StatusOr<std::unique_ptr<AppendSession>> BeginAppendLocked(SequenceRef ref, bool hold_lock)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;
  absl::StatusOr<CompressResult> CompressImpl(uint64_t sequence_id, const CompressInput& input);
  absl::StatusOr<CreateResult> ForkImpl(uint64_t sequence_id, absl::Duration lease);
  absl::StatusOr<BlockTable> GetBlockTableImpl(uint64_t sequence_id, bool positions);
  BlockTable TableOf(const Sequence& seq, bool positions) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  absl::Status ReadKVImpl(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                          uint32_t layer_end, const std::function<absl::Status(StreamKV&&)>& sink,
                          uint64_t piece_bytes);
  // Throws std::bad_alloc at the armed commit step (Failpoints::kCommit).
  void CommitFailpoint() const;
  Engine(const EngineConfig& config, std::unique_ptr<store::Backend> backend,
         std::unique_ptr<store::BlockPool> pool, std::unique_ptr<EpochBoard> board,
         prefix::BlockHash prefix_root, const Clock* clock);

  // Finds a sequence without locking it.
  absl::StatusOr<SequenceRef> Find(uint64_t sequence_id);
  // Finds and locks a sequence that may be used: NOT_FOUND if it is gone, DATA_LOSS if it
  // was poisoned.
  absl::StatusOr<SequenceRef> Lock(uint64_t sequence_id);
  // FAILED_PRECONDITION while an AppendSession is open on the sequence.
  static absl::Status NotAppending(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Lock() for a call that changes the sequence: also refused while an append is open.
  absl::StatusOr<SequenceRef> LockForChange(uint64_t sequence_id);
  // The error for a locked sequence that can no longer serve (released or poisoned).
  static absl::Status Unusable(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Marks a sequence unusable after a failure past a point of no return: its epoch word
  // turns odd for good (no reader accepts its tables) and every later call but Release
  // gets DATA_LOSS naming it and `why`. Returns that DATA_LOSS status.
  absl::Status Poison(Sequence& seq, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // After a commit interrupted past its point of no return: moves the references the
  // sequence holds but no stream names (old blocks of committed streams, new blocks of the
  // rest) to seq.orphan_blocks, which Release drops. `from`, `to`: where each stream's
  // swapped entries begin and end (Stream::SwapBlocks), empty when whole lists or whole
  // tails were swapped.
  void KeepOrphans(Sequence& seq, const OpBatch& batch,
                   const std::vector<std::vector<StreamBlock>>& other_lists, size_t swapped,
                   const std::vector<size_t>& from = {}, const std::vector<size_t>& to = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  // A seqlock write section on one sequence: readers of its current tables fail from the
  // moment it opens. Commit() publishes a fresh epoch; destroyed without it (an error or
  // an exception past the point of no return), it poisons the sequence.
  class WriteSection {
   public:
    WriteSection(Engine* engine, Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
    WriteSection(const WriteSection&) = delete;
    WriteSection& operator=(const WriteSection&) = delete;
    ~WriteSection();
    void Commit();

   private:
    Engine* const engine_;
    Sequence* const seq_;
    bool committed_ = false;
  };
  // Runs at a mutation's commit point, before its keep-sets compact the per-slot vectors:
  // applies the staged policy state. Must not fail for a reason a retry could fix.
  using CommitHook = std::function<absl::Status()>;
  absl::StatusOr<absl::Duration> ResolveLease(absl::Duration lease) const;
  void Renew(Sequence& seq);
  absl::StatusOr<CreateResult> Register(const std::shared_ptr<Sequence>& seq);
  absl::Status ValidateChunk(const Sequence& seq, const AppendChunk& chunk, size_t index,
                             int64_t* last_position) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Checks per-stream signals (range, duplicates, lengths, finiteness, values in [0, max])
  // and returns them indexed by stream (empty span where absent).
  // `pending`: tokens this call appends before the signals apply (a folded Step).
  // A signal whose length misses its stream's slot count is INVALID_ARGUMENT, or
  // FAILED_PRECONDITION with the current epoch and version (StaleEpoch) when it is short and
  // the client said it holds an older table (`table_version`, 0: not said): the rows follow
  // that table.
  absl::StatusOr<std::vector<absl::Span<const float>>> IndexSignals(
      const Sequence& seq, absl::Span<const StreamSignal> signals, const char* field, float max,
      bool require_all, absl::string_view why, size_t pending, uint64_t table_version) const
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // The largest value of an attention weight (a probability, with room for the rounding of
  // a GQA group's mean: nine heads' 1.0 times a rounded 1/9 sums past 1, by 0.2 % in bf16)
  // and of a window score (a sum of probabilities over the window's queries).
  static constexpr float kMaxAttention = 1.01f;
  static constexpr float kMaxWindowScore = 1e30f;
  // The mean over streams of the weight the step's rows put on quantized slots; NaN
  // without rows.
  static double QuantizedMass(const Sequence& seq, absl::Span<const absl::Span<const float>> rows)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  struct Applied {
    uint64_t evicted = 0;
    uint64_t quantized = 0;
  };
  // Applies a policy decision: compacts every stream with a keep-set, merges sparse blocks,
  // quantizes blocks that left the recent window, and bumps the epoch if anything changed.
  // The policy's staged state (`commit`) is applied at the commit point, also when nothing
  // else changes. An error before that point changes nothing; one after it poisons.
  absl::StatusOr<Applied> ApplyDecision(Sequence& seq, const policy::Decision& decision,
                                        const CommitHook& commit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // StreamStates over the committed state, with next_scores staged per stream and the
  // history of the policy's width.
  std::vector<policy::StreamState> StagedStreamStates(Sequence& seq)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The commit hook of a host policy call: takes the staged scores, the mark, and (Step)
  // records `rows` in the history.
  CommitHook CommitPolicyState(Sequence& seq, const policy::Decision& decision,
                               const std::vector<absl::Span<const float>>* rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  policy::CallContext Context(const Sequence& seq) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Runs a planned batch on the backend; releases its allocations if it fails.
  absl::Status Execute(Sequence& seq, OpBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Step of a policy with a kernel step: the scores update and the selection run in the
  // sequence's SlotState; the K/V rows then move as for any decision.
  absl::StatusOr<Applied> KernelStep(Sequence& seq, const policy::CallContext& ctx,
                                     absl::Span<const absl::Span<const float>> rows,
                                     policy::Decision* decision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  uint64_t ReleaseLocked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Brings slot_state_bytes_ and host_bytes_ up to date with the sequence's SlotState size
  // and host metadata.
  void AccountSlotState(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Reserves `more` bytes of host metadata (HostReservation), or RESOURCE_EXHAUSTED.
  absl::StatusOr<HostReservation> ReserveHost(uint64_t more, absl::string_view what);
  uint64_t host_budget() const;

  const EngineConfig config_;
  const std::unique_ptr<store::Backend> backend_;
  const std::unique_ptr<store::BlockPool> pool_;
  // A salt's tenant in the pool (registered on first use with its quota); 0 for none.
  absl::StatusOr<store::TenantId> TenantFor(absl::string_view salt);
  absl::Mutex tenants_mu_;
  absl::flat_hash_map<std::string, store::TenantId> tenants_ ABSL_GUARDED_BY(tenants_mu_);
  // Published prompt blocks; holds pool references, so it goes before the pool.
  const std::unique_ptr<prefix::PrefixIndex> prefix_;
  const prefix::BlockHash prefix_root_;
  const std::unique_ptr<EpochBoard> board_;
  const Clock* const clock_;

  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Epochs are unique across all sequences (see EpochBoard); so are table versions.
  std::atomic<uint64_t> next_epoch_{1};
  std::atomic<uint64_t> next_version_{1};

  std::atomic<uint64_t> tokens_appended_{0};
  std::atomic<uint64_t> tokens_evicted_{0};
  std::atomic<uint64_t> tokens_quantized_{0};
  std::atomic<uint64_t> bytes_moved_{0};
  std::atomic<uint64_t> slot_state_bytes_{0};
  std::atomic<uint64_t> host_bytes_{0};     // Sequence::host_bytes() of every sequence
  std::atomic<uint64_t> host_reserved_{0};  // granted to calls in flight (HostReservation)
  std::atomic<uint64_t> steps_{0};
  std::atomic<uint64_t> leases_expired_{0};
  std::atomic<uint64_t> sequences_poisoned_{0};
  Telemetry telemetry_;
};

}  // namespace kvmem::engine
