#include "server/engine/sequence.h"

#include <algorithm>

namespace kvmem::engine {
namespace {
// Slots before the first eviction stay where they are; only the rest shift.
template <typename T>
void KeepIndices(std::vector<T>& v, const std::vector<uint32_t>& keep, size_t first_moved) {
  for (size_t j = first_moved; j < keep.size(); ++j) v[j] = v[keep[j]];
  v.resize(keep.size());
}
}  // namespace

void Stream::KeepSlots(const std::vector<uint32_t>& keep, uint32_t history_rows) {
  size_t first_moved = 0;
  while (first_moved < keep.size() && keep[first_moved] == first_moved) ++first_moved;
  KeepIndices(positions, keep, first_moved);
  if (!scores.empty()) KeepIndices(scores, keep, first_moved);  // empty: they live in SlotState
  KeepIndices(token_entropy, keep, first_moved);
  KeepIndices(layer_distance, keep, first_moved);
  KeepIndices(arrival_step, keep, first_moved);
  if (history_rows > 0) {
    const size_t R = history_rows;
    for (size_t j = first_moved; j < keep.size(); ++j) {
      std::copy_n(history.begin() + keep[j] * R, R, history.begin() + j * R);
    }
    history.resize(keep.size() * R);
  }
}

uint64_t Stream::host_bytes() const {
  return sizeof(Stream) + blocks.capacity() * sizeof(StreamBlock) +
         positions.capacity() * sizeof(int64_t) + scores.capacity() * sizeof(float) +
         next_scores.capacity() * sizeof(float) + history.capacity() * sizeof(float) +
         token_entropy.capacity() * sizeof(float) + layer_distance.capacity() * sizeof(float) +
         arrival_step.capacity() * sizeof(int64_t);
}

uint64_t Sequence::host_bytes() const {
  uint64_t bytes = sizeof(Sequence) + token_ids.capacity() * sizeof(int32_t);
  for (const Stream& s : streams) bytes += s.host_bytes();
  return bytes;
}

uint32_t Sequence::max_stream_tokens() const {
  size_t n = 0;
  for (const Stream& s : streams) n = std::max(n, s.size());
  return static_cast<uint32_t>(n);
}

uint64_t Sequence::retained_slots() const {
  uint64_t n = 0;
  for (const Stream& s : streams) n += s.size();
  return n;
}

uint64_t Sequence::kv_bytes() const {
  uint64_t bytes = 0;
  for (const Stream& s : streams) {
    for (const StreamBlock& b : s.blocks) bytes += format.KvBytes(b.precision, b.count);
  }
  return bytes;
}

uint64_t Sequence::block_count() const {
  uint64_t n = 0;
  for (const Stream& s : streams) n += s.blocks.size();
  return n;
}

uint64_t Sequence::block_bytes_held() const {
  uint64_t bytes = 0;
  for (const Stream& s : streams) {
    for (const StreamBlock& b : s.blocks) bytes += format.block_bytes(b.precision);
  }
  return bytes;
}

}  // namespace kvmem::engine
