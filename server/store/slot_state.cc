#include "server/store/slot_state.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/parallel.h"
#include "server/common/slot_column.h"

namespace kvmem::store {

absl::StatusOr<uint32_t> SlotBook::CapacityFor(uint32_t count) const {
  uint64_t longest = 0;
  for (uint32_t n : length_) longest = std::max<uint64_t>(longest, n);
  const uint64_t need = longest + count;
  if (need > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("positions: a stream would hold ", need,
                                                   " slots, over the limit of ", kMaxSlots));
  }
  uint64_t capacity = std::max<uint64_t>(capacity_, 16);
  while (capacity < need) capacity *= 2;
  return static_cast<uint32_t>(std::min<uint64_t>(capacity, kMaxSlots));
}

uint32_t SlotBook::FittedCapacity() const {
  uint64_t longest = 0;
  for (uint32_t n : length_) longest = std::max<uint64_t>(longest, n);
  if (uint64_t{capacity_} < 4 * std::max<uint64_t>(longest, 16)) return capacity_;
  uint64_t fitted = 16;
  while (fitted < 2 * longest) fitted *= 2;
  return static_cast<uint32_t>(fitted);
}

void SlotBook::Grow(uint32_t count) {
  for (uint32_t& n : length_) n += count;
}

void SlotBook::Shrink(uint32_t count) {
  for (uint32_t& n : length_) n -= std::min(n, count);
}

std::vector<kernels::StreamSlice> SlotBook::Slices(absl::Span<const uint32_t> budget,
                                                   uint32_t protect) const {
  std::vector<kernels::StreamSlice> slices(length_.size());
  for (size_t s = 0; s < length_.size(); ++s) {
    slices[s] = {static_cast<uint32_t>(s * capacity_), length_[s], budget.empty() ? 0 : budget[s],
                 protect};
  }
  return slices;
}

KeepSets SlotBook::ToKeepSets(const uint8_t* flags) const {
  KeepSets keep(length_.size());
  ParallelFor(length_.size(), StreamGrain(capacity_), [&](size_t begin, size_t end) {
    for (size_t s = begin; s < end; ++s) keep[s] = ToKeepSet(static_cast<uint32_t>(s), flags);
  });
  return keep;
}

std::optional<KeepSet> SlotBook::ToKeepSet(uint32_t s, const uint8_t* flags) const {
  const uint32_t n = length_[s];
  if (n == 0) return std::nullopt;  // nothing to drop (and no flags: memchr takes no null)
  const uint8_t* f = flags + size_t{s} * capacity_;
  const void* zero = std::memchr(f, 0, n);
  if (zero == nullptr) return std::nullopt;  // every slot kept
  // Run by run of kept slots (one or two runs at the decode steady state).
  KeepSet kept;
  uint32_t j = 0;
  while (j < n) {
    const void* stop = std::memchr(f + j, 0, n - j);
    const uint32_t end =
        stop == nullptr ? n : static_cast<uint32_t>(static_cast<const uint8_t*>(stop) - f);
    kept.AddRun(j, end);
    j = end + 1;
  }
  return kept;
}

absl::Status SlotBook::FromKeepSets(const KeepSets& keep, uint8_t* flags) const {
  if (keep.size() != length_.size()) {
    return absl::InternalError(
        absl::StrCat("slot state: ", keep.size(), " keep-sets for ", length_.size(), " streams"));
  }
  for (size_t s = 0; s < length_.size(); ++s) {
    uint8_t* f = flags + s * capacity_;
    const uint32_t n = length_[s];
    if (!keep[s]) {
      std::fill(f, f + n, 1);
      continue;
    }
    std::fill(f, f + n, 0);
    if (!keep[s]->ValidFor(n)) {
      return absl::InternalError(
          absl::StrCat("slot state: keep-set of stream ", s, " is not ascending within ", n));
    }
    for (const SlotRun& r : keep[s]->runs()) std::fill(f + r.begin, f + r.end, 1);
  }
  return absl::OkStatus();
}

