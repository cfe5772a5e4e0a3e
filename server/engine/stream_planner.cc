#include "server/engine/stream_planner.h"

#include <algorithm>

#include "kernels/block_layout.h"

namespace kvmem::engine {
namespace {

// Appends a move, merging it into the previous one when both ranges continue it and one
// memmove of the union does what the two sequential ones would: the first move's
// destination must not overwrite the second's source before it is read.
void PushMove(std::vector<store::MoveOp>& ops, uint64_t src, uint64_t dst, uint64_t bytes) {
  if (!ops.empty()) {
    store::MoveOp& last = ops.back();
    if (last.src + last.bytes == src && last.dst + last.bytes == dst &&
        (last.dst <= last.src || last.dst >= src + bytes)) {
      last.bytes += bytes;
      return;
    }
  }
  ops.push_back({src, dst, bytes});
}

}  // namespace

EntryRange EvictedEntries(absl::Span<const StreamBlock> blocks, uint64_t slots,
                          const KeepSet& keep) {
  // The first and last slots the keep-set drops.
  const absl::Span<const SlotRun> runs = keep.runs();
  const uint64_t first_out = runs.empty() || runs.front().begin > 0 ? 0 : runs.front().end;
  const uint64_t last_out =
      runs.empty() || runs.back().end < slots ? slots - 1 : runs.back().begin - 1;
  EntryRange range{0, blocks.size(), 0};
  uint64_t slot = 0;  // the stream index of entry i's first slot
  size_t i = 0;
  for (; i < blocks.size() && slot + blocks[i].count <= first_out; ++i) slot += blocks[i].count;
  range.begin = i;
  range.first_slot = slot;
  for (; i < blocks.size() && slot + blocks[i].count <= last_out; ++i) slot += blocks[i].count;
  range.end = std::min(i + 1, blocks.size());
  if (range.begin > 0) range.first_slot -= blocks[--range.begin].count;
  if (range.end < blocks.size()) ++range.end;
  return range;
}

uint64_t StreamPlanner::BlocksForAppend(const std::vector<StreamBlock>& blocks,
                                        uint64_t tokens) const {
  const uint32_t B = format_.block_tokens();
  uint64_t room = 0;
  uint64_t copies = 0;
  if (!blocks.empty() && blocks.back().precision == Precision::kLayout) {
    room = B - (blocks.back().start + blocks.back().count);
    if (room > 0 && Shared(blocks.back().id)) copies = 1;
  }
  if (tokens <= room) return copies;
  return copies + (tokens - room + B - 1) / B;
}

absl::StatusOr<store::BlockId> StreamPlanner::Allocate(Precision p, bool reclaims) {
  if (p == Precision::kLayout && !reserve_.empty()) {
    const store::BlockId id = reserve_.back();
    reserve_.pop_back();
    return id;
  }
  // A block that replaces a bigger one the batch frees may take the pool's reserve, so
  // that a full pool can still quantize its way to free memory.
  const store::BlockPool::Use use =
      reclaims ? store::BlockPool::Use::kReclaim : store::BlockPool::Use::kGrow;
  if (failpoints_ != nullptr && failpoints_->Hit(Failpoints::kAllocate)) {
    return absl::ResourceExhaustedError("pool: allocation failed (failpoint)");
  }
  // Room first (doubling, as push_back would): once the block is taken, noting it in the
  // batch cannot throw (the batch's owner gives back what it notes, however the plan ends).
  if (batch_->allocated.size() == batch_->allocated.capacity()) {
    batch_->allocated.reserve(std::max<size_t>(16, 2 * batch_->allocated.capacity()));
  }
  std::vector<store::BlockId> ids;
  if (absl::Status s =
          pool_->AllocateMany(static_cast<uint32_t>(format_.block_bytes(p)), 1, &ids, use, tenant_);
      !s.ok()) {
    return s;
  }
  batch_->allocated.push_back(ids[0]);
  Failpoints::ThrowIfHit(failpoints_, Failpoints::kHostAlloc);
  return ids[0];
}

void StreamPlanner::MoveSlots(Precision p, uint64_t from, uint32_t src, uint64_t to, uint32_t dst,
                              uint32_t count) {
  ByteRange s[4], d[4], last[4];
  const int n = format_.SlotRanges(p, from, src, s);
  format_.SlotRanges(p, to, dst, d);
  // A slot's ranges are rows of planes: the run's rows follow each other. Checked on the
  // run's last slot, so that a format laid out otherwise moves slot by slot instead.
  format_.SlotRanges(p, from, src + count - 1, last);
  bool rows = true;
  for (int i = 0; i < n; ++i) {
    rows = rows && last[i].offset == s[i].offset + (count - 1) * s[i].bytes;
  }
  if (!rows) {
    for (uint32_t j = 0; j < count; ++j) MoveSlots(p, from, src + j, to, dst + j, 1);
    return;
  }
  for (int i = 0; i < n; ++i) {
    PushMove(batch_->moves, s[i].offset, d[i].offset, count * s[i].bytes);
  }
}

absl::Status StreamPlanner::Unshare(StreamBlock& block) {
  absl::StatusOr<store::BlockId> copy = Allocate(block.precision);
  if (!copy.ok()) return copy.status();
  // The whole block: codes, and for quantized blocks their per-block scales too.
  batch_->moves.push_back(
      {pool_->offset(block.id), pool_->offset(*copy), format_.block_bytes(block.precision)});
  batch_->dropped.push_back(block.id);
  block.id = *copy;
  block.version = 0;  // a new block: the commit stamps it
  return absl::OkStatus();
}

absl::Status StreamPlanner::Append(std::vector<StreamBlock>& blocks,
                                   absl::Span<const AppendRun> runs) {
  const uint32_t B = format_.block_tokens();
  const uint64_t row = format_.block_bytes(Precision::kLayout) / (2ull * B);
  bool unshared = false;
  for (const AppendRun& run : runs) {
    for (uint32_t i = 0; i < run.count;) {
      if (blocks.empty() || blocks.back().precision != Precision::kLayout ||
          blocks.back().start + blocks.back().count == B) {
        absl::StatusOr<store::BlockId> id = Allocate(Precision::kLayout);
        if (!id.ok()) return id.status();
        blocks.push_back({*id, 0, 0, Precision::kLayout});
        unshared = true;
      } else if (!unshared) {
        if (Shared(blocks.back().id)) {
          if (absl::Status s = Unshare(blocks.back()); !s.ok()) return s;
        }
        unshared = true;
      }
      StreamBlock& last = blocks.back();
      const uint32_t slot = last.start + last.count;
      const uint32_t n = std::min(run.count - i, B - slot);
      const uint64_t off = pool_->offset(last.id);
      const kernels::LayoutBlock plane{B, row};
      batch_->writes.push_back({run.k + i * row, off + plane.k_offset(slot), n * row});
      batch_->writes.push_back({run.v + i * row, off + plane.v_offset(slot), n * row});
      last.count += n;
      i += n;
    }
  }
  return absl::OkStatus();
}

absl::Status StreamPlanner::Keep(std::vector<StreamBlock>& blocks, const KeepSet& keep,
                                 uint64_t first_slot) {
  // In place: the list only loses blocks or shrinks them, so entry `out` is written after
  // entry `in` >= out was read. No allocation but the copy-on-write blocks.
  const absl::Span<const SlotRun> runs = keep.runs();
  size_t out = 0;
  size_t r = 0;                 // the first run that does not end before this block
  uint64_t first = first_slot;  // stream index of the block's first live slot
  for (size_t in = 0; in < blocks.size(); ++in) {
    StreamBlock block = blocks[in];
    const uint64_t last = first + block.count;  // one past the block's last live slot
    while (r < runs.size() && runs[r].end <= first) ++r;
    // Kept whole: one run covers the block (a window's step keeps every block but one so).
    if (r < runs.size() && runs[r].begin <= first && runs[r].end >= last) {
      blocks[out++] = block;
      first = last;
      continue;
    }
    // The runs that meet the block, [r, e), and their pieces in it as block-relative
    // ranges; the last of them may go on into the next block, so r stays.
    size_t e = r;
    while (e < runs.size() && runs[e].begin < last) ++e;
    const uint64_t at = first;
    const auto lo = [&runs, at](size_t i) {
      return static_cast<uint32_t>(std::max<uint64_t>(runs[i].begin, at) - at);
    };
    const auto hi = [&runs, at, last](size_t i) {
      return static_cast<uint32_t>(std::min<uint64_t>(runs[i].end, last) - at);
    };
    first = last;
    uint32_t kept = 0;
    for (size_t i = r; i < e; ++i) kept += hi(i) - lo(i);
    if (kept == 0) {
      batch_->dropped.push_back(block.id);
      continue;
    }
    if (e - r == 1) {  // one piece: already contiguous, no data moves
      block.start += lo(r);
      block.count = kept;
      blocks[out++] = block;
      continue;
    }
    if (Shared(block.id)) {
      if (absl::Status s = Unshare(block); !s.ok()) return s;
    }
    const uint64_t off = pool_->offset(block.id);
    // Pack toward whichever end leaves fewer slots to move: toward the front the first
    // piece stays and every later one moves down (ascending, so a memmove never overwrites
    // a piece still to be read); toward the back the last stays and the others move up,
    // descending, with the same property.
    if (kept - (hi(r) - lo(r)) <= kept - (hi(e - 1) - lo(e - 1))) {
      uint32_t to = block.start + hi(r);
      for (size_t i = r + 1; i < e; ++i) {
        MoveSlots(block.precision, off, block.start + lo(i), off, to, hi(i) - lo(i));
        to += hi(i) - lo(i);
      }
      block.start += lo(r);
    } else {
      uint32_t end = block.start + lo(e - 1);
      for (size_t i = e - 1; i-- > r;) {
        end -= hi(i) - lo(i);
        MoveSlots(block.precision, off, block.start + lo(i), off, end, hi(i) - lo(i));
      }
      block.start = end;
    }
    block.count = kept;
    block.version = 0;  // its slots moved: the commit stamps it
    blocks[out++] = block;
  }
  blocks.resize(out);
  return absl::OkStatus();
}

absl::Status StreamPlanner::Merge(std::vector<StreamBlock>& blocks) {
  const uint32_t B = format_.block_tokens();
  // In place, as in Keep: entry `out` - 1 is the merge target, written after it was read.
  size_t out = 0;
  for (size_t in = 0; in < blocks.size(); ++in) {
    StreamBlock block = blocks[in];
    if (out == 0) {
      blocks[out++] = block;
      continue;
    }
    StreamBlock& prev = blocks[out - 1];
    if (prev.precision != Precision::kLayout || block.precision != Precision::kLayout ||
        prev.count + block.count > B || Shared(prev.id) || Shared(block.id)) {
      blocks[out++] = block;
      continue;
    }
    const uint64_t prev_off = pool_->offset(prev.id);
    const uint64_t off = pool_->offset(block.id);
    if (block.start >= prev.count) {
      // prev's slots fit in front of block's: move them there, drop prev.
      MoveSlots(Precision::kLayout, prev_off, prev.start, off, block.start - prev.count,
                prev.count);
      block.start -= prev.count;
      block.count += prev.count;
      block.version = 0;  // it received slots: the commit stamps it
      batch_->dropped.push_back(prev.id);
      prev = block;
      continue;
    }
    if (prev.start + prev.count + block.count > B) {
      // Slide prev's slots to the front of their block first (ascending: safe in place).
      MoveSlots(Precision::kLayout, prev_off, prev.start, prev_off, 0, prev.count);
      prev.start = 0;
    }
    MoveSlots(Precision::kLayout, off, block.start, prev_off, prev.start + prev.count, block.count);
    prev.count += block.count;
    prev.version = 0;  // it received slots: the commit stamps it
    batch_->dropped.push_back(block.id);
  }
  blocks.resize(out);
  return absl::OkStatus();
}

absl::Status StreamPlanner::Quantize(std::vector<StreamBlock>& blocks, uint32_t recent) {
  if (!format_.quantizes()) return absl::OkStatus();
  uint64_t total = 0;
  for (const StreamBlock& b : blocks) total += b.count;
  if (total <= recent) return absl::OkStatus();
  const uint64_t old_end = total - recent;  // slots [0, old_end) are outside the window
  uint64_t end = 0;
  for (StreamBlock& block : blocks) {
    end += block.count;
    if (end > old_end) break;
    if (block.precision != Precision::kLayout) continue;
    const Precision target = format_.quant_precision();
    // A shared block's copy frees nothing (its other owners keep it): no reserve for it.
    absl::StatusOr<store::BlockId> id = Allocate(target, /*reclaims=*/!Shared(block.id));
    // Out of pool memory even with the reserve: quantize what fitted; the rest stays at
    // the layout precision and is quantized by a later call, once blocks came back.
    if (!id.ok() && absl::IsResourceExhausted(id.status())) return absl::OkStatus();
    if (!id.ok()) return id.status();
    batch_->quantizes.push_back(
        {pool_->offset(block.id), pool_->offset(*id), block.start, block.count});
    batch_->dropped.push_back(block.id);
    batch_->quantized_slots += block.count;
    block.id = *id;
    block.version = 0;  // a new block: the commit stamps it
    block.precision = target;
  }
  return absl::OkStatus();
}

}  // namespace kvmem::engine
