#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>

#include "kernels/copy.h"

namespace kvmem::kernels {

void MoveBatchRef(uint8_t* base, const CopyOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) std::memmove(base + ops[i].dst, base + ops[i].src, ops[i].bytes);
}

void CopyBatchRef(const uint8_t* src, uint8_t* dst, const CopyOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) std::memcpy(dst + ops[i].dst, src + ops[i].src, ops[i].bytes);
}

void ScatterBatchRef(const uint8_t* src, const ScatterOp* ops, size_t n) {
  for (size_t i = 0; i < n; ++i) std::memcpy(ops[i].dst, src + ops[i].src, ops[i].bytes);
}

namespace {
// Disjoint byte ranges [begin, end) written so far in the current wave, keyed by begin.
class RangeSet {
 public:
  bool Overlaps(uint64_t begin, uint64_t end) const {
    if (begin >= end) return false;
    auto it = ranges_.upper_bound(begin);  // first range starting after begin
    if (it != ranges_.end() && it->first < end) return true;
    if (it == ranges_.begin()) return false;
    return std::prev(it)->second > begin;
  }
  // Adds [begin, end), merging with neighbours it touches.
  void Add(uint64_t begin, uint64_t end) {
    if (begin >= end) return;
    auto it = ranges_.lower_bound(begin);
    if (it != ranges_.begin() && std::prev(it)->second >= begin) --it;
    while (it != ranges_.end() && it->first <= end) {
      begin = std::min(begin, it->first);
      end = std::max(end, it->second);
      it = ranges_.erase(it);
    }
    ranges_.emplace(begin, end);
  }
  void Clear() { ranges_.clear(); }

 private:
  std::map<uint64_t, uint64_t> ranges_;
};
}  // namespace

std::vector<size_t> MoveWaves(const CopyOp* ops, size_t n) {
  std::vector<size_t> starts;
  RangeSet written;
  for (size_t i = 0; i < n; ++i) {
    const CopyOp& op = ops[i];
    const bool hazard =
        written.Overlaps(op.src, op.src + op.bytes) || written.Overlaps(op.dst, op.dst + op.bytes);
    if (starts.empty() || hazard) {
      starts.push_back(i);
      written.Clear();
    }
    written.Add(op.dst, op.dst + op.bytes);
  }
  return starts;
}

std::vector<MoveWave> PlanMoveWaves(const CopyOp* ops, size_t n) {
  const std::vector<size_t> starts = MoveWaves(ops, n);
  std::vector<MoveWave> waves(starts.size());
  for (size_t w = 0; w < starts.size(); ++w) {
    const size_t end = w + 1 < starts.size() ? starts[w + 1] : n;
    MoveWave& wave = waves[w];
    for (size_t i = starts[w]; i < end; ++i) {
      wave.gather.push_back({ops[i].src, wave.scratch_bytes, ops[i].bytes});
      wave.scatter.push_back({wave.scratch_bytes, ops[i].dst, ops[i].bytes});
      wave.scratch_bytes = (wave.scratch_bytes + ops[i].bytes + 15) / 16 * 16;
    }
  }
  return waves;
}

}  // namespace kvmem::kernels
