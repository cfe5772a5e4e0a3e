#include "server/engine/sequence.h"

#include <algorithm>

namespace kvmem::engine {
namespace {
template <typename T>
void KeepIndices(std::vector<T>& v, const std::vector<uint32_t>& keep) {
  for (size_t j = 0; j < keep.size(); ++j) v[j] = v[keep[j]];
  v.resize(keep.size());
}
}  // namespace

void Stream::KeepSlots(const std::vector<uint32_t>& keep) {
  KeepIndices(positions, keep);
  KeepIndices(scores, keep);
  KeepIndices(token_entropy, keep);
  KeepIndices(layer_distance, keep);
  KeepIndices(arrival_step, keep);
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
