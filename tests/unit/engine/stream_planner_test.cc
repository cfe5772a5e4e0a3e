// StreamPlanner::Keep against the slots it must keep: random block lists (partly filled,
// some shared after a fork) and keep-sets of every shape, with the batch's moves run on a
// copy of the pool's bytes.
#include "server/engine/stream_planner.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_layout.h"

namespace kvmem::engine {
namespace {

TEST(StreamPlannerTest, KeepLeavesExactlyTheKeptSlotsInOrder) {
  constexpr uint32_t kB = 8;
  const Layout layout{1, 1, 4, DType::kF32, kB, 100};
  const BlockFormat format(layout, std::nullopt);
  const uint64_t row = layout.row_bytes();
  const kernels::LayoutBlock plane{kB, row};
  constexpr uint64_t kPoolBytes = 1 << 20;
  std::mt19937 rng(17);
  for (int round = 0; round < 3000; ++round) {
    std::unique_ptr<store::BlockPool> pool = *store::BlockPool::Create(kPoolBytes, 4096);
    std::vector<char> bytes(kPoolBytes);
    const auto tag_at = [&](uint64_t off) {
      uint32_t t;
      std::memcpy(&t, bytes.data() + off, sizeof t);
      return t;
    };
    // A list of 1-6 blocks, each holding a run of slots tagged with their stream index + 1.
    std::vector<StreamBlock> blocks;
    uint32_t slots = 0;
    size_t shared = 0;
    const size_t num_blocks = 1 + rng() % 6;
    for (size_t b = 0; b < num_blocks; ++b) {
      std::vector<store::BlockId> ids;
      ASSERT_TRUE(
          pool->AllocateMany(static_cast<uint32_t>(format.block_bytes(Precision::kLayout)), 1, &ids)
              .ok());
      if (rng() % 4 == 0) {
        pool->Ref(ids);  // another sequence holds it too
        ++shared;
      }
      const uint32_t start = rng() % kB;
      const uint32_t count = 1 + rng() % (kB - start);
      const uint64_t off = pool->offset(ids[0]);
      for (uint32_t i = 0; i < count; ++i, ++slots) {
        const uint32_t tag = slots + 1;
        std::memcpy(bytes.data() + off + plane.k_offset(start + i), &tag, sizeof tag);
        std::memcpy(bytes.data() + off + plane.v_offset(start + i), &tag, sizeof tag);
      }
      blocks.push_back({ids[0], start, count, Precision::kLayout, /*version=*/1});
    }
    // Keep-sets: random holes, one slot out, a window's head, a lone run, nothing.
    KeepSet keep;
    const int kind = static_cast<int>(rng() % 5);
    const uint32_t hole = rng() % slots;
    for (uint32_t j = 0; j < slots; ++j) {
      const bool kept = kind == 0   ? rng() % 3 != 0
                        : kind == 1 ? j != hole
                        : kind == 2 ? j >= hole
                        : kind == 3 ? (j >= hole && j < hole + 3)
                                    : false;
      if (kept) keep.Add(j);
    }
    ASSERT_TRUE(keep.ValidFor(slots));

    const std::vector<char> before = bytes;
    OpBatch batch;
    StreamPlanner planner(format, pool.get(), &batch);
    std::vector<StreamBlock> planned = blocks;
    ASSERT_TRUE(planner.Keep(planned, keep).ok());
    for (const store::MoveOp& op : batch.moves) {
      std::memmove(bytes.data() + op.dst, bytes.data() + op.src, op.bytes);
    }
    std::vector<uint32_t> got;
    for (const StreamBlock& b : planned) {
      ASSERT_GT(b.count, 0u);
      ASSERT_LE(b.start + b.count, kB);
      const uint64_t off = pool->offset(b.id);
      for (uint32_t i = 0; i < b.count; ++i) {
        const uint32_t k = tag_at(off + plane.k_offset(b.start + i));
        ASSERT_EQ(tag_at(off + plane.v_offset(b.start + i)), k) << "round " << round;
        got.push_back(k - 1);
        // A shared block is never written: what the plan moved into is private.
        if (b.version == 0) {
          ASSERT_EQ(pool->refs(b.id), 1u) << "round " << round;
        }
      }
    }
    ASSERT_EQ(got, keep.Slots()) << "round " << round << " kind " << kind;
    // Every old block the list no longer names is dropped, once.
    size_t named_old = 0;
    for (const StreamBlock& b : planned) {
      for (const StreamBlock& old : blocks) named_old += b.id == old.id;
    }
    ASSERT_EQ(batch.dropped.size(), blocks.size() - named_old) << "round " << round;
    ASSERT_LE(batch.allocated.size(), shared);

    // A step's plan: only the entries EvictedEntries names, kept and merged, spliced into
    // the rest of the list, leaves the same slots in the same order.
    if (keep.size() == slots) continue;
    const EntryRange range = EvictedEntries(blocks, slots, keep);
    ASSERT_LT(range.begin, range.end);
    ASSERT_LE(range.end, blocks.size());
    std::vector<char> ranged_bytes = before;
    OpBatch ranged_batch;
    StreamPlanner ranged_planner(format, pool.get(), &ranged_batch);
    std::vector<StreamBlock> middle(blocks.begin() + static_cast<ptrdiff_t>(range.begin),
                                    blocks.begin() + static_cast<ptrdiff_t>(range.end));
    ASSERT_TRUE(ranged_planner.Keep(middle, keep, range.first_slot).ok());
    ASSERT_TRUE(ranged_planner.Merge(middle).ok());
    for (const store::MoveOp& op : ranged_batch.moves) {
      std::memmove(ranged_bytes.data() + op.dst, ranged_bytes.data() + op.src, op.bytes);
    }
    std::vector<StreamBlock> spliced(blocks.begin(),
                                     blocks.begin() + static_cast<ptrdiff_t>(range.begin));
    spliced.insert(spliced.end(), middle.begin(), middle.end());
    spliced.insert(spliced.end(), blocks.begin() + static_cast<ptrdiff_t>(range.end), blocks.end());
    std::vector<uint32_t> ranged_got;
    for (const StreamBlock& b : spliced) {
      const uint64_t off = pool->offset(b.id);
      for (uint32_t i = 0; i < b.count; ++i) {
        uint32_t t;
        std::memcpy(&t, ranged_bytes.data() + off + plane.k_offset(b.start + i), sizeof t);
        ranged_got.push_back(t - 1);
      }
    }
    ASSERT_EQ(ranged_got, keep.Slots()) << "round " << round << " kind " << kind;
  }
}

}  // namespace
}  // namespace kvmem::engine
