#pragma once
// KeepSet: the slots of one stream that a policy keeps, as ascending runs of consecutive
// slot indices. A window's step keeps one run and confkv's decode steady state two, however
// long the stream is, so the engine validates, plans and compacts a keep-set run by run
// instead of slot by slot, and a keep-set of a few runs takes no heap memory.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

namespace kvmem {

// Slots [begin, end) of a stream.
struct SlotRun {
  uint32_t begin = 0;
  uint32_t end = 0;
  uint32_t size() const { return end - begin; }
  friend bool operator==(const SlotRun& a, const SlotRun& b) {
    return a.begin == b.begin && a.end == b.end;
  }
};

class KeepSet {
 public:
  KeepSet() = default;  // keeps nothing
  // Slots [begin, end).
  static KeepSet Range(uint32_t begin, uint32_t end) {
    KeepSet set;
    set.AddRun(begin, end);
    return set;
  }
  // The listed slots, in the order given (ascending for a valid set: ValidFor).
  static KeepSet FromSlots(absl::Span<const uint32_t> slots) {
    KeepSet set;
    for (uint32_t slot : slots) set.Add(slot);
    return set;
  }

  // Appends a slot, or the slots [begin, end), after those already in the set: a slot that
  // continues the last run extends it. Out of order, it starts a run that ValidFor rejects;
  // so does a reversed run (end < begin), while an empty one adds nothing.
  void Add(uint32_t slot) {
    if (slot == UINT32_MAX) {
      overflow_ = true;  // no stream has that slot
      return;
    }
    AddRun(slot, slot + 1);
  }
  void AddRun(uint32_t begin, uint32_t end) {
    if (end < begin) overflow_ = true;  // a reversed run: a caller's arithmetic went wrong
    if (end <= begin) return;
    if (!runs_.empty() && runs_.back().end == begin) {
      runs_.back().end = end;
    } else {
      runs_.push_back({begin, end});
    }
    size_ += end - begin;
  }

  size_t size() const { return size_; }  // slots kept
  bool empty() const { return size_ == 0; }
  // Ascending, maximal (no two touch) and non-empty in a valid set.
  absl::Span<const SlotRun> runs() const { return runs_; }
  // Whether the set is a valid keep-set of a stream of n slots: ascending runs that neither
  // touch nor overlap, all below n. O(runs).
  bool ValidFor(size_t n) const {
    if (overflow_) return false;
    size_t floor = 0;  // the lowest slot the next run may start at
    for (size_t i = 0; i < runs_.size(); ++i) {
      const SlotRun& r = runs_[i];
      if (r.begin >= r.end || r.begin < floor || r.end > n) return false;
      floor = size_t{r.end} + 1;
    }
    return true;
  }
  // The kept slots, ascending.
  std::vector<uint32_t> Slots() const { return {begin(), end()}; }

  // Iteration over the kept slots (tests and the few callers that need slot indices).
  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = uint32_t;
    using difference_type = std::ptrdiff_t;
    using pointer = const uint32_t*;
    using reference = uint32_t;
    const_iterator() = default;
    const_iterator(const SlotRun* run, uint32_t slot) : run_(run), slot_(slot) {}
    uint32_t operator*() const { return slot_; }
    const_iterator& operator++() {
      if (++slot_ == run_->end) {
        ++run_;
        slot_ = run_stop_ == run_ ? 0 : run_->begin;
      }
      return *this;
    }
    const_iterator operator++(int) {
      const_iterator was = *this;
      ++*this;
      return was;
    }
    friend bool operator==(const const_iterator& a, const const_iterator& b) {
      return a.run_ == b.run_ && a.slot_ == b.slot_;
    }
    friend bool operator!=(const const_iterator& a, const const_iterator& b) { return !(a == b); }

   private:
    friend class KeepSet;
    const SlotRun* run_ = nullptr;
    const SlotRun* run_stop_ = nullptr;  // one past the last run
    uint32_t slot_ = 0;
  };
  using value_type = uint32_t;
  using iterator = const_iterator;
  const_iterator begin() const {
    const_iterator it(runs_.data(), runs_.empty() ? 0 : runs_.front().begin);
    it.run_stop_ = runs_.data() + runs_.size();
    return it;
  }
  const_iterator end() const {
    const_iterator it(runs_.data() + runs_.size(), 0);
    it.run_stop_ = it.run_;
    return it;
  }

  friend bool operator==(const KeepSet& a, const KeepSet& b) {
    return a.runs_ == b.runs_ && a.overflow_ == b.overflow_;
  }
  friend bool operator!=(const KeepSet& a, const KeepSet& b) { return !(a == b); }

 private:
  absl::InlinedVector<SlotRun, 2> runs_;
  size_t size_ = 0;
  bool overflow_ = false;  // given a slot past every stream, or a reversed run
};

}  // namespace kvmem
