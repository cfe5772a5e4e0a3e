// Sequence (server/engine/sequence.h): the state a sequence keeps for itself — one stream
// per (layer, kv_head) from construction, poisoning that sticks, versions that only grow,
// published versions it can name, a fork's copy of the state, and nothing held once
// cleared — each checked against CheckInvariants where it applies.
#include "server/engine/sequence.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/common/mutex.h"

namespace kvmem::engine {
namespace {

std::unique_ptr<Sequence> Make(uint64_t id, uint64_t parent = 0) {
  const Layout layout{3, 2, 8, DType::kF16, 16, 0};
  auto policy = policy::CreatePolicy("h2o", {});
  EXPECT_TRUE(policy.ok()) << policy.status();
  return std::make_unique<Sequence>(id, layout, "h2o", policy::ParamOverrides{}, *std::move(policy),
                                    QuantConfig{}, absl::Seconds(30),
                                    /*epoch_slot=*/0, parent);
}

TEST(SequenceTest, HasOneStreamPerLayerAndHeadFromTheStart) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> seq = Make(1);
  kvmem::MutexLock lock(&seq->mu);
  EXPECT_EQ(seq->streams().size(), 6u);
  EXPECT_EQ(seq->num_streams(), 6u);
  EXPECT_TRUE(seq->CheckInvariants().ok());
}

TEST(SequenceTest, PoisonKeepsTheFirstReasonAndSetsTheFlag) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> seq = Make(1);
  kvmem::MutexLock lock(&seq->mu);
  EXPECT_FALSE(seq->poisoned());
  EXPECT_FALSE(seq->poisoned_relaxed());
  EXPECT_TRUE(seq->Poison("backend failed"));
  EXPECT_FALSE(seq->Poison("something else"));
  EXPECT_TRUE(seq->poisoned());
  EXPECT_TRUE(seq->poisoned_relaxed());
  EXPECT_EQ(seq->poison_reason(), "backend failed");
  // An empty reason still poisons, and a long one is capped.
  std::unique_ptr<Sequence> quiet = Make(2);
  kvmem::MutexLock quiet_lock(&quiet->mu);
  EXPECT_TRUE(quiet->Poison(""));
  EXPECT_TRUE(quiet->poisoned());
  std::unique_ptr<Sequence> loud = Make(3);
  kvmem::MutexLock loud_lock(&loud->mu);
  loud->Poison(std::string(100000, 'x'));
  EXPECT_LE(loud->poison_reason().size(), 512u);
}

TEST(SequenceTest, VersionsOnlyGrowAndOnlyPublishedOnesAreNamed) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> seq = Make(1);
  kvmem::MutexLock lock(&seq->mu);
  seq->set_version(10);
  seq->Publish();
  seq->set_version(5);  // an older counter value never takes the table back
  EXPECT_EQ(seq->version(), 10u);
  seq->set_version(12);
  EXPECT_EQ(seq->PublishedSlot(12), -1);  // not published yet
  seq->Publish();
  EXPECT_GE(seq->PublishedSlot(10), 0);
  EXPECT_GE(seq->PublishedSlot(12), 0);
  EXPECT_NE(seq->PublishedSlot(10), seq->PublishedSlot(12));
  EXPECT_EQ(seq->PublishedSlot(0), -1);  // 0: the client holds none
  seq->set_version(13);
  seq->Publish();  // 10 leaves: only the last two are kept
  EXPECT_EQ(seq->PublishedSlot(10), -1);
  EXPECT_GE(seq->PublishedSlot(12), 0);
  EXPECT_GE(seq->PublishedSlot(13), 0);
  EXPECT_TRUE(seq->CheckInvariants().ok());
}

TEST(SequenceTest, ForkCopiesTheStateButNotTheIdentity) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> parent = Make(1);
  std::unique_ptr<Sequence> child = Make(2, /*parent=*/1);
  kvmem::MutexLock parent_lock(&parent->mu);
  kvmem::MutexLock child_lock(&child->mu);
  const std::vector<int32_t> tokens = {7, 8, 9};
  parent->ReserveTokens(tokens.size());
  parent->RecordAppend(tokens, 41, 3);
  parent->CountStep();
  parent->set_policy_mark(2);
  parent->set_version(20);
  parent->Publish();
  parent->set_epoch(99);
  child->set_epoch(100);
  child->CopyStateFrom(*parent, nullptr);
  EXPECT_EQ(child->id(), 2u);
  EXPECT_EQ(child->parent_id(), 1u);
  EXPECT_EQ(child->epoch(), 100u);  // its own
  EXPECT_THAT(child->token_ids(), ::testing::ElementsAre(7, 8, 9));
  EXPECT_EQ(child->last_position(), 41);
  EXPECT_EQ(child->appended(), 3u);
  EXPECT_EQ(child->steps(), 1u);
  EXPECT_EQ(child->policy_mark(), 2);
  EXPECT_EQ(child->version(), 20u);
  EXPECT_GE(child->PublishedSlot(20), 0);  // a client may carry the parent's table over
  EXPECT_TRUE(child->CheckInvariants().ok());
}

TEST(SequenceTest, ClearedHoldsNothing) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> seq = Make(1);
  kvmem::MutexLock lock(&seq->mu);
  seq->AddOrphan(4);
  EXPECT_THAT(seq->TakeOrphans(), ::testing::ElementsAre(4u));
  EXPECT_TRUE(seq->TakeOrphans().empty());
  seq->AddOrphan(5);
  seq->Clear();
  EXPECT_TRUE(seq->released());
  EXPECT_TRUE(seq->TakeOrphans().empty());
  EXPECT_EQ(seq->retained_slots(), 0u);
  EXPECT_EQ(seq->block_count(), 0u);
}

}  // namespace
}  // namespace kvmem::engine
