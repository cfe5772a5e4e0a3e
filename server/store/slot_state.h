#pragma once
// SlotState: a sequence's per-slot metadata (scores and positions) kept where its backend
// computes — device memory on a GPU, host memory on the CPU — so that a policy's per-step
// work (score update, selection, compaction of the metadata) runs there too, with the
// kernels of kernels/select.h.
//
// Layout: every stream owns `capacity` slots of flat arrays (stream s at s * capacity), its
// first length(s) live, in the order of the stream's retained slots. Capacity grows by
// doubling when an append does not fit and shrinks after a Keep that leaves at most a
// quarter of it in use (a compression). A step is two-phase, so that the engine can move
// the K/V rows in between and drop the step if that fails: Step() updates the scores and
// selects keep-sets; CommitStep() compacts the metadata to them.
//
// The host bookkeeping (lengths, capacity, slices, keep flags <-> lists) is SlotBook; the
// CPU implementation (HostSlotState) scores and selects with the C++ reference kernels and
// compacts from each stream's first dropped slot (the streams of a Step split across cores,
// server/common/parallel.h), the CUDA one runs the kernels' twins
// (cuda_slot_state.cc). Both give the same scores, positions and keep-sets bit for bit.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/select.h"
#include "server/common/keep_set.h"

namespace kvmem::store {

// Per stream: ascending kept slot indices, or nullopt for "every slot".
using KeepSets = std::vector<std::optional<KeepSet>>;

// Scores in host memory, for policy code that runs on the host (PolicyDriver): it reads the
// committed scores and writes the next ones into staging, which becomes the scores only at
// the call's commit; a call that fails before it leaves the scores as they were.
class HostScores {
 public:
  virtual ~HostScores() = default;
  // Stream s's committed scores (length(s) values).
  virtual absl::Span<const float> scores(uint32_t s) const = 0;
  // Room to stage every stream's next scores; may throw std::bad_alloc, changing nothing.
  virtual void PrepareStage() = 0;
  // Stream s's next scores (length(s) values), after PrepareStage.
  virtual absl::Span<float> staged(uint32_t s) = 0;
  // The staged scores become the scores; allocates nothing.
  virtual void CommitStaged() = 0;
};

class SlotState;

// One Step of several run together (StepSlotStates): SlotState::Step's arguments, and what
// it returns.
struct SlotStepCall {
  SlotState* state = nullptr;
  kernels::ScoreStep op;
  absl::Span<const absl::Span<const float>> rows;
  absl::Span<const uint32_t> budget;
  uint32_t protect = 0;
  KeepSets* keep = nullptr;
  absl::Status status;
};

// One Append of several run together (AppendSlotStates).
struct SlotAppendCall {
  SlotState* state = nullptr;
  absl::Span<const int64_t> positions;
  float initial_score = 0;
  absl::Status status;
};

// Runs the Steps of states that share it as one batch (the CUDA states of one device: one
// upload, one launch per kernel, one download and one wait for all of them). Each call
// ends exactly as its own Step would: its status, its keep-sets, the step staged in its
// state until CommitStep or AbortStep; one call's error never touches another's.
class SlotStepper {
 public:
  virtual ~SlotStepper() = default;
  virtual void StepAll(absl::Span<SlotStepCall* const> calls) = 0;
  // Compacts the states whose last Step is pending (CommitStep's work) as one batch; a
  // state whose compaction fails here keeps its step pending for its own CommitStep.
  virtual void CommitAll(absl::Span<SlotState* const> states) = 0;
  // The Appends of states that share it as one batch, each ending as its own Append would.
  virtual void AppendAll(absl::Span<SlotAppendCall* const> calls) = 0;
};

// Steps every call: those whose states share a stepper as one batch per stepper, the others
// one by one. The states are distinct. May throw std::bad_alloc before any call steps (a
// stepper's batch that runs out of host memory fails its calls).
void StepSlotStates(absl::Span<SlotStepCall> calls);
// The compaction CommitStep does, done now for the states that share a stepper, as one
// batch per stepper (the others, and any whose batch fails, compact in their CommitStep,
// which must still be called for every state). May throw std::bad_alloc; a state it did
// not compact compacts in its CommitStep.
void CommitSlotStates(absl::Span<SlotState* const> states);
// Appends for every call, as one batch per stepper, the others one by one. The states are
// distinct. May throw std::bad_alloc before any call appends (a stepper's batch that runs
// out of host memory fails its calls).
void AppendSlotStates(absl::Span<SlotAppendCall> calls);

class SlotState {
 public:
  virtual ~SlotState() = default;

  virtual uint32_t num_streams() const = 0;
  virtual uint32_t length(uint32_t stream) const = 0;
  // Bytes this state holds where it lives (device memory for the CUDA backend).
  virtual uint64_t bytes() const = 0;
  // Whether it lives in device memory (its bytes are then not host memory: the engine
  // counts them against --device-metadata-bytes).
  virtual bool in_device_memory() const { return false; }
  // Bytes by which Append of `count` slots would raise bytes() (0 if it would fail).
  virtual uint64_t AppendGrowth(uint32_t count) const = 0;

