// The host SlotState against the plain model (tests/testing/slot_state_script.h), and the
// bookkeeping it shares with the CUDA implementation.
#include "server/store/slot_state.h"

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/slot_state_script.h"

namespace kvmem::store {
namespace {

using ::testing::ElementsAre;

TEST(SlotStateTest, HostStateFollowsTheModelThroughRandomScripts) {
  for (uint32_t seed = 0; seed < 40; ++seed) {
    testing::RunSlotStateScript([](uint32_t streams) { return MakeHostSlotState(streams); }, seed,
                                120);
    if (HasFatalFailure()) return;
  }
}

TEST(SlotStateTest, CapacityDoublesAndKeepsEveryStreamInPlace) {
  SlotBook book(3);
  EXPECT_EQ(*book.CapacityFor(5), 16u);
  book.set_capacity(16);
  book.Grow(10);
  EXPECT_EQ(*book.CapacityFor(6), 16u);
  EXPECT_EQ(*book.CapacityFor(7), 32u);
  EXPECT_EQ(*book.CapacityFor(100), 128u);
  EXPECT_FALSE(book.CapacityFor(SlotBook::kMaxSlots).ok());
  const std::vector<uint32_t> budget = {4, 5, 6};
  const std::vector<kernels::StreamSlice> slices = book.Slices(budget, 2);
  EXPECT_EQ(slices[2].offset, 32u);
  EXPECT_EQ(slices[2].length, 10u);
  EXPECT_EQ(slices[2].budget, 6u);
  EXPECT_EQ(slices[2].protect, 2u);
}

TEST(SlotStateTest, KeepingFewSlotsGivesCapacityBack) {
  std::unique_ptr<SlotState> state = MakeHostSlotState(2);
  std::vector<int64_t> positions(200);
  for (int64_t i = 0; i < 200; ++i) positions[i] = 3 * i;
  ASSERT_TRUE(state->Append(positions, 0.5f).ok());
  EXPECT_EQ(state->bytes(), 2u * 256 * 17);  // capacity 256 per stream, 17 bytes a slot
  KeepSets keep(2);
  keep[0].emplace();
  for (uint32_t j = 190; j < 200; ++j) keep[0]->Add(j);
  ASSERT_TRUE(state->Keep(keep).ok());
  EXPECT_EQ(state->bytes(), 2u * 256 * 17);  // stream 1 still holds 200
  keep[1] = keep[0];
  keep[0] = std::nullopt;
  ASSERT_TRUE(state->Keep(keep).ok());
  EXPECT_EQ(state->bytes(), 2u * 32 * 17);  // 10 each: twice that, rounded up
  std::vector<std::vector<int64_t>> kept;
  ASSERT_TRUE(state->ReadPositions(&kept).ok());
  EXPECT_THAT(kept[0], ElementsAre(570, 573, 576, 579, 582, 585, 588, 591, 594, 597));
  EXPECT_EQ(kept[1], kept[0]);
}

TEST(SlotStateTest, FlagsAndKeepSetsRoundTrip) {
  SlotBook book(2);
  book.set_capacity(16);
  book.Grow(4);
  std::vector<uint8_t> flags(32, 1);
  flags[1] = 0;  // stream 0 drops slot 1; stream 1 keeps everything
  const KeepSets keep = book.ToKeepSets(flags.data());
  ASSERT_TRUE(keep[0].has_value());
  EXPECT_THAT(*keep[0], ElementsAre(0, 2, 3));
  EXPECT_FALSE(keep[1].has_value());
  std::vector<uint8_t> back(32, 9);
  ASSERT_TRUE(book.FromKeepSets(keep, back.data()).ok());
  EXPECT_THAT(std::vector<uint8_t>(back.begin(), back.begin() + 4), ElementsAre(1, 0, 1, 1));
  EXPECT_THAT(std::vector<uint8_t>(back.begin() + 16, back.begin() + 20), ElementsAre(1, 1, 1, 1));
  KeepSets unordered(2);
  unordered[1] = KeepSet::FromSlots(std::vector<uint32_t>{2, 1});
  EXPECT_FALSE(book.FromKeepSets(unordered, back.data()).ok());
}

// Enough streams and slots for a Step to split its streams across threads: keep-sets and
// scores as the model's, AbortStep puts every stream's scores back, CommitStep compacts.
TEST(SlotStateTest, ManyLongStreamsStepLikeTheModel) {
  constexpr uint32_t S = 40, n = 3000;  // StreamGrain: tasks of 10 streams
  std::unique_ptr<SlotState> state = MakeHostSlotState(S);
  std::vector<int64_t> positions(n);
  for (uint32_t j = 0; j < n; ++j) positions[j] = 5 + 2 * j + j % 3;
  ASSERT_TRUE(state->Append(positions, std::nanf("")).ok());
  testing::SlotModel m{std::vector<std::vector<float>>(S, std::vector<float>(n, std::nanf(""))),
                       std::vector<std::vector<int64_t>>(S, positions)};
  std::mt19937 rng(4);
  const kernels::ScoreStep step{kernels::ScoreRule::kEma, 0.9f, 0.65f, true, true};
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> rows(S);
    std::vector<uint32_t> budget(S);
    testing::SlotModel stepped = m;
    KeepSets want(S);
    for (uint32_t s = 0; s < S; ++s) {
      const auto len = static_cast<uint32_t>(m.positions[s].size());
      float mx = 0;
      for (uint32_t j = 0; j < len; ++j) {
        rows[s].push_back(static_cast<float>(rng() % 8) / 8);
        float& e = stepped.scores[s][j];
        e = std::isnan(e) ? rows[s][j] : 0.9f * e + (1.0f - 0.9f) * rows[s][j];
        mx = std::max(mx, e);
      }
      // Even streams one over the budget (the decode steady state), odd ones far over it.
      budget[s] = s % 2 == 0 ? len - 1 : len / 2;
      want[s] =
          testing::ModelSelect(stepped.scores[s], stepped.positions[s], budget[s], 32, mx, 0.65f);
    }
    const std::vector<absl::Span<const float>> spans(rows.begin(), rows.end());
    KeepSets got;
    ASSERT_TRUE(state->Step(step, spans, budget, 32, &got).ok());
    ASSERT_EQ(got, want) << "round " << round;
    ASSERT_TRUE(state->AbortStep().ok());
    testing::ExpectMatches(*state, m, "after AbortStep");
    ASSERT_TRUE(state->Step(step, spans, budget, 32, &got).ok());
    ASSERT_EQ(got, want) << "round " << round;
    ASSERT_TRUE(state->CommitStep().ok());
    testing::ModelKeep(stepped, want);
    m = stepped;
    testing::ExpectMatches(*state, m, "after CommitStep");
  }
}

}  // namespace
TEST(SlotStateTest, AbortStepPutsTheScoresBack) {
  std::unique_ptr<SlotState> state = MakeHostSlotState(2);
  const std::vector<int64_t> positions = {0, 1, 2, 3};
  ASSERT_TRUE(state->Append(positions, 0.25f).ok());
  std::vector<std::vector<float>> before;
  ASSERT_TRUE(state->ReadScores(&before).ok());
  const std::vector<float> row = {1, 2, 3, 4};
  const absl::Span<const float> rows[] = {row, row};
  const uint32_t budget[] = {2, 2};
  KeepSets keep;
  ASSERT_TRUE(
      state->Step({kernels::ScoreRule::kAccumulate, 0, 1, false, true}, rows, budget, 0, &keep)
          .ok());
  ASSERT_TRUE(keep[0].has_value());
  ASSERT_TRUE(state->AbortStep().ok());
  std::vector<std::vector<float>> after;
  ASSERT_TRUE(state->ReadScores(&after).ok());
  EXPECT_EQ(after, before);
  ASSERT_TRUE(state->CommitStep().ok());  // nothing pending after an abort
  EXPECT_EQ(state->length(0), 4u);
}