absl::Status SlotBook::CheckStep(absl::Span<const absl::Span<const float>> rows,
                                 absl::Span<const uint32_t> budget) const {
  if (rows.size() != length_.size() || budget.size() != length_.size()) {
    return absl::InternalError("slot state: step needs one row and one budget per stream");
  }
  for (size_t s = 0; s < length_.size(); ++s) {
    if (rows[s].size() != length_[s]) {
      return absl::InternalError(absl::StrCat("slot state: row of stream ", s, " has ",
                                              rows[s].size(), " values for ", length_[s],
                                              " slots"));
    }
  }
  return absl::OkStatus();
}

absl::Status SlotBook::CheckScores(const std::vector<std::vector<float>>& scores) const {
  if (scores.size() != length_.size()) {
    return absl::InternalError("slot state: one score vector per stream expected");
  }
  for (size_t s = 0; s < length_.size(); ++s) {
    if (scores[s].size() != length_[s]) {
      return absl::InternalError(absl::StrCat("slot state: ", scores[s].size(),
                                              " scores for stream ", s, " of ", length_[s]));
    }
  }
  return absl::OkStatus();
}

void SlotBook::ApplyKeep(const KeepSets& keep) {
  for (size_t s = 0; s < length_.size(); ++s) {
    if (keep[s]) length_[s] = static_cast<uint32_t>(keep[s]->size());
  }
}

namespace {

// Items grouped by their state's stepper, in their order (a handful of steppers at most:
// one per device); items whose state has none are left out.
template <typename T, typename StateOf>
std::vector<std::pair<SlotStepper*, std::vector<T*>>> ByStepper(absl::Span<T> items,
                                                                StateOf state_of) {
  std::vector<std::pair<SlotStepper*, std::vector<T*>>> groups;
  for (T& item : items) {
    SlotStepper* stepper = state_of(item)->stepper();
    if (stepper == nullptr) continue;
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& g) { return g.first == stepper; });
    if (group == groups.end()) group = groups.insert(groups.end(), {stepper, {}});
    group->second.push_back(&item);
  }
  return groups;
}

// Runs `calls` (SlotAppendCall or SlotStepCall) by stepper: each stepper's group with
// `together`, the calls whose state has none one by one with `alone`. A call that runs out
// of host memory fails with `why` (a stepper's group whole: it allocates before it
// launches, and catches what could throw after).
template <typename Call, typename Together, typename Alone>
void RunByStepper(absl::Span<Call> calls, const char* why, Together together, Alone alone) {
  for (auto& [stepper, group] : ByStepper(calls, [](Call& c) { return c.state; })) {
    try {
      together(stepper, group);
    } catch (const std::bad_alloc&) {
      for (Call* call : group) call->status = absl::ResourceExhaustedError(why);
    }
  }
  for (Call& call : calls) {
    if (call.state->stepper() != nullptr) continue;
    try {
      call.status = alone(call);
    } catch (const std::bad_alloc&) {
      // The engine aborts a step that fails (AbortStep); an Append that throws grows nothing.
      call.status = absl::ResourceExhaustedError(why);
    }
  }
}

}  // namespace

void CommitSlotStates(absl::Span<SlotState* const> states) {
  std::vector<SlotState*> all(states.begin(), states.end());
  for (auto& [stepper, group] : ByStepper(absl::MakeSpan(all), [](SlotState* s) { return s; })) {
    std::vector<SlotState*> members;
    for (SlotState** s : group) members.push_back(*s);
    stepper->CommitAll(members);
  }
}

void AppendSlotStates(absl::Span<SlotAppendCall> calls) {
  RunByStepper(
      calls, "slot state append: out of host memory",
      [](SlotStepper* stepper, absl::Span<SlotAppendCall* const> group) {
        stepper->AppendAll(group);
      },
      [](SlotAppendCall& c) { return c.state->Append(c.positions, c.initial_score); });
}

void StepSlotStates(absl::Span<SlotStepCall> calls) {
  RunByStepper(
      calls, "slot state step: out of host memory",
      [](SlotStepper* stepper, absl::Span<SlotStepCall* const> group) { stepper->StepAll(group); },
      [](SlotStepCall& c) { return c.state->Step(c.op, c.rows, c.budget, c.protect, c.keep); });
}