  // Appends the same `positions` to every stream, each new slot scored `initial_score`.
  [[nodiscard]] virtual absl::Status Append(absl::Span<const int64_t> positions,
                                            float initial_score) = 0;
  // Drops the newest `count` slots of every stream (undoes an Append).
  virtual void DropNewest(uint32_t count) = 0;
  // Updates every stream's scores with rows[s] (length(s) values) by `step.rule`; when
  // step.select, writes each stream's keep-set by SelectTop with budget[s] and `protect`
  // to *keep (nullopt where the stream fits its budget). Metadata is not compacted yet.
  [[nodiscard]] virtual absl::Status Step(const kernels::ScoreStep& step,
                                          absl::Span<const absl::Span<const float>> rows,
                                          absl::Span<const uint32_t> budget, uint32_t protect,
                                          KeepSets* keep) = 0;
  // Compacts every stream to the keep-sets of the last Step.
  [[nodiscard]] virtual absl::Status CommitStep() = 0;
  // Undoes the last Step that was not committed: its scores as before it, no keep-sets
  // pending. The engine calls it when the step fails before its point of no return.
  [[nodiscard]] virtual absl::Status AbortStep() = 0;
  // Compacts every stream to keep-sets decided elsewhere (a policy run on the host).
  [[nodiscard]] virtual absl::Status Keep(const KeepSets& keep) = 0;
  // Takes, before a commit's point of no return, whatever memory a Keep and WriteScores
  // at the current lengths need, so that past that point they allocate nothing (a Step
  // does this for its CommitStep itself); EndCommit gives it back.
  [[nodiscard]] virtual absl::Status ReserveCommit() { return absl::OkStatus(); }
  virtual void EndCommit() {}

  // Copies to and from the host, for policy calls that run there (Compress).
  [[nodiscard]] virtual absl::Status ReadScores(std::vector<std::vector<float>>* scores) = 0;
  [[nodiscard]] virtual absl::Status WriteScores(const std::vector<std::vector<float>>& scores) = 0;
  [[nodiscard]] virtual absl::Status ReadPositions(
      std::vector<std::vector<int64_t>>* positions) = 0;

  // An independent copy (Fork).
  virtual absl::StatusOr<std::unique_ptr<SlotState>> Clone() const = 0;
  // The scores in host memory, to read and stage in place; null where they live in device
  // memory (a host call then copies them over with ReadScores and back with WriteScores).
  virtual HostScores* host_scores() { return nullptr; }
  // What steps this state together with others (StepSlotStates); null: it steps alone.
  virtual SlotStepper* stepper() { return nullptr; }
};

// Host bookkeeping shared by the implementations.
class SlotBook {
 public:
  explicit SlotBook(uint32_t num_streams) : length_(num_streams, 0) {}

  uint32_t num_streams() const { return static_cast<uint32_t>(length_.size()); }
  uint32_t capacity() const { return capacity_; }
  uint32_t length(uint32_t s) const { return length_[s]; }
  uint64_t total_slots() const { return uint64_t{capacity_} * length_.size(); }
  // Capacity needed to append `count` slots to every stream: the current one if it fits,
  // else doubled until it does. INVALID_ARGUMENT past kMaxSlots per stream.
  absl::StatusOr<uint32_t> CapacityFor(uint32_t count) const;
  // A smaller capacity once at most a quarter is used (after a compression): twice the
  // longest stream, rounded up to a power of two, at least 16; else the current one.
  uint32_t FittedCapacity() const;
  void set_capacity(uint32_t capacity) { capacity_ = capacity; }
  void Grow(uint32_t count);
  void Shrink(uint32_t count);
  void set_length(uint32_t s, uint32_t n) { length_[s] = n; }
  // Slices over the flat arrays, with per-stream budgets (empty: 0) and `protect`.
  std::vector<kernels::StreamSlice> Slices(absl::Span<const uint32_t> budget,
                                           uint32_t protect) const;
  // Flags (flat, capacity per stream) <-> keep-sets; ToKeepSets() gives nullopt where every
  // slot is kept (streams in parallel), ToKeepSet() the same for stream s. FromKeepSets()
  // checks the sets (ascending, in range).
  KeepSets ToKeepSets(const uint8_t* flags) const;
  std::optional<KeepSet> ToKeepSet(uint32_t s, const uint8_t* flags) const;
  absl::Status FromKeepSets(const KeepSets& keep, uint8_t* flags) const;
  // INTERNAL unless there is one row of length(s) values and one budget per stream (Step),
  // or one score per slot (WriteScores): the engine's own checks make these bugs, not input.
  absl::Status CheckStep(absl::Span<const absl::Span<const float>> rows,
                         absl::Span<const uint32_t> budget) const;
  absl::Status CheckScores(const std::vector<std::vector<float>>& scores) const;
  // Lengths after keeping `keep`.
  void ApplyKeep(const KeepSets& keep);

