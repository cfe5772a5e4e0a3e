// Hand-computed cases for every policy formula (values worked out in the comments).
#include "server/policy/scoring.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select.h"
#include "server/policy/confkv.h"
#include "server/policy/infokv.h"
#include "server/policy/policy.h"
#include "server/policy/snapkv.h"

namespace kvmem::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::Pointwise;

TEST(ConfidenceTest, ByHand) {
  // V = 100, H = ln(100) / 2 -> 1 - H/lnV = 0.5; p1 = 0.6, p2 = 0.2 -> g = 1 - 1/3.
  // c = 0.4 * 0.5 + 0.3 * 0.6667 + 0.3 * 0.6 = 0.58
  EXPECT_NEAR(Confidence(std::log(100.0) / 2, 0.6, 0.2, 100, 0.4, 0.3, 0.3), 0.58, 1e-9);
  // A certain prediction: H = 0, p1 = 1, p2 = 0 -> 1.
  EXPECT_NEAR(Confidence(0, 1, 0, 50000, 0.4, 0.3, 0.3), 1.0, 1e-12);
  // Uniform over V: H = ln V, p1 = p2 = 1/V -> 0.3 / V.
  EXPECT_NEAR(Confidence(std::log(1000.0), 1e-3, 1e-3, 1000, 0.4, 0.3, 0.3), 3e-4, 1e-12);
}

// A 12-token stream under confkv with C = 6, P = 2, lambda 0.9, mixing 0.65/0.35.
TEST(ConfKvTest, TwelveTokenStreamEvictsTheKnownSet) {
  auto policy = *CreatePolicy("confkv", {{"c_high", 6}, {"c_low", 6}, {"protect", 2}});
  std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const float nan = std::nanf("");
  std::vector<float> ema = {0.5, 0.1, 0.1, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, nan, nan};
  std::vector<float> row = {0.3, 0, 0, 0, 0.1, 0, 0.2, 0, 0, 0.1, 0.2, 0.1};
  std::vector<StreamState> streams(1);
  streams[0].positions = positions;
  streams[0].scores = ema;
  streams[0].next_scores = absl::MakeSpan(ema);  // in place
  streams[0].attention = row;
  CallContext ctx;
  ctx.num_layers = 1;
  ctx.num_kv_heads = 1;
  ctx.vocab_size = 100;
  ctx.logits = LogitStats{static_cast<float>(std::log(100.0) / 2), 0.6f, 0.2f};  // c = 0.58
  Decision d = policy->Step(ctx, absl::MakeSpan(streams));
  EXPECT_NEAR(d.confidence, 0.58, 1e-6);
  EXPECT_EQ(d.budget_tokens, 6u);  // c <= theta -> C_low
  // e = 0.9 e + 0.1 a; new slots take their first weight:
  // [.48 .09 .09 .09 .28 .09 .11 .09 .09 .10 .2 .1]
  EXPECT_THAT(
      ema, Pointwise(FloatNear(1e-6), std::vector<float>{0.48, 0.09, 0.09, 0.09, 0.28, 0.09, 0.11,
                                                         0.09, 0.09, 0.10, 0.2, 0.1}));
  // r = 0.65 e/0.48 + 0.35 j/11 over slots 0..9 (10, 11 protected):
  // .650 .154 .186 .217 .506 .281 .340 .345 .376 .422 -> top 4: 0, 4, 9, 8.
  ASSERT_TRUE(d.keep[0].has_value());
  EXPECT_THAT(*d.keep[0], ElementsAre(0, 4, 8, 9, 10, 11));
}