namespace {

class HostSlotState final : public BookedSlotState, public HostScores {
 public:
  explicit HostSlotState(uint32_t num_streams) : BookedSlotState(num_streams) {}

  HostScores* host_scores() override { return this; }
  absl::Span<const float> scores(uint32_t s) const override {
    return {scores_.data() + size_t{s} * book_.capacity(), book_.length(s)};
  }
  void PrepareStage() override { spare_scores_.resize(scores_.size()); }
  absl::Span<float> staged(uint32_t s) override {
    return {spare_scores_.data() + size_t{s} * book_.capacity(), book_.length(s)};
  }
  void CommitStaged() override {
    scores_.swap(spare_scores_);
    saved_ = false;  // the spare holds nothing to restore
    pending_ = false;
  }

  uint64_t BytesAt(uint32_t capacity) const override {
    return uint64_t{capacity} * book_.num_streams() * (2 * sizeof(float) + sizeof(int64_t) + 1);
  }

  absl::Status Append(absl::Span<const int64_t> positions, float initial_score) override {
    const uint32_t count = static_cast<uint32_t>(positions.size());
    if (absl::Status s = EnsureCapacity(count); !s.ok()) return s;
    const uint32_t cap = book_.capacity();
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      const size_t at = size_t{s} * cap + book_.length(s);
      std::copy(positions.begin(), positions.end(), positions_.begin() + at);
      std::fill_n(scores_.begin() + at, count, initial_score);
    }
    book_.Grow(count);
    pending_ = false;
    return absl::OkStatus();
  }

  absl::Status Step(const kernels::ScoreStep& step, absl::Span<const absl::Span<const float>> rows,
                    absl::Span<const uint32_t> budget, uint32_t protect, KeepSets* keep) override {
    const uint32_t S = book_.num_streams();
    if (absl::Status s = book_.CheckStep(rows, budget); !s.ok()) return s;
    const size_t cap = book_.capacity();
    // The new scores go to the spare buffer, which then becomes the scores: the old ones
    // stay intact for AbortStep, also when this throws half-way (host memory).
    spare_scores_.resize(scores_.size());
    KeepSets sets(S);
    uint32_t longest = 0;
    for (uint32_t s = 0; s < S; ++s) longest = std::max(longest, book_.length(s));
    // One pass per stream while its slots are in cache: score update, selection, keep-set;
    // the streams split across cores (each writes only its own slots and set).
    ParallelFor(S, StreamGrain(longest), [&](size_t begin, size_t end) {
      for (size_t s = begin; s < end; ++s) {
        const uint32_t n = book_.length(static_cast<uint32_t>(s));
        float* scores = spare_scores_.data() + s * cap;
        const kernels::StreamSlice one{0, n, budget[s], protect};
        float max_score = 0;
        kernels::UpdateScoresRef(step.rule, step.lambda, &one, 1, rows[s].data(),
                                 scores_.data() + s * cap, scores, &max_score);
        if (!step.select) continue;
        kernels::SelectTopRef(&one, 1, scores, step.normalize ? &max_score : nullptr,
                              positions_.data() + s * cap, step.attention_weight,
                              flags_.data() + s * cap);
        sets[s] = book_.ToKeepSet(static_cast<uint32_t>(s), flags_.data());
      }
    });
    scores_.swap(spare_scores_);
    saved_ = true;
    *keep = std::move(sets);
    pending_ = step.select;
    return absl::OkStatus();
  }

  absl::Status Keep(const KeepSets& keep) override {
    pending_ = false;
    if (absl::Status s = book_.FromKeepSets(keep, flags_.data()); !s.ok()) return s;
    if (absl::Status s = Compact(); !s.ok()) return s;
    FitCapacity();
    return absl::OkStatus();
  }

