// PrefixIndex (server/prefix/prefix_index.h): matching chains from their first block, the
// references it holds and hands out, and reclaiming only what nothing else holds, leaves
// first, least recently used first.
#include "server/prefix/prefix_index.h"

#include "gtest/gtest.h"

namespace kvmem::prefix {
namespace {

class PrefixIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = *store::BlockPool::Create(64 * 4096, 4096);
    index_ = std::make_unique<PrefixIndex>(pool_.get());
  }
  static BlockHash H(uint8_t n) {
    BlockHash h{};
    h[0] = n;
    return h;
  }
  // Two blocks (one per stream) of a page each, held by the caller: dropping an entry
  // frees two pages.
  std::vector<store::BlockId> Blocks() {
    std::vector<store::BlockId> ids;
    EXPECT_TRUE(pool_->AllocateMany(4096, 2, &ids).ok());
    return ids;
  }
  // Publishes chain h(1) -> h(2) -> ... -> h(n) and drops the caller's references.
  void PublishChain(uint8_t n, const std::string& ns = "ns") {
    for (uint8_t i = 1; i <= n; ++i) {
      std::vector<store::BlockId> ids = Blocks();
      const BlockHash parent = H(i - 1);
      EXPECT_TRUE(index_->Publish(ns, i == 1 ? nullptr : &parent, H(i), ids));
      pool_->Unref(ids);
    }
  }

  std::unique_ptr<store::BlockPool> pool_;
  std::unique_ptr<PrefixIndex> index_;
};

TEST_F(PrefixIndexTest, MatchesFromTheFirstBlockOnly) {
  PublishChain(3);
  EXPECT_EQ(index_->Match("ns", {H(1), H(2), H(3), H(4)}), 3u);
  EXPECT_EQ(index_->Match("ns", {H(1), H(9), H(3)}), 1u);
  EXPECT_EQ(index_->Match("ns", {H(2), H(3)}), 2u);  // hashes name whole prefixes
  EXPECT_EQ(index_->Match("other", {H(1)}), 0u);
  EXPECT_EQ(index_->Match("ns", {}), 0u);
  const PrefixStats s = index_->stats();
  EXPECT_EQ(s.queries, 5u);
  EXPECT_EQ(s.hits, 3u);
}

TEST_F(PrefixIndexTest, APublishedHashIsKeptAndTheIndexHoldsOneReference) {
  std::vector<store::BlockId> first = Blocks(), second = Blocks();
  EXPECT_TRUE(index_->Publish("ns", nullptr, H(1), first));
  EXPECT_FALSE(index_->Publish("ns", nullptr, H(1), second));  // the first one stays
  EXPECT_EQ(pool_->refs(first[0]), 2u);
  EXPECT_EQ(pool_->refs(second[0]), 1u);
  auto mapped = index_->Map("ns", {H(1)}, 1, 16);
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(mapped[0], first);
  EXPECT_EQ(pool_->refs(first[0]), 3u);  // the caller's new reference
  EXPECT_EQ(index_->stats().reused_tokens, 16u);
  EXPECT_TRUE(index_->Map("ns", {H(1)}, 0, 16).empty());  // at_most
  pool_->Unref(mapped[0]);
  pool_->Unref(first);
  pool_->Unref(second);
  EXPECT_EQ(index_->stats().cached_blocks, 2u);
}

TEST_F(PrefixIndexTest, ReclaimTakesOnlyUnheldLeavesOldestFirst) {
  PublishChain(3);                               // ns: 1 -> 2 -> 3
  PublishChain(2, "other");                      // other: 1 -> 2, used more recently
  auto held = index_->Map("ns", {H(1)}, 1, 16);  // a sequence holds ns block 1
  ASSERT_EQ(held.size(), 1u);
  const uint64_t entry_bytes = 2 * uint64_t{pool_->block_bytes(held[0][0])};
  // One entry's worth: the least recently used leaf, ns 3 (ns 2 has a child).
  EXPECT_EQ(index_->Reclaim(1), entry_bytes);
  EXPECT_EQ(index_->Match("ns", {H(1), H(2), H(3)}), 2u);
  EXPECT_EQ(index_->Match("other", {H(1), H(2)}), 2u);
  // Everything it can: each leaf goes, then the parents that became leaves; ns 1 stays.
  EXPECT_EQ(index_->Reclaim(UINT64_MAX), 3 * entry_bytes);
  EXPECT_EQ(index_->Match("ns", {H(1), H(2)}), 1u);
  EXPECT_EQ(index_->Match("other", {H(1)}), 0u);
  EXPECT_EQ(index_->stats().entries, 1u);
  EXPECT_EQ(index_->stats().cached_blocks, 0u);  // ns 1 is held
  pool_->Unref(held[0]);
  EXPECT_EQ(index_->stats().cached_blocks, 2u);
  EXPECT_EQ(index_->Reclaim(UINT64_MAX), entry_bytes);
  EXPECT_EQ(index_->stats().entries, 0u);
  EXPECT_EQ(index_->stats().reclaimed_bytes, 5 * entry_bytes);
  EXPECT_EQ(pool_->usage().blocks_used, 0u);
  EXPECT_EQ(pool_->usage().bad_unrefs, 0u);
}

TEST_F(PrefixIndexTest, AFullPoolReclaimsTheCacheBeforeFailing) {
  pool_->set_reclaimer(
      [this](uint64_t bytes, store::TenantId tenant) { return index_->Reclaim(bytes, tenant); });
  PublishChain(16);  // half the pool's 64 pages, only cached
  std::vector<store::BlockId> all;
  ASSERT_TRUE(pool_->AllocateMany(4096, 64, &all).ok());  // the whole pool
  EXPECT_EQ(index_->stats().entries, 0u);
  std::vector<store::BlockId> more;
  EXPECT_TRUE(absl::IsResourceExhausted(pool_->AllocateMany(4096, 1, &more)));
  pool_->Unref(all);
}

}  // namespace
}  // namespace kvmem::prefix
