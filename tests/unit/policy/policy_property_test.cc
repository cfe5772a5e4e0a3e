// Properties over random streams: budgets are never exceeded, protected windows and sinks
// are never evicted, keep-sets are ascending and in range.
#include <random>

#include "gtest/gtest.h"
#include "server/policy/policy.h"

namespace kvmem::policy {
namespace {

struct Case {
  const char* policy;
  ParamOverrides params;
  uint32_t budget;      // most slots a stream may keep after a decision
  uint32_t keep_first;  // slots at the start that must survive
  uint32_t keep_last;   // slots at the end that must survive
  bool compress;        // exercise Compress instead of Step
};

class PolicyPropertyTest : public ::testing::TestWithParam<Case> {};

TEST_P(PolicyPropertyTest, RandomStreams) {
  const Case& c = GetParam();
  std::mt19937 rng(1234);
  auto policy = *CreatePolicy(c.policy, c.params);
  const uint32_t L = 3, H = 2;
  for (int trial = 0; trial < 60; ++trial) {
    const uint32_t n = 1 + rng() % 400;
    std::vector<std::vector<int64_t>> positions(L * H);
    std::vector<std::vector<float>> scores(L * H), rows(L * H), window(L * H), entropy(L * H),
        distance(L * H);
    std::vector<std::vector<int64_t>> arrival(L * H);
    std::vector<StreamState> streams(L * H);
    for (uint32_t s = 0; s < L * H; ++s) {
      int64_t p = rng() % 5;
      for (uint32_t j = 0; j < n; ++j) {
        positions[s].push_back(p);
        p += 1 + rng() % 3;
      }
      std::uniform_real_distribution<float> u(0, 1);
      float sum = 0;
      for (uint32_t j = 0; j < n; ++j) {
        rows[s].push_back(u(rng));
        sum += rows[s].back();
        scores[s].push_back(trial % 2 ? std::nanf("") : u(rng));
        window[s].push_back(u(rng) * 5);
        entropy[s].push_back(u(rng) * 3);
        distance[s].push_back(u(rng));
        arrival[s].push_back(j < n / 2 ? 0 : 1 + j);
      }
      for (float& a : rows[s]) a /= sum;
      streams[s] = {s / H,     s % H,     positions[s], absl::MakeSpan(scores[s]),
                    rows[s],   window[s], entropy[s],   distance[s],
                    arrival[s]};
    }
    CallContext ctx;
    ctx.step = trial;
    ctx.num_layers = L;
    ctx.num_kv_heads = H;
    ctx.vocab_size = 1000;
    ctx.logits = LogitStats{static_cast<float>(rng() % 7), 0.5f, 0.25f};
    Decision d = c.compress ? policy->Compress(ctx, absl::MakeSpan(streams))
                            : policy->Step(ctx, absl::MakeSpan(streams));
    ASSERT_EQ(d.keep.size(), L * H);
    for (uint32_t s = 0; s < L * H; ++s) {
      if (!d.keep[s]) continue;
      const std::vector<uint32_t>& keep = *d.keep[s];
      EXPECT_LE(keep.size(), c.budget) << c.policy << " n=" << n;
      for (size_t j = 0; j < keep.size(); ++j) {
        ASSERT_LT(keep[j], n);
        if (j > 0) {
          ASSERT_GT(keep[j], keep[j - 1]);
        }
      }
      for (uint32_t j = 0; j < std::min(c.keep_first, n); ++j) {
        EXPECT_TRUE(std::binary_search(keep.begin(), keep.end(), j)) << c.policy << " sink " << j;
      }
      for (uint32_t j = n - std::min(c.keep_last, n); j < n; ++j) {
        EXPECT_TRUE(std::binary_search(keep.begin(), keep.end(), j)) << c.policy << " recent " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPolicies, PolicyPropertyTest,
    ::testing::Values(
        Case{"window", {{"window", 50}}, 50, 0, 50, false},
        Case{"streaming_llm", {{"budget", 60}, {"sinks", 4}}, 60, 4, 56, false},
        Case{"h2o", {{"budget", 64}}, 64, 0, 32, false},
        Case{"h2o", {{"budget", 64}}, 64, 0, 32, true},
        Case{"snapkv", {{"budget", 80}}, 80, 0, 32, true},
        Case{"pyramidkv", {{"budget", 80}}, 2 * 48 + 32, 0, 32, true},
        Case{"confkv", {{"c_high", 40}, {"c_low", 70}, {"protect", 16}}, 70, 0, 16, false},
        Case{"confkv", {{"c_high", 40}, {"c_low", 70}, {"protect", 16}}, 70, 0, 16, true},
        Case{"confkv_l", {{"c_high", 100}, {"c_low", 200}, {"layer_floor", 50}}, 200, 0, 32, false},
        Case{"refreekv", {}, 400, 4, 0, true}, Case{"refreekv_h2o", {}, 400, 4, 8, true},
        Case{"infokv", {}, 400, 0, 32, true}, Case{"infokv_adaptive", {}, 400, 0, 32, true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(info.param.policy) + (info.param.compress ? "_compress" : "_step");
    });

}  // namespace
}  // namespace kvmem::policy
