#pragma once
// SlotColumn: one per-slot vector with a dead front; KeepRuns: closes a set of such columns
// up to a keep-set, toward the end that moves fewer slots. A stream's per-slot vectors
// (engine/sequence.h) and a host score state (store/slot_state.h) are made of them.
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "server/common/keep_set.h"

namespace kvmem {

// One per-slot vector, with a dead front: slots that leave from the front (a
// window's eviction, every step) cost nothing to drop, and the room they leave is taken back
// when an append needs it and the dead front is at least as long as the live slots, so that
// each slot is moved at most once per slot dropped (amortized O(1)). Holds at most twice
// the live values and the append that last grew it. A copy holds the live values only.
template <typename T>
class SlotColumn {
 public:
  SlotColumn() = default;
  SlotColumn(const SlotColumn& other) : v_(other.span().begin(), other.span().end()) {}
  SlotColumn& operator=(const SlotColumn& other) {
    if (this != &other) Assign(std::vector<T>(other.span().begin(), other.span().end()));
    return *this;
  }
  SlotColumn(SlotColumn&& other) noexcept
      : v_(std::move(other.v_)), front_(std::exchange(other.front_, 0)) {
    other.v_.clear();
  }
  SlotColumn& operator=(SlotColumn&& other) noexcept {
    if (this == &other) return *this;
    v_ = std::move(other.v_);
    front_ = std::exchange(other.front_, 0);
    other.v_.clear();
    return *this;
  }

  size_t size() const { return v_.size() - front_; }
  absl::Span<const T> span() const { return absl::MakeConstSpan(v_).subspan(front_); }
  T* data() { return v_.data() + front_; }
  size_t capacity() const { return v_.capacity(); }
  // Room for `more` values at the end, so that Append and AppendFill do not allocate. May
  // throw (then nothing changed).
  void Reserve(size_t more) {
    if (v_.size() + more <= v_.capacity()) return;
    if (ClosesUp(more)) {
      v_.erase(v_.begin(), v_.begin() + static_cast<ptrdiff_t>(front_));
      front_ = 0;
      return;
    }
    std::vector<T> grown;
    grown.reserve(GrownCapacity(more));
    grown.assign(v_.begin() + static_cast<ptrdiff_t>(front_), v_.end());
    v_.swap(grown);
    front_ = 0;
  }
  // Bytes by which Reserve(more) would raise capacity() * sizeof(T).
  size_t GrowthBytes(size_t more) const {
    if (v_.size() + more <= v_.capacity() || ClosesUp(more)) return 0;
    return (GrownCapacity(more) - v_.capacity()) * sizeof(T);
  }
  // Into room Reserve made (then they cannot throw); without it they make the room first.
  void Append(absl::Span<const T> values) {
    Reserve(values.size());
    v_.insert(v_.end(), values.begin(), values.end());
  }
  void AppendFill(size_t n, T value) {
    Reserve(n);
    v_.insert(v_.end(), n, value);
  }
  // Drops the first n values without moving the others.
  void DropFront(size_t n) {
    front_ += n;
    if (front_ == v_.size()) Clear();
  }
  // Keeps the first n values (n <= size()).
  void Truncate(size_t n) { v_.resize(front_ + n); }
  // Copies values [from, from + n) to [to, to + n), to <= from (one memmove for trivial T).
  void MoveDown(size_t from, size_t to, size_t n) {
    std::copy(data() + from, data() + from + n, data() + to);
  }
  // The same with to >= from.
  void MoveUp(size_t from, size_t to, size_t n) {
    std::copy_backward(data() + from, data() + from + n, data() + to + n);
  }
  void Clear() {
    v_.clear();
    front_ = 0;
  }
  void Assign(std::vector<T> values) {
    v_ = std::move(values);
    front_ = 0;
  }
  // The values as a vector (the column is left empty); drops the dead front first.
  std::vector<T> Take() {
    v_.erase(v_.begin(), v_.begin() + static_cast<ptrdiff_t>(front_));
    front_ = 0;
    return std::exchange(v_, {});
  }
  // Takes `other`'s values as the column's and gives `other` the old buffer, whose contents
  // are left unspecified (a staging buffer, overwritten before its next use).
  void Swap(std::vector<T>& other) {
    v_.swap(other);
    front_ = 0;
  }

 private:
  // Reserve's two ways to make room: close up over a dead front at least as long as the
  // live values (no allocation), or move into a buffer of twice what is then needed.
  bool ClosesUp(size_t more) const { return front_ >= size() && size() + more <= v_.capacity(); }
  size_t GrownCapacity(size_t more) const { return 2 * (size() + more); }

  std::vector<T> v_;
  size_t front_ = 0;  // v_[0, front_) is dead
};

// Keeps only the slots of `keep` (ascending, within the columns) in every column
// for_each_column names (it calls f(column, values per slot) on each; all hold the same
// slots), closing them up toward whichever end moves fewer (one move per column and run):
// toward the front, the run the first kept slot starts stays and everything after it moves
// down; toward the back, the run the last kept slot ends stays and everything before it
// moves up, and the vacated front is dropped without moving (dead front). A window's head
// eviction moves nothing either way; one slot out of the middle (confkv's steady state)
// moves a quarter of the slots on average, not half. Never allocates.
template <typename ForEachColumn>
void KeepRuns(const KeepSet& keep, ForEachColumn&& for_each_column) {
  const absl::Span<const SlotRun> runs = keep.runs();
  if (runs.empty()) {
    for_each_column([](auto& column, size_t) { column.Clear(); });
    return;
  }
  const size_t k = keep.size();
  if (k - runs.front().size() <= k - runs.back().size()) {
    const size_t drop = runs.front().begin;
    for_each_column([&](auto& column, size_t width) { column.DropFront(drop * width); });
    size_t to = runs.front().size();
    for (size_t r = 1; r < runs.size(); ++r) {
      const size_t from = runs[r].begin - drop, n = runs[r].size();
      for_each_column([&](auto& column, size_t width) {
        column.MoveDown(from * width, to * width, n * width);
      });
      to += n;
    }
    for_each_column([&](auto& column, size_t width) { column.Truncate(k * width); });
    return;
  }
  const size_t last = runs.back().end;
  for_each_column([&](auto& column, size_t width) { column.Truncate(last * width); });
  size_t end = runs.back().begin;  // where the runs still to move end
  for (size_t r = runs.size() - 1; r-- > 0;) {
    const size_t from = runs[r].begin, n = runs[r].size();
    end -= n;
    for_each_column(
        [&](auto& column, size_t width) { column.MoveUp(from * width, end * width, n * width); });
  }
  for_each_column([&](auto& column, size_t width) { column.DropFront(end * width); });
}

}  // namespace kvmem