// Host policy code reads the scores and stages the next in place: they become the scores
// only at CommitStaged (a call that fails before leaves them as they were), and a Keep
// after it compacts the committed ones; a step's AbortStep after a commit restores nothing
// stale.
TEST(SlotStateTest, HostScoresStageInPlaceAndCommitOnlyWhenAsked) {
  std::unique_ptr<SlotState> state = MakeHostSlotState(2);
  HostScores* host = state->host_scores();
  ASSERT_NE(host, nullptr);
  ASSERT_TRUE(state->Append(std::vector<int64_t>{0, 1, 2, 3, 4}, 0.5f).ok());
  EXPECT_THAT(host->scores(1), ElementsAre(0.5f, 0.5f, 0.5f, 0.5f, 0.5f));
  host->PrepareStage();
  for (uint32_t s = 0; s < 2; ++s) {
    absl::Span<float> next = host->staged(s);
    ASSERT_EQ(next.size(), 5u);
    for (size_t j = 0; j < next.size(); ++j) next[j] = static_cast<float>(10 * s + j);
  }
  // Not committed: a failed call's staging changes nothing.
  EXPECT_THAT(host->scores(0), ElementsAre(0.5f, 0.5f, 0.5f, 0.5f, 0.5f));
  host->PrepareStage();
  for (uint32_t s = 0; s < 2; ++s) {
    absl::Span<float> next = host->staged(s);
    for (size_t j = 0; j < next.size(); ++j) next[j] = static_cast<float>(10 * s + j);
  }
  host->CommitStaged();
  EXPECT_THAT(host->scores(1), ElementsAre(10, 11, 12, 13, 14));
  KeepSets keep(2);
  keep[0] = KeepSet::FromSlots(std::vector<uint32_t>{1, 3});
  ASSERT_TRUE(state->Keep(keep).ok());
  EXPECT_THAT(host->scores(0), ElementsAre(1, 3));
  EXPECT_THAT(host->scores(1), ElementsAre(10, 11, 12, 13, 14));
  ASSERT_TRUE(state->AbortStep().ok());  // no step pending: nothing to put back
  EXPECT_THAT(host->scores(0), ElementsAre(1, 3));
  std::vector<std::vector<int64_t>> positions;
  ASSERT_TRUE(state->ReadPositions(&positions).ok());
  EXPECT_THAT(positions[0], ElementsAre(1, 3));
}