  absl::Status ReadScores(std::vector<std::vector<float>>* scores) override {
    scores->resize(book_.num_streams());
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      const auto first = scores_.begin() + size_t{s} * book_.capacity();
      (*scores)[s].assign(first, first + book_.length(s));
    }
    return absl::OkStatus();
  }

  absl::Status WriteScores(const std::vector<std::vector<float>>& scores) override {
    if (absl::Status s = book_.CheckScores(scores); !s.ok()) return s;
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      std::copy(scores[s].begin(), scores[s].end(), scores_.begin() + size_t{s} * book_.capacity());
    }
    return absl::OkStatus();
  }

  absl::Status ReadPositions(std::vector<std::vector<int64_t>>* positions) override {
    positions->resize(book_.num_streams());
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      const auto first = positions_.begin() + size_t{s} * book_.capacity();
      (*positions)[s].assign(first, first + book_.length(s));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<SlotState>> Clone() const override {
    auto copy = std::make_unique<HostSlotState>(*this);
    copy->pending_ = false;
    copy->saved_ = false;
    copy->spare_scores_ = {};
    return copy;
  }

 private:
  absl::Status Relayout(uint32_t capacity) override {
    const uint32_t old = book_.capacity();
    std::vector<float> scores(size_t{capacity} * book_.num_streams());
    std::vector<int64_t> positions(scores.size());
    std::vector<uint8_t> flags(scores.size(), 0);  // every allocation before any change
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      std::copy_n(scores_.begin() + size_t{s} * old, book_.length(s),
                  scores.begin() + size_t{s} * capacity);
      std::copy_n(positions_.begin() + size_t{s} * old, book_.length(s),
                  positions.begin() + size_t{s} * capacity);
    }
    scores_ = std::move(scores);
    positions_ = std::move(positions);
    flags_ = std::move(flags);
    book_.set_capacity(capacity);
    return absl::OkStatus();
  }

  absl::Status RestoreScores() override {
    scores_.swap(spare_scores_);
    return absl::OkStatus();
  }

  // CompactSlots' result for scores and positions (select.h), from each stream's first
  // dropped slot on, one memmove per run of kept slots: at the decode steady state one slot
  // goes, the prefix before it stays where it is and the rest moves down by one. Runs past
  // a Step's point of no return: no allocation, no threads.
  absl::Status Compact() override {
    const size_t cap = book_.capacity();
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      const uint32_t n = book_.length(s);
      if (n == 0) continue;  // (no flags at all while every stream is empty)
      const uint8_t* f = flags_.data() + s * cap;
      const void* first_dropped = std::memchr(f, 0, n);
      if (first_dropped == nullptr) continue;
      float* scores = scores_.data() + s * cap;
      int64_t* positions = positions_.data() + s * cap;
      uint32_t r = static_cast<uint32_t>(static_cast<const uint8_t*>(first_dropped) - f);
      uint32_t j = r + 1;
      while (j < n) {
        if (!f[j]) {
          ++j;
          continue;
        }
        const void* stop = std::memchr(f + j, 0, n - j);
        const uint32_t end =
            stop == nullptr ? n : static_cast<uint32_t>(static_cast<const uint8_t*>(stop) - f);
        std::memmove(scores + r, scores + j, (end - j) * sizeof(float));
        std::memmove(positions + r, positions + j, (end - j) * sizeof(int64_t));
        r += end - j;
        j = end;
      }
      book_.set_length(s, r);
    }
    return absl::OkStatus();
  }

  std::vector<float> scores_;
  // A Step's new scores while it runs; then, until the step ends, the scores before it.
  std::vector<float> spare_scores_;
  std::vector<int64_t> positions_;
  std::vector<uint8_t> flags_;
};

}  // namespace

// Scores only, one column per stream with a dead front (SlotColumn): a Keep closes each
// stream up toward the end that moves fewer slots, as the stream's own vectors do.
class HostScoreState final : public SlotState, public HostScores {
 public:
  explicit HostScoreState(uint32_t num_streams) : scores_(num_streams), staged_(num_streams) {}

