#pragma once
// StreamPlanner: turns a change to one stream's slots (append, keep-set, merge, quantize)
// into backend operations and a new block list, without touching the stream itself.
//
// Plans accumulate in an OpBatch across all streams of a request; the engine runs the
// batch (moves, then writes, then quantizations, each in order) and only then commits the
// new block lists. Blocks the plan allocated are released if the batch is abandoned;
// blocks it stopped using are released after commit. Shared blocks (refs > 1, after Fork)
// are never written: a private copy is made first (copy-on-write).
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/common/keep_set.h"
#include "server/engine/block_format.h"
#include "server/engine/failpoints.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// One block of a stream: live slots [start, start + count).
struct StreamBlock {
  store::BlockId id = 0;
  uint32_t start = 0;
  uint32_t count = 0;
  Precision precision = Precision::kLayout;
  // The table version at which this entry or its slots last changed; an entry the plan
  // gave a new block id or wrote slots into carries 0 until its commit stamps it
  // (Stream::SwapBlocks). A plan that moves slots sets it to 0: two steps of one plan
  // (a keep-set, then a merge) may leave the entry as it was with other slots behind it.
  uint64_t version = 0;
  // The entry's index in the list at each of the stream's two last published versions
  // (Stream::MarkPublished), valid while `version` is not newer than that version: a
  // delta tells the client where to find the entries it already holds.
  uint32_t published_index[2] = {0, 0};
};

struct OpBatch {
  std::vector<store::MoveOp> moves;
  std::vector<store::WriteOp> writes;
  std::vector<store::QuantizeOp> quantizes;
  std::vector<store::BlockId> allocated;  // released if the batch is abandoned
  std::vector<store::BlockId> dropped;    // released once the batch is committed
  uint64_t quantized_slots = 0;
};

// Source of one appended run: `count` consecutive tokens' K and V rows.
struct AppendRun {
  const char* k;  // count rows of row_bytes
  const char* v;
  uint32_t count;
};

// Entries [begin, end) of a block list, and the stream index of entry begin's first slot.
struct EntryRange {
  size_t begin = 0;
  size_t end = 0;
  uint64_t first_slot = 0;
};
// The entries of a block list of `slots` slots that hold what `keep` drops (at least one
// slot), with one neighbour on each side, which a merge may join: what a step's eviction
// plans (Keep, then Merge) and swaps (Stream::SwapBlocks) instead of the whole list.
EntryRange EvictedEntries(absl::Span<const StreamBlock> blocks, uint64_t slots,
                          const KeepSet& keep);

class StreamPlanner {
 public:
  StreamPlanner(const BlockFormat& format, store::BlockPool* pool, OpBatch* batch,
                Failpoints* failpoints = nullptr, store::TenantId tenant = 0)
      : format_(format), pool_(pool), batch_(batch), failpoints_(failpoints), tenant_(tenant) {}

  // Layout blocks Append would allocate for `tokens` more tokens (copy-on-write included).
  uint64_t BlocksForAppend(const std::vector<StreamBlock>& blocks, uint64_t tokens) const;
  // Blocks allocated beforehand (all or nothing) that Allocate hands out first.
  void Reserve(std::vector<store::BlockId> ids) { reserve_ = std::move(ids); }
  // Reserved blocks not handed out (they stay in the batch's `allocated`).
  const std::vector<store::BlockId>& unused_reserve() const { return reserve_; }

  // Appends the runs in order after the stream's last slot.
  absl::Status Append(std::vector<StreamBlock>& blocks, absl::Span<const AppendRun> runs);
  // Keeps only the slots of `keep` (valid over the stream: validated by the caller) in
  // `blocks`, entries of the stream's list whose first slot is the stream's `first_slot`
  // (the whole list, or the part of it that holds every slot the keep-set drops).
  absl::Status Keep(std::vector<StreamBlock>& blocks, const KeepSet& keep, uint64_t first_slot = 0);
  // Merges neighbouring layout-precision blocks whose live slots fit one block.
  absl::Status Merge(std::vector<StreamBlock>& blocks);
  // Quantizes every layout block whose slots all lie before the last `recent` slots, as
  // many as the pool has room for (the pool's reserve included); the rest wait.
  absl::Status Quantize(std::vector<StreamBlock>& blocks, uint32_t recent);

 private:
  // `reclaims`: the block replaces a bigger one that the batch frees (quantization of a
  // private block), so it may take the pool's reserve.
  absl::StatusOr<store::BlockId> Allocate(Precision p, bool reclaims = false);
  bool Shared(store::BlockId id) const { return pool_->refs(id) > 1; }
  // Moves slots [src, src + count) of block `from` to [dst, dst + count) of block `to` (same
  // precision), as one memmove per plane (the ranges may overlap).
  void MoveSlots(Precision p, uint64_t from, uint32_t src, uint64_t to, uint32_t dst,
                 uint32_t count);
  // Replaces a shared block by a private copy of its live slots (same positions).
  absl::Status Unshare(StreamBlock& block);

  const BlockFormat& format_;
  store::BlockPool* const pool_;
  OpBatch* const batch_;
  Failpoints* const failpoints_;
  const store::TenantId tenant_;  // charged for what it allocates
  std::vector<store::BlockId> reserve_;
};

}  // namespace kvmem::engine
