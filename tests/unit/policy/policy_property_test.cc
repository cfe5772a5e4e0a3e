// Properties over random streams: budgets are never exceeded, protected windows and sinks
// are never evicted, keep-sets are ascending and in range.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "server/policy/policy.h"

namespace kvmem::policy {
namespace {

struct Case {
  const char* policy;
  ParamOverrides params;
  uint32_t budget;           // most slots a stream may keep after a decision ...
  uint32_t keep_first;       // slots at the start that must survive
  uint32_t keep_last;        // slots at the end that must survive
  bool compress;             // exercise Compress instead of Step
  double share = 0;          // ... or ceil(share * n) if more (ratio policies)
  bool refree_rule = false;  // check ReFreeKV's stopping rule (ALGORITHMS.md) per layer
  // All streams together keep at most streams x (ceil(total_share * n) + keep_last): a
  // total that layer budgets only redistribute (infokv_adaptive).
  double total_share = 0;
};

// ReFreeKV's j* from ALGORITHMS.md, written from the text: candidates are slots [4, n)
// oldest first; B = mean_h |a_h|, N_j = mean_h sqrt(sum_{k >= j} a_h[k]^2),
// j* = max {j : (B - N_j) / B <= T}. Returns drop_j for every j (0..m).
std::vector<double> RefreeDrops(const std::vector<std::vector<float>>& rows, size_t m) {
  std::vector<double> drops(m + 1, 0.0);
  double B = 0;
  std::vector<double> tails(m + 1, 0.0);
  for (const std::vector<float>& a : rows) {
    double total = 0;
    for (size_t k = 0; k < m; ++k) total += double{a[k]} * a[k];
    B += std::sqrt(total) / rows.size();
    double tail = total;
    for (size_t j = 0; j <= m; ++j) {
      tails[j] += std::sqrt(std::max(tail, 0.0)) / rows.size();
      if (j < m) tail -= double{a[j]} * a[j];
    }
  }
  for (size_t j = 0; j <= m; ++j) drops[j] = B > 0 ? (B - tails[j]) / B : 0;
  return drops;
}

class PolicyPropertyTest : public ::testing::TestWithParam<Case> {};

TEST_P(PolicyPropertyTest, RandomStreams) {
  const Case& c = GetParam();
  std::mt19937 rng(1234);
  auto policy = *CreatePolicy(c.policy, c.params);
  const uint32_t L = 3, H = 2;
  int bites = 0;
  for (int trial = 0; trial < 60; ++trial) {
    // Large enough that every budget below bites in most trials.
    const uint32_t n = 1 + rng() % 600;
    std::vector<std::vector<int64_t>> positions(L * H);
    std::vector<std::vector<float>> scores(L * H), rows(L * H), window(L * H), entropy(L * H),
        distance(L * H);
    std::vector<std::vector<int64_t>> arrival(L * H);
    std::vector<std::vector<float>> next(L * H);
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
      next[s].assign(n, -1.0f);
      StreamState& st = streams[s];
      st.layer = s / H;
      st.kv_head = s % H;
      st.positions = positions[s];
      st.scores = scores[s];
      st.next_scores = absl::MakeSpan(next[s]);
      st.attention = rows[s];
      st.window_scores = window[s];
      st.token_entropy = entropy[s];
      st.layer_distance = distance[s];
      st.arrival_step = arrival[s];
    }
    const std::vector<std::vector<float>> scores_before = scores;
    CallContext ctx;
    ctx.step = trial;
    ctx.num_layers = L;
    ctx.num_kv_heads = H;
    ctx.vocab_size = 1000;
    ctx.logits = LogitStats{static_cast<float>(rng() % 7), 0.5f, 0.25f};
    Decision d = c.compress ? policy->Compress(ctx, absl::MakeSpan(streams))
                            : policy->Step(ctx, absl::MakeSpan(streams));
    ASSERT_EQ(d.keep.size(), L * H);
    // Pure: the committed scores are untouched, written next scores cover every slot, and
    // the same call decides the same again.
    for (uint32_t s = 0; s < L * H; ++s) {  // bit for bit (NaN marks "not scored yet")
      ASSERT_EQ(std::memcmp(scores[s].data(), scores_before[s].data(), n * sizeof(float)), 0)
          << c.policy << ": Step/Compress wrote the committed scores";
    }
    if (d.scores_written) {
      for (uint32_t s = 0; s < L * H; ++s) {
        for (float v : next[s]) ASSERT_NE(v, -1.0f) << c.policy << ": a next score not written";
      }
    }
    const Decision again = c.compress ? policy->Compress(ctx, absl::MakeSpan(streams))
                                      : policy->Step(ctx, absl::MakeSpan(streams));
    EXPECT_EQ(again.keep, d.keep) << c.policy;
    const uint32_t budget = std::max<uint32_t>(
        c.budget, static_cast<uint32_t>(std::ceil(c.share * static_cast<double>(n))));
    if (c.total_share > 0) {
      uint64_t kept = 0;
      for (uint32_t s = 0; s < L * H; ++s) kept += d.keep[s] ? d.keep[s]->size() : n;
      const uint64_t cap =
          uint64_t{L * H} * (static_cast<uint64_t>(std::ceil(c.total_share * n)) + c.keep_last);
      EXPECT_LE(kept, cap) << c.policy << " n=" << n;
      if (cap < uint64_t{L * H} * n) ++bites;
    } else if (n > budget + c.keep_first && !c.refree_rule) {
      ++bites;  // the budget binds: this decision must evict
    }
    if (c.refree_rule) {
      for (uint32_t l = 0; l < L; ++l) {
        std::vector<std::vector<float>> cand_rows(H);
        const size_t first = std::min<size_t>(4, n), last = n - std::min(c.keep_last, n);
        const size_t m = last > first ? last - first : 0;
        for (uint32_t h = 0; h < H; ++h) {
          cand_rows[h].assign(rows[l * H + h].begin() + first, rows[l * H + h].begin() + last);
        }
        const std::vector<double> drops = RefreeDrops(cand_rows, m);
        for (uint32_t h = 0; h < H; ++h) {
          const std::optional<KeepSet>& keep = d.keep[l * H + h];
          const size_t evicted = keep ? n - keep->size() : 0;
          if (l < 2) {
            EXPECT_EQ(evicted, 0u) << "layers 0 and 1 are never compressed";
            continue;
          }
          ASSERT_LE(evicted, m);
          EXPECT_LE(drops[evicted], 0.01 + 1e-6) << "evicted past the 1% threshold";
          if (evicted < m) {
            EXPECT_GT(drops[evicted + 1], 0.01 - 1e-6) << "stopped before the threshold";
          }
          if (keep) {  // the evicted ones are the oldest candidates
            for (uint32_t j = 0; j < first; ++j)
              EXPECT_TRUE(std::binary_search(keep->begin(), keep->end(), j));
            for (size_t j = first; j < first + evicted; ++j) {
              EXPECT_FALSE(std::binary_search(keep->begin(), keep->end(), j));
            }
          }
        }
      }
    }
    for (uint32_t s = 0; s < L * H; ++s) {
      if (!d.keep[s]) {
        // Keeping everything is right only within the budget.
        if (!c.refree_rule && c.total_share == 0) {
          EXPECT_LE(n, budget) << c.policy << " n=" << n << ": kept all past the budget";
        }
        continue;
      }
      EXPECT_TRUE(d.keep[s]->ValidFor(n)) << c.policy << " n=" << n;
      const std::vector<uint32_t> keep = d.keep[s]->Slots();
      EXPECT_LE(keep.size(), budget) << c.policy << " n=" << n;
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
  if (!c.refree_rule && c.budget < 600) {
    EXPECT_GT(bites, 20) << c.policy << ": the budget rarely bound";
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
        Case{"refreekv", {}, 600, 4, 0, true, 0, true}, Case{"refreekv_h2o", {}, 600, 4, 8, true},
        Case{"infokv", {}, 32, 0, 32, true, 0.4},
        Case{"infokv_adaptive", {}, 600, 0, 32, true, 0, false, 0.4}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(info.param.policy) + (info.param.compress ? "_compress" : "_step");
    });

}  // namespace
}  // namespace kvmem::policy
