#include "server/store/block_pool.h"

#include <atomic>
#include <random>
#include <set>
#include <thread>

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

// offset and refs read without the pool's mutex: while another thread allocates past two
// chunks of ids and frees them again, and adds and drops references to the held blocks, a
// block held throughout reads the same offset and its own references, and any other id
// reads without a crash. Under ThreadSanitizer (scripts/tsan.sh) a reader that could see
// the id table move, or a chunk before it was published, fails here.
// A pool full of its smallest blocks has handed out every id it has room for: the next
// allocation is refused like any other on a full pool (no id past the table), again and
// again, and frees bring it back.
TEST(BlockPoolTest, EveryIdInUseIsAFullPool) {
  auto pool = *BlockPool::Create(1 << 20, 64 << 10);  // 16384 blocks of 64 bytes: one chunk
  std::vector<BlockId> all;
  ASSERT_TRUE(pool->AllocateMany(64, 16384, &all).ok());
  for (int i = 0; i < 3; ++i) {
    std::vector<BlockId> more;
    EXPECT_EQ(pool->AllocateMany(64, 1, &more).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(more.empty());
  }
  EXPECT_EQ(pool->usage().blocks_used, 16384u);
  pool->Unref({all.back()});
  std::vector<BlockId> again;
  ASSERT_TRUE(pool->AllocateMany(64, 1, &again).ok());
  EXPECT_EQ(again[0], all.back());  // the freed id, reused
  EXPECT_EQ(pool->offset(again[0]) % 64, 0u);
  EXPECT_EQ(pool->refs(again[0]), 1u);
}

TEST(BlockPoolTest, HeldBlocksReadWithoutTheLockWhileIdsComeAndGo) {
  constexpr uint32_t kBytes = 64;
  constexpr uint32_t kChurn = 38000;  // ids up to ~38100: chunks 0, 1 and 2 (16384 each)
  auto pool = *BlockPool::Create(uint64_t{kBytes} * 40000 + (64 << 10), 64 << 10);
  std::vector<BlockId> held;
  ASSERT_TRUE(pool->AllocateMany(kBytes, 100, &held).ok());
  std::vector<uint64_t> offsets;
  for (BlockId id : held) offsets.push_back(pool->offset(id));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, wrong{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&, r] {
      std::mt19937 rng(r);
      while (!stop.load()) {
        for (size_t i = 0; i < held.size(); ++i) {
          const uint32_t refs = pool->refs(held[i]);
          if (pool->offset(held[i]) != offsets[i] || (refs != 1 && refs != 2)) ++wrong;
        }
        for (int i = 0; i < 200; ++i) {  // any id, made or not, in use or not
          const BlockId id = rng() % (kChurn + 20000);
          const uint64_t offset = pool->offset(id);
          if (offset % kBytes != 0 || offset >= pool->pool_bytes()) ++wrong;
          if (pool->refs(id) > 2) ++wrong;
        }
        reads.fetch_add(1);
      }
    });
  }
  while (reads.load() < 2) std::this_thread::yield();  // the readers run before the churn
  for (int round = 0; round < 3; ++round) {
    std::vector<BlockId> churn;
    // Not ASSERT: the readers must be joined whatever happens.
    EXPECT_TRUE(pool->AllocateMany(kBytes, kChurn, &churn).ok());
    pool->Ref(held);
    pool->Unref(held);
    pool->Unref(churn);
  }
  stop = true;
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0u);
  const BlockId gone = held.back();
  pool->Unref({gone});
  EXPECT_EQ(pool->refs(gone), 0u);
  EXPECT_EQ(pool->offset(gone), 0u);
  EXPECT_EQ(pool->refs(0xfffffff0u), 0u);  // never made: no state, no crash
  EXPECT_EQ(pool->offset(0xfffffff0u), 0u);
}

}  // namespace
}  // namespace kvmem::store