  uint32_t num_streams() const override { return static_cast<uint32_t>(scores_.size()); }
  uint32_t length(uint32_t s) const override { return static_cast<uint32_t>(scores_[s].size()); }
  uint64_t bytes() const override {
    uint64_t n = 0;
    for (size_t s = 0; s < scores_.size(); ++s) {
      n += scores_[s].capacity() + staged_[s].capacity();
    }
    return n * sizeof(float);
  }
  uint64_t AppendGrowth(uint32_t count) const override {
    uint64_t n = 0;
    for (const SlotColumn<float>& c : scores_) n += c.GrowthBytes(count);
    return n;
  }
  absl::Status Append(absl::Span<const int64_t> positions, float initial_score) override {
    for (SlotColumn<float>& c : scores_) c.Reserve(positions.size());  // may throw: no change
    for (SlotColumn<float>& c : scores_) c.AppendFill(positions.size(), initial_score);
    return absl::OkStatus();
  }
  void DropNewest(uint32_t count) override {
    for (SlotColumn<float>& c : scores_) c.Truncate(c.size() - std::min<size_t>(c.size(), count));
  }
  absl::Status Step(const kernels::ScoreStep&, absl::Span<const absl::Span<const float>>,
                    absl::Span<const uint32_t>, uint32_t, KeepSets*) override {
    return absl::InternalError("slot state: a host score state has no kernel step");
  }
  absl::Status CommitStep() override { return absl::OkStatus(); }
  absl::Status AbortStep() override { return absl::OkStatus(); }
  absl::Status Keep(const KeepSets& keep) override {
    if (keep.size() != scores_.size()) {
      return absl::InternalError(
          absl::StrCat("slot state: ", keep.size(), " keep-sets for ", scores_.size(), " streams"));
    }
    for (size_t s = 0; s < keep.size(); ++s) {
      if (keep[s] && !keep[s]->ValidFor(static_cast<uint32_t>(scores_[s].size()))) {
        return absl::InternalError(absl::StrCat("slot state: keep-set of stream ", s,
                                                " is not ascending within ", scores_[s].size()));
      }
    }
    for (size_t s = 0; s < keep.size(); ++s) {
      if (keep[s]) KeepRuns(*keep[s], [&](auto&& f) { f(scores_[s], size_t{1}); });
    }
    return absl::OkStatus();
  }
  absl::Status ReadScores(std::vector<std::vector<float>>* scores) override {
    scores->resize(scores_.size());
    for (size_t s = 0; s < scores_.size(); ++s) {
      (*scores)[s].assign(scores_[s].span().begin(), scores_[s].span().end());
    }
    return absl::OkStatus();
  }
  absl::Status WriteScores(const std::vector<std::vector<float>>& scores) override {
    if (scores.size() != scores_.size()) {
      return absl::InternalError("slot state: one score vector per stream expected");
    }
    for (size_t s = 0; s < scores_.size(); ++s) {
      if (scores[s].size() != scores_[s].size()) {
        return absl::InternalError(absl::StrCat(
            "slot state: ", scores[s].size(), " scores for stream ", s, " of ", scores_[s].size()));
      }
      std::copy(scores[s].begin(), scores[s].end(), scores_[s].data());
    }
    return absl::OkStatus();
  }
  absl::Status ReadPositions(std::vector<std::vector<int64_t>>*) override {
    return absl::FailedPreconditionError("slot state: a host score state keeps no positions");
  }
  absl::StatusOr<std::unique_ptr<SlotState>> Clone() const override {
    auto copy = std::make_unique<HostScoreState>(num_streams());
    copy->scores_ = scores_;  // the live values only
    return copy;
  }

  HostScores* host_scores() override { return this; }
  absl::Span<const float> scores(uint32_t s) const override { return scores_[s].span(); }
  void PrepareStage() override {
    for (size_t s = 0; s < scores_.size(); ++s) staged_[s].resize(scores_[s].size());
  }
  absl::Span<float> staged(uint32_t s) override { return absl::MakeSpan(staged_[s]); }
  void CommitStaged() override {
    for (size_t s = 0; s < scores_.size(); ++s) scores_[s].Swap(staged_[s]);
  }

 private:
  std::vector<SlotColumn<float>> scores_;
  std::vector<std::vector<float>> staged_;  // the next scores of a call, until its commit
};

std::unique_ptr<SlotState> MakeHostScoreState(uint32_t num_streams) {
  return std::make_unique<HostScoreState>(num_streams);
}

std::unique_ptr<SlotState> MakeHostSlotState(uint32_t num_streams) {
  return std::make_unique<HostSlotState>(num_streams);
}

}  // namespace kvmem::store
