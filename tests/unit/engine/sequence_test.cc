// Sequence (server/engine/sequence.h): the state a sequence keeps for itself — one stream
// per (layer, kv_head) from construction, poisoning that sticks, versions that only grow,
// published versions it can name, a fork's copy of the state, and nothing held once
// cleared — each checked against CheckInvariants where it applies.
#include "server/engine/sequence.h"

#include <algorithm>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/common/mutex.h"

namespace kvmem::engine {
namespace {

std::unique_ptr<Sequence> Make(uint64_t id, uint64_t parent = 0, const std::string& name = "h2o") {
  const Layout layout{3, 2, 8, DType::kF16, 16, 0};
  auto policy = policy::CreatePolicy(name, {});
  EXPECT_TRUE(policy.ok()) << policy.status();
  auto seq = std::make_unique<Sequence>(id, layout, name, policy::ParamOverrides{},
                                        *std::move(policy), QuantConfig{}, absl::Seconds(30),
                                        /*epoch_slot=*/0, parent);
  // The scores' home, as the engine gives a sequence whose policy keeps them.
  kvmem::MutexLock lock(&seq->mu);
  if (seq->policy().descriptor().initial_score) {
    seq->set_slots(store::MakeHostScoreState(layout.num_streams()), /*kernel_step=*/false);
  }
  return seq;
}

TEST(SequenceTest, HasOneStreamPerLayerAndHeadFromTheStart) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<Sequence> seq = Make(1);
  kvmem::MutexLock lock(&seq->mu);
  EXPECT_EQ(seq->streams().size(), 6u);
  EXPECT_EQ(seq->num_streams(), 6u);
  EXPECT_TRUE(seq->CheckInvariants().ok());
}

TEST(SequenceTest, OnlyAPolicyThatReadsPerTokenSignalsKeepsThem) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const std::vector<int64_t> positions = {0, 1, 2};
  const std::vector<float> entropy = {0.5f, 1.0f, 1.5f};
  uint64_t bytes[2] = {0, 0};
  for (const bool infokv : {false, true}) {
    std::unique_ptr<Sequence> seq = Make(1, 0, infokv ? "infokv" : "window");
    kvmem::MutexLock lock(&seq->mu);
    for (size_t s = 0; s < seq->streams().size(); ++s) {
      Stream& st = seq->stream(s);
      ASSERT_EQ(st.token_signals(), infokv);
      st.Reserve(positions.size(), 0);
      st.AppendSlots(positions, 0, entropy, entropy, 0);
      EXPECT_EQ(st.token_entropy().size(), infokv ? 3u : 0u);
      EXPECT_EQ(st.layer_distance().size(), infokv ? 3u : 0u);
      EXPECT_EQ(st.arrival_step().size(), 0u);  // neither reads it
      // A copy (a fork's) keeps the choice.
      const Stream copy = st;
      EXPECT_EQ(copy.token_signals(), infokv);
    }
    bytes[infokv] = seq->streams()[0].host_bytes();
  }
  EXPECT_LT(bytes[0], bytes[1]);
}

// Only ReFreeKV reads the step each slot arrived at; every other policy saves the column.
TEST(SequenceTest, OnlyAPolicyThatReadsArrivalStepsKeepsThem) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const std::vector<int64_t> positions = {0, 1, 2};
  uint64_t bytes[2] = {0, 0};
  for (const bool refreekv : {false, true}) {
    std::unique_ptr<Sequence> seq = Make(1, 0, refreekv ? "refreekv" : "confkv");
    kvmem::MutexLock lock(&seq->mu);
    for (size_t s = 0; s < seq->streams().size(); ++s) {
      Stream& st = seq->stream(s);
      ASSERT_EQ(st.arrival_steps(), refreekv);
      st.Reserve(positions.size(), 0);
      st.AppendSlots(positions, 0, {}, {}, 7);
      const std::vector<int64_t> want =
          refreekv ? std::vector<int64_t>(3, 7) : std::vector<int64_t>();
      EXPECT_EQ(std::vector<int64_t>(st.arrival_step().begin(), st.arrival_step().end()), want);
      st.KeepSlots(KeepSet::FromSlots({0, 2}), 0);
      EXPECT_EQ(st.arrival_step().size(), refreekv ? 2u : 0u);
      const Stream copy = st;
      EXPECT_EQ(copy.arrival_steps(), refreekv);
    }
    bytes[refreekv] = seq->streams()[0].host_bytes();
  }
  EXPECT_LT(bytes[0], bytes[1]);
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
  child->CopyStateFrom(*parent, *parent->slots()->Clone());  // the scores' copy (the engine's)
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

