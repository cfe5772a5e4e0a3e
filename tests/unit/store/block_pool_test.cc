#include "server/store/block_pool.h"

#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmem::store {
namespace {

using ::testing::HasSubstr;

TEST(BlockPoolTest, RejectsBadGeometry) {
  EXPECT_EQ(BlockPool::Create(1 << 20, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(1000, 4096).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockPoolTest, BlocksOfOneClassShareAPageAndNeverOverlap) {
  auto pool = *BlockPool::Create(4 * 4096, 4096);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->AllocateMany(1024, 16, &ids).ok());
  std::set<uint64_t> offsets;
  for (BlockId id : ids) {
    EXPECT_EQ(pool->offset(id) % 1024, 0u);
    EXPECT_LT(pool->offset(id), 4u * 4096);
    offsets.insert(pool->offset(id));
  }
  EXPECT_EQ(offsets.size(), 16u);
  EXPECT_EQ(pool->usage().pages_used, 4u);
  EXPECT_EQ(pool->free_bytes(), 0u);
}

TEST(BlockPoolTest, FullPoolIsResourceExhaustedAndAllocatesNothing) {
  auto pool = *BlockPool::Create(2 * 4096, 4096);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->AllocateMany(4096, 1, &ids).ok());
  const PoolUsage before = pool->usage();
  absl::Status s = pool->AllocateMany(4096, 2, &ids);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("pool"));
  EXPECT_THAT(s.message(), HasSubstr("2 blocks of 4096 bytes"));
  EXPECT_EQ(ids.size(), 1u);
  EXPECT_EQ(pool->usage().blocks_used, before.blocks_used);
  EXPECT_EQ(pool->usage().pages_used, before.pages_used);
}

TEST(BlockPoolTest, RefCountsFreeOnLastUnrefAndPagesReturn) {
  auto pool = *BlockPool::Create(4096, 4096);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->AllocateMany(2048, 2, &ids).ok());
  pool->Ref({ids[0]});
  EXPECT_EQ(pool->refs(ids[0]), 2u);
  EXPECT_EQ(pool->Unref({ids[0]}), 0u);
  EXPECT_EQ(pool->Unref({ids[0], ids[1]}), 2u);
  EXPECT_EQ(pool->usage().pages_used, 0u);
  EXPECT_EQ(pool->free_bytes(), 4096u);
  // The freed page serves another size class.
  std::vector<BlockId> again;
  EXPECT_TRUE(pool->AllocateMany(4096, 1, &again).ok());
}

TEST(BlockPoolTest, RandomChurnKeepsAccountingExact) {
  auto pool = *BlockPool::Create(64 * 8192, 8192);
  std::mt19937 rng(7);
  std::vector<std::pair<BlockId, uint32_t>> live;
  const uint32_t classes[] = {512, 1000, 2048, 8192};
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const uint32_t bytes = classes[rng() % 4];
      std::vector<BlockId> ids;
      if (pool->AllocateMany(bytes, 1 + rng() % 4, &ids).ok()) {
        for (BlockId id : ids) live.push_back({id, bytes});
      }
    } else {
      const size_t k = rng() % live.size();
      pool->Unref({live[k].first});
      live.erase(live.begin() + k);
    }
    // No two live blocks overlap.
    if (i % 500 == 0) {
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (auto [id, bytes] : live) ranges.push_back({pool->offset(id), pool->offset(id) + bytes});
      std::sort(ranges.begin(), ranges.end());
      for (size_t j = 1; j < ranges.size(); ++j) ASSERT_LE(ranges[j - 1].second, ranges[j].first);
    }
  }
  EXPECT_EQ(pool->usage().blocks_used, live.size());
  for (auto [id, bytes] : live) pool->Unref({id});
  EXPECT_EQ(pool->usage().pages_used, 0u);
  EXPECT_EQ(pool->usage().block_bytes_used, 0u);
}

}  // namespace
}  // namespace kvmem::store