namespace kvmem::store {
namespace {

TEST(BlockPoolTenantTest, ChargesExactlyWhatIsHeldAlsoWhenABatchFailsPartway) {
  auto pool = *BlockPool::Create(8 * 4096, 4096);
  const TenantId t = *pool->RegisterTenant("t", 1 << 20);
  std::vector<BlockId> other;
  ASSERT_TRUE(pool->AllocateMany(4096, 6, &other).ok());  // 2 pages left
  std::vector<BlockId> mine;
  // Three pages asked, two free: the batch allocates two, fails, gives them back.
  EXPECT_TRUE(
      absl::IsResourceExhausted(pool->AllocateMany(4096, 3, &mine, BlockPool::Use::kGrow, t)));
  EXPECT_TRUE(mine.empty());
  EXPECT_EQ(pool->tenant_bytes(t), 0u);
  ASSERT_TRUE(pool->AllocateMany(4096, 2, &mine, BlockPool::Use::kGrow, t).ok());
  EXPECT_EQ(pool->tenant_bytes(t), 2u * 4096);
  pool->Unref(mine);
  EXPECT_EQ(pool->tenant_bytes(t), 0u);
  pool->Unref(other);
}

TEST(BlockPoolTenantTest, AQuotaRefusalAsksTheReclaimerForTheTenantFirst) {
  auto pool = *BlockPool::Create(16 * 4096, 4096);
  const TenantId t = *pool->RegisterTenant("t", 2 * 4096);
  std::vector<BlockId> cached;
  ASSERT_TRUE(pool->AllocateMany(4096, 2, &cached, BlockPool::Use::kGrow, t).ok());
  std::vector<std::pair<uint64_t, TenantId>> asked;
  pool->set_reclaimer([&](uint64_t bytes, TenantId tenant) -> uint64_t {
    asked.emplace_back(bytes, tenant);
    if (cached.empty()) return 0;
    pool->Unref(cached);  // what a prefix cache would give back
    cached.clear();
    return 2 * 4096;
  });
  std::vector<BlockId> more;
  ASSERT_TRUE(pool->AllocateMany(4096, 1, &more, BlockPool::Use::kGrow, t).ok());
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], std::make_pair(uint64_t{4096}, t));
  // Nothing left to give: the refusal names the tenant and its quota.
  std::vector<BlockId> again;
  ASSERT_TRUE(pool->AllocateMany(4096, 1, &again, BlockPool::Use::kGrow, t).ok());
  absl::Status s = pool->AllocateMany(4096, 1, &again, BlockPool::Use::kGrow, t);
  EXPECT_TRUE(absl::IsResourceExhausted(s));
  EXPECT_NE(s.message().find("tenant 't'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("quota of 8192 bytes"), std::string::npos) << s;
  pool->Unref(more);
  pool->Unref(again);
}

// Arenas: the pool's last pages cut out for one tenant's blocks each.
TEST(BlockPoolArenaTest, ATenantsBlocksStayInItsArenaAndNoOneElsesGoThere) {
  // 16 pages: 10 shared, then arena 1 (4 pages), then arena 2 (2 pages).
  auto pool =
      *BlockPool::Create(16 * 4096, 4096, 0, {{"the arena of a", 4, 0}, {"the arena of b", 2, 0}});
  ASSERT_EQ(pool->arenas(), 2u);
  EXPECT_EQ(pool->arena_offset(1), 10u * 4096);
  EXPECT_EQ(pool->arena_bytes(1), 4u * 4096);
  EXPECT_EQ(pool->arena_offset(2), 14u * 4096);
  const TenantId a = *pool->RegisterTenant("a", 0, "tenants", 1);
  const TenantId b = *pool->RegisterTenant("b", 0, "tenants", 2);
  const TenantId c = *pool->RegisterTenant("c", 0);  // the shared part
  auto in = [&](BlockId id, uint64_t lo, uint64_t hi) {
    return pool->offset(id) >= lo && pool->offset(id) + 1024 <= hi;
  };
  std::vector<BlockId> as, bs, cs;
  ASSERT_TRUE(pool->AllocateMany(1024, 16, &as, BlockPool::Use::kGrow, a).ok());
  ASSERT_TRUE(pool->AllocateMany(1024, 8, &bs, BlockPool::Use::kGrow, b).ok());
  ASSERT_TRUE(pool->AllocateMany(1024, 40, &cs, BlockPool::Use::kGrow, c).ok());
  for (BlockId id : as) EXPECT_TRUE(in(id, 10 * 4096, 14 * 4096)) << pool->offset(id);
  for (BlockId id : bs) EXPECT_TRUE(in(id, 14 * 4096, 16 * 4096)) << pool->offset(id);
  for (BlockId id : cs) EXPECT_TRUE(in(id, 0, 10 * 4096)) << pool->offset(id);
  // Every part is full now: none takes from another, and each refusal names its part.
  std::vector<BlockId> more;
  absl::Status full_a = pool->AllocateMany(1024, 1, &more, BlockPool::Use::kGrow, a);
  EXPECT_TRUE(absl::IsResourceExhausted(full_a)) << full_a;
  EXPECT_THAT(full_a.message(), HasSubstr("the arena of a of 16384 bytes (--tenant-arena)"));
  absl::Status full_c = pool->AllocateMany(1024, 1, &more, BlockPool::Use::kGrow, c);
  EXPECT_TRUE(absl::IsResourceExhausted(full_c)) << full_c;
  EXPECT_THAT(full_c.message(), HasSubstr("the shared part of the pool (40960 bytes)"));
  EXPECT_TRUE(more.empty());
  // Freed pages go back to their own part: b's free arena gives c nothing.
  pool->Unref(bs);
  bs.clear();
  EXPECT_EQ(pool->region_free_bytes(2), 2u * 4096);
  EXPECT_TRUE(
      absl::IsResourceExhausted(pool->AllocateMany(1024, 1, &more, BlockPool::Use::kGrow, c)));
  ASSERT_TRUE(pool->AllocateMany(1024, 8, &bs, BlockPool::Use::kGrow, b).ok());
  EXPECT_EQ(pool->free_bytes(), 0u);
  pool->Unref(as);
  pool->Unref(bs);
  pool->Unref(cs);
  EXPECT_EQ(pool->free_bytes(), 16u * 4096);
  EXPECT_EQ(pool->usage().blocks_used, 0u);
  EXPECT_EQ(pool->usage().bad_unrefs, 0u);
}

TEST(BlockPoolArenaTest, AFullArenaAsksTheReclaimerForItsTenant) {
  auto pool = *BlockPool::Create(8 * 4096, 4096, 0, {{"the arena of a", 2, 0}});
  const TenantId a = *pool->RegisterTenant("a", 0, "tenants", 1);
  std::vector<BlockId> cached;
  ASSERT_TRUE(pool->AllocateMany(4096, 2, &cached, BlockPool::Use::kGrow, a).ok());
  std::vector<TenantId> asked;
  pool->set_reclaimer([&](uint64_t, TenantId tenant) -> uint64_t {
    asked.push_back(tenant);
    if (cached.empty()) return 0;
    pool->Unref(cached);
    cached.clear();
    return 2 * 4096;
  });
  // An ask the arena could never hold is refused with its cache left alone.
  std::vector<BlockId> more;
  EXPECT_TRUE(
      absl::IsResourceExhausted(pool->AllocateMany(4096, 3, &more, BlockPool::Use::kGrow, a)));
  EXPECT_TRUE(asked.empty());
  EXPECT_EQ(cached.size(), 2u);
  ASSERT_TRUE(pool->AllocateMany(4096, 1, &more, BlockPool::Use::kGrow, a).ok());
  EXPECT_EQ(asked, std::vector<TenantId>{a});
  EXPECT_GE(pool->offset(more[0]), 6u * 4096);
  pool->Unref(more);
}

TEST(BlockPoolArenaTest, ArenasThatLeaveNoSharedPartOrHaveNoPageAreRefused) {
  EXPECT_EQ(BlockPool::Create(4 * 4096, 4096, 0, {{"x", 4, 0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(4 * 4096, 4096, 0, {{"x", 0, 0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(4 * 4096, 4096, 0, {{"x", 2, 2}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(4 * 4096, 4096, 3, {{"x", 2, 0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto pool = *BlockPool::Create(4 * 4096, 4096, 0, {{"x", 2, 0}});
  EXPECT_EQ(pool->RegisterTenant("y", 0, "tenants", 2).status().code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvmem::store
