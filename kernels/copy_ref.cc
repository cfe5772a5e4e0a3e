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

std::vector<MoveWave> PlanMoveWaves(const std::vector<std::vector<CopyOp>>& batches) {
  std::vector<MoveWave> merged;
  for (const std::vector<CopyOp>& batch : batches) {
    const std::vector<MoveWave> own = PlanMoveWaves(batch.data(), batch.size());
    if (merged.size() < own.size()) merged.resize(own.size());
    for (size_t w = 0; w < own.size(); ++w) {
      MoveWave& into = merged[w];
      const uint64_t base = into.scratch_bytes;  // 16-aligned, as every wave's end is
      for (const CopyOp& op : own[w].gather) {
        into.gather.push_back({op.src, base + op.dst, op.bytes});
      }
      for (const CopyOp& op : own[w].scatter) {
        into.scatter.push_back({base + op.src, op.dst, op.bytes});
      }
      into.scratch_bytes = base + own[w].scratch_bytes;
    }
  }
  return merged;
}

}  // namespace kvmem::kernels