// The scores-only state of a host-stepping sequence: the same staging contract, a Keep
// that closes each stream up (either end), copies back and forth, and no kernel step.
TEST(SlotStateTest, HostScoreStateKeepsScoresOnly) {
  std::unique_ptr<SlotState> state = MakeHostScoreState(2);
  HostScores* host = state->host_scores();
  ASSERT_NE(host, nullptr);
  ASSERT_TRUE(state->Append(std::vector<int64_t>{0, 1, 2, 3, 4, 5}, std::nanf("")).ok());
  host->PrepareStage();
  for (uint32_t s = 0; s < 2; ++s) {
    absl::Span<float> next = host->staged(s);
    for (size_t j = 0; j < next.size(); ++j) next[j] = static_cast<float>(10 * s + j);
  }
  EXPECT_TRUE(std::isnan(host->scores(0)[0]));  // staged, not committed
  host->CommitStaged();
  KeepSets keep(2);
  keep[0] = KeepSet::FromSlots(std::vector<uint32_t>{0, 1, 2, 4, 5});  // toward the front
  keep[1] = KeepSet::FromSlots(std::vector<uint32_t>{1, 3, 4, 5});     // toward the back
  ASSERT_TRUE(state->Keep(keep).ok());
  EXPECT_THAT(host->scores(0), ElementsAre(0, 1, 2, 4, 5));
  EXPECT_THAT(host->scores(1), ElementsAre(11, 13, 14, 15));
  EXPECT_EQ(state->length(1), 4u);
  KeepSets bad(2);
  bad[0] = KeepSet::FromSlots(std::vector<uint32_t>{0, 9});
  EXPECT_EQ(state->Keep(bad).code(), absl::StatusCode::kInternal);
  EXPECT_THAT(host->scores(0), ElementsAre(0, 1, 2, 4, 5));  // refused whole
  std::vector<std::vector<float>> scores;
  ASSERT_TRUE(state->ReadScores(&scores).ok());
  scores[1][0] = 99;
  ASSERT_TRUE(state->WriteScores(scores).ok());
  std::unique_ptr<SlotState> copy = *state->Clone();
  state->DropNewest(2);
  EXPECT_THAT(copy->host_scores()->scores(1), ElementsAre(99, 13, 14, 15));
  EXPECT_THAT(host->scores(1), ElementsAre(99, 13));
  std::vector<std::vector<int64_t>> positions;
  EXPECT_EQ(state->ReadPositions(&positions).code(), absl::StatusCode::kFailedPrecondition);
  KeepSets sets;
  const std::vector<float> row = {1, 2};
  const absl::Span<const float> rows[] = {row, row};
  const uint32_t budget[] = {1, 1};
  EXPECT_EQ(
      state->Step({kernels::ScoreRule::kAccumulate, 0, 1, false, true}, rows, budget, 0, &sets)
          .code(),
      absl::StatusCode::kInternal);
}

}  // namespace kvmem::store
