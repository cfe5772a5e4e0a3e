#include "server/policy/policy.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmem::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<StreamState> Streams(std::vector<std::vector<int64_t>>& positions) {
  std::vector<StreamState> states(positions.size());
  for (size_t s = 0; s < positions.size(); ++s) states[s].positions = positions[s];
  return states;
}

TEST(PolicyRegistryTest, ListsFullAndWindowWithDefaults) {
  const auto& all = AllPolicies();
  ASSERT_GE(all.size(), 2u);
  EXPECT_EQ(all[0].name, "full");
  EXPECT_EQ(all[1].name, "window");
  ASSERT_EQ(all[1].params.size(), 1u);
  EXPECT_EQ(all[1].params[0].name, "window");
  EXPECT_EQ(all[1].params[0].default_value, 512);
}

// A kernel step updates scores where they live (store::SlotState), so a policy with one must
// keep them; the baselines that read none keep none (no memory, no staging per step).
TEST(PolicyRegistryTest, KernelStepsKeepScoresAndScorelessBaselinesKeepNone) {
  for (const PolicyDescriptor& d : AllPolicies()) {
    auto policy = CreatePolicy(d.name, {});
    ASSERT_TRUE(policy.ok()) << d.name << ": " << policy.status();
    if ((*policy)->has_kernel_step()) {
      EXPECT_TRUE(d.initial_score.has_value()) << d.name;
    }
  }
  // The policies that read StreamState::scores (h2o's accumulators, confkv's EMA) are
  // handed them only if they declare an initial score: a score-less one would be handed
  // empty spans.
  for (const char* name : {"h2o", "confkv", "confkv_l"}) {
    auto policy = CreatePolicy(name, {});
    ASSERT_TRUE(policy.ok()) << name;
    EXPECT_TRUE((*policy)->descriptor().initial_score.has_value()) << name;
  }
  for (const char* name : {"full", "window", "streaming_llm", "snapkv", "pyramidkv", "refreekv",
                           "refreekv_h2o", "infokv", "infokv_adaptive"}) {
    auto policy = CreatePolicy(name, {});
    ASSERT_TRUE(policy.ok()) << name;
    EXPECT_FALSE((*policy)->descriptor().initial_score.has_value()) << name;
  }
}