  static constexpr uint32_t kMaxSlots = 1u << 26;

 private:
  std::vector<uint32_t> length_;
  uint32_t capacity_ = 0;
};

// What the implementations share: the book and the pending step.
class BookedSlotState : public SlotState {
 public:
  explicit BookedSlotState(uint32_t num_streams) : book_(num_streams) {}
  uint32_t num_streams() const override { return book_.num_streams(); }
  uint64_t bytes() const final { return BytesAt(book_.capacity()); }
  uint64_t AppendGrowth(uint32_t count) const final {
    absl::StatusOr<uint32_t> capacity = book_.CapacityFor(count);
    if (!capacity.ok() || *capacity <= book_.capacity()) return 0;
    return BytesAt(*capacity) - bytes();
  }
  uint32_t length(uint32_t stream) const override { return book_.length(stream); }
  void DropNewest(uint32_t count) override {
    book_.Shrink(count);
    pending_ = false;
    saved_ = false;
  }
  absl::Status CommitStep() final {
    saved_ = false;
    if (!lost_.ok()) {
      pending_ = false;
      EndCommit();
      return lost_;
    }
    absl::Status s = std::exchange(commit_error_, absl::OkStatus());
    if (s.ok() && pending_) s = Compact();
    pending_ = false;
    EndCommit();
    return s;
  }
  absl::Status AbortStep() final {
    pending_ = false;
    EndCommit();
    if (!lost_.ok()) return lost_;
    // A batched compaction failed part-way: nothing to put back to.
    if (!commit_error_.ok()) return std::exchange(commit_error_, absl::OkStatus());
    if (!saved_) return absl::OkStatus();
    saved_ = false;
    return RestoreScores();
  }

 protected:
  // Bytes the state holds at `capacity` slots per stream.
  virtual uint64_t BytesAt(uint32_t capacity) const = 0;

  // Compacts every stream's metadata by the keep flags (the last Step's, or Keep's).
  virtual absl::Status Compact() = 0;
  // Moves every stream's live slots to arrays of the given capacity.
  virtual absl::Status Relayout(uint32_t capacity) = 0;
  // Puts back the scores a Step saved before updating them (saved_ is set).
  virtual absl::Status RestoreScores() = 0;
  // Before Append: room for `count` more slots in every stream.
  absl::Status EnsureCapacity(uint32_t count) {
    absl::StatusOr<uint32_t> capacity = book_.CapacityFor(count);
    if (!capacity.ok()) return capacity.status();
    return *capacity == book_.capacity() ? absl::OkStatus() : Relayout(*capacity);
  }
  // After Keep: gives back capacity a compression left unused, where it can. It runs past
  // a commit's point of no return, so a failure (no memory for the smaller copy) keeps the
  // larger capacity, which holds the same slots; a later Keep tries again.
  void FitCapacity() {
    const uint32_t fitted = book_.FittedCapacity();
    if (fitted == book_.capacity()) return;
    try {
      Relayout(fitted).IgnoreError();
    } catch (const std::bad_alloc&) {
      // Relayout allocates before it changes anything.
    }
  }
  // Ends a Step: the keep-sets by the flags (host copy) when it selected. CommitStep
  // compacts only when a stream drops a slot (else the compaction changes nothing).
  void FinishStep(bool selected, const uint8_t* flags, KeepSets* keep) {
    *keep = selected ? book_.ToKeepSets(flags) : KeepSets(book_.num_streams());
    pending_ = std::any_of(keep->begin(), keep->end(),
                           [](const std::optional<KeepSet>& k) { return k.has_value(); });
  }

  SlotBook book_;
  bool pending_ = false;  // the flags hold the last Step's keep-sets
  bool saved_ = false;    // the scores before the last Step are saved (until Commit/Abort)
  // A batch's compaction of the pending step failed once launched (SlotStepper::CommitAll):
  // CommitStep and AbortStep report it instead of compacting or restoring.
  absl::Status commit_error_;
  // The state no longer holds what its book says: work it queued failed after the call
  // that queued it had returned (a batched append on a GPU). Every later call fails with
  // it, CommitStep and AbortStep too, so that the engine poisons the sequence.
  mutable absl::Status lost_;
};

// The CPU implementation: flat host arrays (host_scores() is never null).
std::unique_ptr<SlotState> MakeHostSlotState(uint32_t num_streams);
// The scores only (no positions, no keep flags: 8 bytes a slot): the home of the scores of
// a sequence whose policy code runs on the host, which reads positions from its streams.
// Its Step is INTERNAL and ReadPositions FAILED_PRECONDITION.
std::unique_ptr<SlotState> MakeHostScoreState(uint32_t num_streams);

}  // namespace kvmem::store