TEST(ConfKvTest, HighConfidencePicksTheSmallBudgetAndIntervalDelaysEviction) {
  auto policy = *CreatePolicy(
      "confkv", {{"c_high", 4}, {"c_low", 8}, {"protect", 1}, {"theta", 0.5}, {"interval", 2}});
  std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<float> ema(10, std::nanf(""));
  std::vector<float> row(10, 0.1f);
  std::vector<StreamState> streams(1);
  streams[0].positions = positions;
  streams[0].scores = ema;
  streams[0].next_scores = absl::MakeSpan(ema);  // in place
  streams[0].attention = row;
  CallContext ctx;
  ctx.num_layers = 1;
  ctx.num_kv_heads = 1;
  ctx.vocab_size = 100;
  ctx.logits = LogitStats{0.0f, 1.0f, 0.0f};  // c = 1
  ctx.step = 1;                               // 1 % 2 != 0: scores only
  Decision d = policy->Step(ctx, absl::MakeSpan(streams));
  EXPECT_EQ(d.budget_tokens, 4u);
  EXPECT_FALSE(d.keep[0].has_value());
  ctx.step = 2;
  d = policy->Step(ctx, absl::MakeSpan(streams));
  ASSERT_TRUE(d.keep[0].has_value());
  // Equal EMA: recency decides; the newest 4 stay.
  EXPECT_THAT(*d.keep[0], ElementsAre(6, 7, 8, 9));
}

TEST(ConfKvLTest, LayerBudgets) {
  // C(l) = max(96, C * 0.5^(l/L)), L = 30: l = 0 -> 256; l = 15 -> 181; l = 29 -> 130.
  EXPECT_EQ(ConfKvLayerBudget(256, 0, 30, 96), 256u);
  EXPECT_EQ(ConfKvLayerBudget(256, 15, 30, 96), 181u);
  EXPECT_EQ(ConfKvLayerBudget(256, 29, 30, 96), 130u);
  EXPECT_EQ(ConfKvLayerBudget(128, 29, 30, 96), 96u);  // 65 -> floor
}

TEST(RefreeKvTest, StoppingIndexOnAConstructedRow) {
  // a = [.01 .01 .02 .6 .3 .06]: ||a||^2 = .4542. Dropping the first three loses
  // 1 - sqrt(.4536/.4542) = 0.066% <= 1%; dropping the fourth loses 54.6%.
  EXPECT_EQ(RefreeStopIndex({{0.01f, 0.01f, 0.02f, 0.6f, 0.3f, 0.06f}}, 0.01), 3u);
  // Two heads average their tail norms.
  EXPECT_EQ(RefreeStopIndex({{0.5f, 0.5f}, {0.0f, 1.0f}}, 0.01), 0u);
  EXPECT_EQ(RefreeStopIndex({{0.0f, 0.0f, 1.0f}}, 0.0), 2u);
  EXPECT_EQ(RefreeStopIndex({{0.0f, 0.0f}}, 0.01), 0u);  // no attention mass: keep all
}

TEST(RefreeKvTest, CompressSkipsTheFirstLayersAndKeepsSinks) {
  auto policy = *CreatePolicy("refreekv", {{"sinks", 1}});
  std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5, 6};
  // Candidates 1..6 carry [.01 .01 .02 .6 .3 .06] -> stop index 3 -> evict 1, 2, 3.
  std::vector<float> row = {0.5f, 0.01f, 0.01f, 0.02f, 0.6f, 0.3f, 0.06f};
  std::vector<float> scores(7, 0.0f);
  std::vector<StreamState> streams(3);
  for (uint32_t l = 0; l < 3; ++l) {
    streams[l].layer = l;
    streams[l].positions = positions;
    streams[l].scores = scores;
    streams[l].next_scores = absl::MakeSpan(scores);  // in place
    streams[l].attention = row;
  }
  CallContext ctx;
  ctx.num_layers = 3;
  ctx.num_kv_heads = 1;
  Decision d = policy->Compress(ctx, absl::MakeSpan(streams));
  EXPECT_FALSE(d.keep[0].has_value());
  EXPECT_FALSE(d.keep[1].has_value());
  ASSERT_TRUE(d.keep[2].has_value());
  EXPECT_THAT(*d.keep[2], ElementsAre(0, 4, 5, 6));
}