TEST(PolicyRegistryTest, RejectsUnknownPolicyAndParameters) {
  absl::Status s = CreatePolicy("lru", {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("policy.name"));
  EXPECT_THAT(s.message(), HasSubstr("window"));
  s = CreatePolicy("window", {{"windw", 3}}).status();
  EXPECT_THAT(s.message(), HasSubstr("policy.params[windw]"));
  s = CreatePolicy("window", {{"window", 0}}).status();
  EXPECT_THAT(s.message(), HasSubstr("outside [1,"));
  s = CreatePolicy("window", {{"window", 2.5}}).status();
  EXPECT_THAT(s.message(), HasSubstr("whole number"));
  s = CreatePolicy("window", {{"window", std::nan("")}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CreatePolicy("", {}).ok());  // "" = full
}

TEST(WindowPolicyTest, KeepsExactlyTheLastW) {
  auto policy = *CreatePolicy("window", {{"window", 4}});
  std::vector<std::vector<int64_t>> pos = {{0, 1, 2, 3, 4, 5, 6}, {10, 11}};
  std::vector<StreamState> streams = Streams(pos);
  Decision d = policy->Step({}, absl::MakeSpan(streams));
  EXPECT_EQ(d.budget_tokens, 4u);
  ASSERT_EQ(d.keep.size(), 2u);
  ASSERT_TRUE(d.keep[0].has_value());
  EXPECT_THAT(*d.keep[0], ElementsAre(3, 4, 5, 6));
  EXPECT_FALSE(d.keep[1].has_value());  // already within the window
}

TEST(WindowPolicyTest, CompressTargetNarrowsOnce) {
  auto policy = *CreatePolicy("window", {{"window", 4}});
  std::vector<std::vector<int64_t>> pos = {{0, 1, 2, 3, 4, 5, 6}};
  std::vector<StreamState> streams = Streams(pos);
  CallContext ctx;
  ctx.target_tokens = 2;
  EXPECT_THAT(*policy->Compress(ctx, absl::MakeSpan(streams)).keep[0], ElementsAre(5, 6));
}

TEST(FullPolicyTest, NeverEvicts) {
  auto policy = *CreatePolicy("full", {});
  std::vector<std::vector<int64_t>> pos = {{0, 1, 2, 3, 4, 5, 6}};
  std::vector<StreamState> streams = Streams(pos);
  CallContext ctx;
  ctx.target_tokens = 2;
  EXPECT_FALSE(policy->Step(ctx, absl::MakeSpan(streams)).keep[0].has_value());
  EXPECT_FALSE(policy->Compress(ctx, absl::MakeSpan(streams)).keep[0].has_value());
}

// A pure policy reads only what it is handed: a layer whose streams lack rows keeps every
// slot instead of reading past an empty span (the engine refuses such a step anyway).
TEST(RefreeKvPolicyTest, AStepSkipsLayersWithoutRows) {
  auto policy = *CreatePolicy("refreekv", {{"interval", 1}, {"sinks", 0}, {"skip_layers", 0}});
  std::vector<std::vector<int64_t>> pos(2, std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6});
  std::vector<StreamState> streams = Streams(pos);
  const std::vector<int64_t> arrival = {0, 0, 0, 1, 2, 3, 4};
  const std::vector<float> row = {0.3f, 0.3f, 0.3f, 1e-4f, 1e-4f, 1e-4f, 0.0997f};
  for (StreamState& st : streams) st.arrival_step = arrival;
  streams[0].attention = row;  // layer 0 has its row, layer 1 none
  CallContext ctx;
  ctx.step = 4;
  ctx.num_layers = 2;
  ctx.num_kv_heads = 1;
  const Decision d = policy->Step(ctx, absl::MakeSpan(streams));
  ASSERT_EQ(d.keep.size(), 2u);
  ASSERT_TRUE(d.keep[0].has_value());
  EXPECT_LT(d.keep[0]->size(), 7u);  // layer 0 ran the rule
  EXPECT_FALSE(d.keep[1].has_value());
}

TEST(LogitStatsTest, ChecksRanges) {
  EXPECT_TRUE(CheckLogitStats({1.0f, 0.5f, 0.2f}, 100).ok());
  EXPECT_THAT(CheckLogitStats({-1.0f, 0.5f, 0.2f}, 100).status().message(),
              HasSubstr("logit_stats.entropy"));
  EXPECT_THAT(CheckLogitStats({5.0f, 0.5f, 0.2f}, 100).status().message(),
              HasSubstr("ln(vocab_size)"));
  EXPECT_THAT(CheckLogitStats({1.0f, 0.0f, 0.0f}, 100).status().message(),
              HasSubstr("logit_stats.p1"));
  EXPECT_THAT(CheckLogitStats({1.0f, 0.3f, 0.4f}, 100).status().message(),
              HasSubstr("logit_stats.p2"));
  EXPECT_FALSE(CheckLogitStats({NAN, 0.5f, 0.2f}, 100).ok());
}

TEST(LogitStatsTest, FromTopLogprobs) {
  // Two outcomes of 0.5 each: entropy ln 2, no tail.
  const float lp = std::log(0.5f);
  LogitStats s = *LogitStatsFromTopLogprobs(std::vector<float>{lp, lp});
  EXPECT_NEAR(s.entropy, std::log(2.0), 1e-6);
  EXPECT_NEAR(s.p1, 0.5, 1e-6);
  EXPECT_NEAR(s.p2, 0.5, 1e-6);
  // Tail of 0.2 counts as one outcome: H = -(0.6 ln 0.6 + 0.2 ln 0.2 + 0.2 ln 0.2).
  s = *LogitStatsFromTopLogprobs(std::vector<float>{std::log(0.6f), std::log(0.2f)});
  EXPECT_NEAR(s.entropy, -(0.6 * std::log(0.6) + 0.4 * std::log(0.2)), 1e-5);
  EXPECT_FALSE(LogitStatsFromTopLogprobs(std::vector<float>{-1.0f}).ok());
  EXPECT_FALSE(LogitStatsFromTopLogprobs(std::vector<float>{-2.0f, -1.0f}).ok());  // ascending
  EXPECT_FALSE(LogitStatsFromTopLogprobs(std::vector<float>{-0.1f, -0.1f, -0.1f}).ok());  // > 1
}

}  // namespace
}  // namespace kvmem::policy
