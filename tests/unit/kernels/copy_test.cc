// The move contract: in-order memmove semantics (the reference), and the CUDA twin's way of
// running a batch (waves, each gathering every source before scattering) emulated here on
// the CPU: for random batches full of overlaps the two must give the same bytes.
#include "kernels/copy.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem::kernels {
namespace {

// What the CUDA backend does with a move batch (PlanMoveWaves): per wave, pool -> scratch
// for every op, then scratch -> pool.
void MoveByWaves(uint8_t* base, const std::vector<CopyOp>& ops) {
  for (const MoveWave& wave : PlanMoveWaves(ops.data(), ops.size())) {
    std::vector<uint8_t> scratch(wave.scratch_bytes);
    CopyBatchRef(base, scratch.data(), wave.gather.data(), wave.gather.size());
    CopyBatchRef(scratch.data(), base, wave.scatter.data(), wave.scatter.size());
  }
}

TEST(CopyTest, WavesMatchInOrderMemmoveOnRandomBatches) {
  std::mt19937 rng(7);
  size_t total_waves = 0, batches = 0;
  for (int trial = 0; trial < 500; ++trial) {
    const uint64_t size = 256;
    std::vector<uint8_t> a(size), b;
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    b = a;
    std::vector<CopyOp> ops(1 + rng() % 12);
    for (CopyOp& op : ops) {
      op.bytes = rng() % 40;
      op.src = rng() % (size - op.bytes + 1);
      op.dst = rng() % (size - op.bytes + 1);
    }
    MoveBatchRef(a.data(), ops.data(), ops.size());
    MoveByWaves(b.data(), ops);
    ASSERT_EQ(a, b) << "trial " << trial;
    total_waves += MoveWaves(ops.data(), ops.size()).size();
    ++batches;
  }
  EXPECT_GT(total_waves, batches);  // the random batches did have hazards to split at
}

// Batches over disjoint regions (the sequences of a batched step), run with their waves
// side by side: the bytes of each batch's in-order memmove, in as many waves as the
// longest batch needs.
TEST(CopyTest, DisjointBatchesRunSideBySideInTheLongestOnesWaves) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t region = 256;
    const size_t num = 1 + rng() % 6;
    std::vector<uint8_t> a(region * num), b;
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    b = a;
    std::vector<std::vector<CopyOp>> batches(num);
    size_t longest = 0;
    for (size_t i = 0; i < num; ++i) {
      batches[i].resize(1 + rng() % 10);
      for (CopyOp& op : batches[i]) {
        op.bytes = rng() % 40;
        op.src = region * i + rng() % (region - op.bytes + 1);
        op.dst = region * i + rng() % (region - op.bytes + 1);
      }
      MoveBatchRef(a.data(), batches[i].data(), batches[i].size());
      longest = std::max(longest, MoveWaves(batches[i].data(), batches[i].size()).size());
    }
    const std::vector<MoveWave> waves = PlanMoveWaves(batches);
    EXPECT_EQ(waves.size(), longest) << "trial " << trial;
    for (const MoveWave& wave : waves) {
      std::vector<uint8_t> scratch(wave.scratch_bytes);
      CopyBatchRef(b.data(), scratch.data(), wave.gather.data(), wave.gather.size());
      CopyBatchRef(scratch.data(), b.data(), wave.scatter.data(), wave.scatter.size());
    }
    ASSERT_EQ(a, b) << "trial " << trial;
  }
}

TEST(CopyTest, WavesSplitOnlyAtHazards) {
  // Compaction toward the front: each source after every earlier destination: one wave.
  std::vector<CopyOp> compaction = {{32, 16, 16}, {64, 32, 16}, {96, 48, 16}};
  EXPECT_EQ(MoveWaves(compaction.data(), 3), std::vector<size_t>({0}));
  // A block copied, then slots moved inside the copy (read after write): two waves.
  std::vector<CopyOp> unshare = {{0, 1000, 256}, {1064, 1032, 32}};
  EXPECT_EQ(MoveWaves(unshare.data(), 2), std::vector<size_t>({0, 1}));
  // Two writes to the same bytes: the later must win, so it starts a wave.
  std::vector<CopyOp> waw = {{0, 100, 8}, {50, 104, 8}};
  EXPECT_EQ(MoveWaves(waw.data(), 2), std::vector<size_t>({0, 1}));
  // Write after read (an op overwrites an earlier op's source): fine in one wave.
  std::vector<CopyOp> war = {{0, 100, 8}, {50, 0, 8}};
  EXPECT_EQ(MoveWaves(war.data(), 2), std::vector<size_t>({0}));
  EXPECT_TRUE(MoveWaves(nullptr, 0).empty());
}

}  // namespace
}  // namespace kvmem::kernels