TEST(PyramidKvTest, BudgetsByHand) {
  // C - w = 96, min = 96 // 20 = 4, max = 192 - 4 = 188, step = (188 - 4) // 3 = 61.
  EXPECT_THAT(PyramidBudgets(1000, 128, 32, 4, 20), ElementsAre(188, 127, 66, 5));
  // n - w = 168 <= max: max = 168, min = 192 - 168 = 24, step = 48.
  EXPECT_THAT(PyramidBudgets(200, 128, 32, 4, 20), ElementsAre(168, 120, 72, 24));
  // n < 2 (C - w): plain C - w everywhere; n < C: no compression.
  EXPECT_THAT(PyramidBudgets(150, 128, 32, 4, 20), ElementsAre(96, 96, 96, 96));
  EXPECT_TRUE(PyramidBudgets(100, 128, 32, 4, 20).empty());
}

TEST(SnapKvTest, PooledScoresByHand) {
  // Prefix [0 0 5 0 0 0 10] pooled with kernel 5 (zero padding, / 5): [1 1 1 1 3 2 2].
  EXPECT_THAT(AvgPool(std::vector<float>{0, 0, 5, 0, 0, 0, 10}, 5),
              Pointwise(FloatNear(1e-6), std::vector<float>{1, 1, 1, 1, 3, 2, 2}));
  // Window of 2 (slots 7, 8) plus the top 2 pooled: slot 4 (3), then 5 over 6 (tie -> older).
  EXPECT_THAT(SnapKvKeep(std::vector<float>{0, 0, 5, 0, 0, 0, 10, 1, 1}, 2, 2, 5),
              ElementsAre(4, 5, 7, 8));
}

TEST(InfoKvTest, MixedScoreByHand) {
  // A = [1 2 4] -> [.25 .5 1]. H = [1 2 NaN -> 1.5], d = [0 1 .5], tau = 1:
  // E = [1 4 2.25] -> [.25 1 .5625]. s = .9 A + .1 E = [.25 .55 .95625].
  EXPECT_THAT(InfoKvScores(std::vector<float>{1, 2, 4}, std::vector<float>{1, 2, std::nanf("")},
                           std::vector<float>{0, 1, 0.5}, 0.9, 1.0),
              Pointwise(FloatNear(1e-6), std::vector<float>{0.25, 0.55, 0.95625}));
}

TEST(H2oTest, HeavyAndRecentSplit) {
  auto policy = *CreatePolicy("h2o", {{"budget", 4}, {"recent", 2}});
  std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5};
  std::vector<float> acc = {4, 1, 2, 0, 0, 0};
  std::vector<float> row = {1, 0, 1, 0, 0, 0};  // -> [5 1 3 0 0 0]
  std::vector<StreamState> streams(1);
  streams[0].positions = positions;
  streams[0].scores = acc;
  streams[0].next_scores = absl::MakeSpan(acc);  // in place
  streams[0].attention = row;
  Decision d = policy->Step({}, absl::MakeSpan(streams));
  EXPECT_THAT(acc, ElementsAre(5, 1, 3, 0, 0, 0));
  ASSERT_TRUE(d.keep[0].has_value());
  EXPECT_THAT(*d.keep[0], ElementsAre(0, 2, 4, 5));
}

TEST(H2oTest, PyramidBudgetsAverageTheBudget) {
  // C = 64, R = 32, 4 layers, beta 20: C - R = 32, min 1, max 63, step 20 -> 63 43 23 3.
  auto policy = *CreatePolicy("h2o", {{"budget", 64}, {"recent", 32}, {"pyramid", 1}});
  std::vector<int64_t> positions(200);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<std::vector<float>> scores(4, std::vector<float>(200, 0.0f));
  std::vector<StreamState> streams(4);
  for (uint32_t l = 0; l < 4; ++l) {
    streams[l].layer = l;
    streams[l].positions = positions;
    streams[l].scores = scores[l];
    streams[l].next_scores = absl::MakeSpan(scores[l]);  // in place
  }
  CallContext ctx;
  ctx.num_layers = 4;
  Decision d = policy->Step(ctx, absl::MakeSpan(streams));
  const std::vector<size_t> want = {32 + 63, 32 + 43, 32 + 23, 32 + 3};
  for (uint32_t l = 0; l < 4; ++l) {
    ASSERT_TRUE(d.keep[l].has_value());
    EXPECT_EQ(d.keep[l]->size(), want[l]) << l;
    const std::vector<uint32_t> kept = d.keep[l]->Slots();
    EXPECT_EQ(kept.back(), 199u);  // the recent window stays
    EXPECT_EQ(kept[kept.size() - 32], 168u);
  }
}