// A stream's per-slot vectors against plain vectors, over thousands of appends and keep-sets
// of every kind: head evictions (which only move the dead front), holes, a whole stream
// dropped, history rows. Every vector must hold the reference's
// values in order, and the memory held stays within a bound of the live slots.
TEST(StreamTest, PerSlotVectorsFollowEveryAppendAndKeepSet) {
  std::mt19937 rng(11);
  constexpr uint32_t kRows = 3;
  {
    Stream st;
    std::vector<int64_t> positions, arrival;
    std::vector<float> history, entropy, distance;
    int64_t next = 0;
    size_t most = 0;
    for (int step = 0; step < 3000; ++step) {
      const size_t n = 1 + rng() % (step % 500 < 20 ? 40 : 2);
      std::vector<int64_t> p(n);
      std::vector<float> e(n), d(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = next++;
        e[i] = static_cast<float>(p[i]) * 0.5f;
        d[i] = static_cast<float>(p[i]) * 0.25f;
      }
      st.Reserve(n, kRows);
      const uint64_t reserved = st.host_bytes();
      st.AppendSlots(p, kRows, e, d, step);
      ASSERT_EQ(st.host_bytes(), reserved) << "an append into reserved room allocated";
      positions.insert(positions.end(), p.begin(), p.end());
      history.insert(history.end(), n * kRows, 0.0f);
      entropy.insert(entropy.end(), e.begin(), e.end());
      distance.insert(distance.end(), d.begin(), d.end());
      arrival.insert(arrival.end(), n, step);
      // A value per step and slot (exact in a float), so that a row moved wrongly shows.
      std::vector<float> row(st.size());
      for (size_t j = 0; j < row.size(); ++j) row[j] = static_cast<float>(step * 4096 + j);
      st.RecordHistory(row, step % kRows, kRows);
      for (size_t j = 0; j < positions.size(); ++j) history[j * kRows + step % kRows] = row[j];
      // Mostly a window's head eviction; often one slot out of anywhere (confkv's steady
      // state: closed up toward either end), sometimes holes, sometimes everything.
      std::vector<uint32_t> keep;
      const uint32_t size = static_cast<uint32_t>(positions.size());
      const int kind = static_cast<int>(rng() % 200);
      const uint32_t hole = size == 0 ? 0 : static_cast<uint32_t>(rng() % size);
      for (uint32_t i = 0; i < size; ++i) {
        const bool kept = kind < 120   ? i >= std::min<uint32_t>(size, n) || size < 64
                          : kind < 180 ? i != hole
                          : kind < 199 ? rng() % 8 != 0
                                       : false;
        if (kept) keep.push_back(i);
      }
      st.KeepSlots(KeepSet::FromSlots(keep), kRows);
      auto filter = [&](auto& v, size_t width) {
        std::remove_reference_t<decltype(v)> out;
        for (uint32_t i : keep) {
          out.insert(out.end(), v.begin() + i * width, v.begin() + (i + 1) * width);
        }
        v = out;
      };
      filter(positions, 1);
      filter(history, kRows);
      filter(entropy, 1);
      filter(distance, 1);
      filter(arrival, 1);
      ASSERT_EQ(st.size(), positions.size()) << "step " << step;
      ASSERT_TRUE(std::equal(positions.begin(), positions.end(), st.positions().begin(),
                             st.positions().end()))
          << "step " << step;
      ASSERT_EQ(std::vector<float>(st.history().begin(), st.history().end()), history);
      ASSERT_EQ(std::vector<float>(st.token_entropy().begin(), st.token_entropy().end()), entropy);
      ASSERT_EQ(std::vector<float>(st.layer_distance().begin(), st.layer_distance().end()),
                distance);
      ASSERT_EQ(std::vector<int64_t>(st.arrival_step().begin(), st.arrival_step().end()), arrival);
      most = std::max(most, positions.size() + n);
      // Dead fronts are taken back: each vector holds at most twice the most slots ever live
      // with an append.
      ASSERT_LE(st.host_bytes(), sizeof(Stream) + 2 * most * (2 * 8 + 4 * (4 + kRows)))
          << "step " << step;
      if (step % 97 == 0) {
        // A copy holds the same slots, and only the live ones.
        Stream copy;
        copy.AdoptFrom(st, 1);
        ASSERT_TRUE(std::equal(positions.begin(), positions.end(), copy.positions().begin(),
                               copy.positions().end()));
        ASSERT_EQ(std::vector<float>(copy.history().begin(), copy.history().end()), history);
        ASSERT_LE(copy.host_bytes(), sizeof(Stream) + positions.size() * (2 * 8 + 4 * (4 + kRows)))
            << "step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace kvmem::engine
