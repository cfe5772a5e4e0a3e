// compact.h reference: after selection, each stream's kept rows (K and V) sit at the front
// of its blocks in order, untouched bytes elsewhere, and the tail blocks are free.
#include "kernels/compact.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem::kernels {
namespace {

TEST(CompactTest, KeptRowsMoveToTheFrontOfTheirBlocks) {
  std::mt19937 rng(5);
  const RowGeometry g{4, 8};  // 4 slots a block, 8-byte rows
  const uint64_t block_bytes = 2ull * g.block_tokens * g.row_bytes;
  for (int trial = 0; trial < 100; ++trial) {
    const uint32_t num = 1 + rng() % 4;
    std::vector<StreamSlice> streams;
    std::vector<uint32_t> block_first;
    std::vector<uint64_t> block_offsets;
    std::vector<uint8_t> keep;
    uint32_t total_blocks = 0;
    for (uint32_t s = 0; s < num; ++s) {
      const uint32_t n = rng() % 19;
      streams.push_back({static_cast<uint32_t>(keep.size()), n, 0, 0});
      block_first.push_back(static_cast<uint32_t>(block_offsets.size()));
      for (uint32_t b = 0; b < (n + g.block_tokens - 1) / g.block_tokens; ++b) {
        block_offsets.push_back(0);
        ++total_blocks;
      }
      for (uint32_t j = 0; j < n; ++j) keep.push_back(rng() % 3 != 0);
    }
    // Blocks scattered over the pool in a random order.
    std::vector<uint64_t> slots(total_blocks);
    for (uint32_t i = 0; i < total_blocks; ++i) slots[i] = i * block_bytes;
    std::shuffle(slots.begin(), slots.end(), rng);
    block_offsets = slots;
    std::vector<uint8_t> pool(total_blocks * block_bytes);
    for (auto& b : pool) b = static_cast<uint8_t>(rng());
    const std::vector<uint8_t> before = pool;
    std::vector<float> scores(keep.size(), 0);
    std::vector<int64_t> positions(keep.size(), 0);
    std::vector<uint32_t> index(keep.size()), kept(num), used(num);
    CompactSlotsRef(streams.data(), num, keep.data(), scores.data(), positions.data(), index.data(),
                    kept.data());
    CompactRowsRef(streams.data(), num, index.data(), kept.data(), block_offsets.data(),
                   block_first.data(), g, pool.data(), used.data());
    for (uint32_t s = 0; s < num; ++s) {
      auto row = [&](const std::vector<uint8_t>& p, uint32_t slot, uint32_t plane) {
        const uint64_t at = block_offsets[block_first[s] + slot / g.block_tokens] +
                            plane * uint64_t{g.block_tokens} * g.row_bytes +
                            uint64_t{slot % g.block_tokens} * g.row_bytes;
        return std::vector<uint8_t>(p.begin() + at, p.begin() + at + g.row_bytes);
      };
      ASSERT_EQ(used[s], (kept[s] + g.block_tokens - 1) / g.block_tokens);
      for (uint32_t r = 0; r < kept[s]; ++r) {
        for (uint32_t plane = 0; plane < 2; ++plane) {
          ASSERT_EQ(row(pool, r, plane), row(before, index[streams[s].offset + r], plane))
              << "trial " << trial << " stream " << s << " row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvmem::kernels