// The one-out fast path and the general path (the kernel reference) pick the same slots.
TEST(ConfKvTest, OneOutFastPathMatchesTheKernelReference) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const uint32_t n = 2 + rng() % 100;
    std::vector<float> ema(n);
    std::vector<int64_t> positions(n);
    int64_t at = 0;
    for (uint32_t j = 0; j < n; ++j) {
      ema[j] = static_cast<float>(rng() % 4) / 4;  // ties are common
      positions[j] = at += 1 + rng() % 2;
    }
    const uint32_t protect = rng() % n;
    const std::vector<uint32_t> fast = ConfKvKeep(ema, positions, n - 1, protect, 0.65).Slots();
    const kernels::StreamSlice slice{0, n, n - 1, protect};
    float mx = *std::max_element(ema.begin(), ema.end());
    std::vector<uint8_t> flags(n);
    kernels::SelectTopRef(&slice, 1, ema.data(), &mx, positions.data(), 0.65f, flags.data());
    std::vector<uint32_t> ref;
    for (uint32_t j = 0; j < n; ++j) {
      if (flags[j]) ref.push_back(j);
    }
    ASSERT_EQ(fast, ref) << "trial " << trial;
  }
}

TEST(ConfKvTest, RandomAblationKeepsProtectedAndBudget) {
  std::vector<int64_t> positions(100);
  std::iota(positions.begin(), positions.end(), 0);
  const std::vector<uint32_t> keep = RandomKeep(positions, 3, 1, 40, 10);
  ASSERT_EQ(keep.size(), 40u);
  EXPECT_TRUE(std::is_sorted(keep.begin(), keep.end()));
  for (uint32_t j = 90; j < 100; ++j) EXPECT_EQ(keep[j - 60], j);
  // Deterministic per (stream, position), and different across streams.
  EXPECT_EQ(keep, RandomKeep(positions, 3, 1, 40, 10));
  EXPECT_NE(keep, RandomKeep(positions, 4, 1, 40, 10));
  // Spread over the unprotected range, not clustered at one end.
  const size_t early = std::count_if(keep.begin(), keep.end(), [](uint32_t j) { return j < 45; });
  EXPECT_GT(early, 5u);
  EXPECT_LT(early, 25u);
}

TEST(StreamingLlmTest, SinksPlusRecent) {
  auto policy = *CreatePolicy("streaming_llm", {{"sinks", 2}, {"budget", 5}});
  std::vector<int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<StreamState> streams(1);
  streams[0].positions = positions;
  EXPECT_THAT(*policy->Step({}, absl::MakeSpan(streams)).keep[0], ElementsAre(0, 1, 5, 6, 7));
}

TEST(PolicyParamsTest, CrossChecks) {
  EXPECT_FALSE(CreatePolicy("confkv", {{"protect", 200}}).ok());    // >= c_high
  EXPECT_FALSE(CreatePolicy("confkv", {{"w_entropy", 0.5}}).ok());  // weights sum to 1.1
  EXPECT_FALSE(CreatePolicy("streaming_llm", {{"sinks", 600}}).ok());
  EXPECT_FALSE(CreatePolicy("h2o", {{"recent", 300}}).ok());
  EXPECT_TRUE(CreatePolicy("confkv_l", {{"protect", 64}}).ok());
}

}  // namespace
}  // namespace kvmem::policy
