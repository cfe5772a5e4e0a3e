#pragma once
// A random script of SlotState operations checked against a plain model (per-stream
// vectors, the select.h formulas written out, selection by a full sort). The CPU test runs
// it on the host implementation, the GPU test on the CUDA one: both then agree bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/store/slot_state.h"
#include "tests/testing/select_oracle.h"

namespace kvmem::testing {

struct SlotModel {
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<int64_t>> positions;
};

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Keep-set of one stream by the select.h priority (nullopt: the stream fits its budget).
inline std::optional<KeepSet> ModelSelect(const std::vector<float>& scores,
                                          const std::vector<int64_t>& pos, uint32_t budget,
                                          uint32_t protect, float max_score, float weight) {
  const auto n = static_cast<uint32_t>(scores.size());
  if (n <= budget) return std::nullopt;
  const std::vector<uint8_t> flags =
      OracleTopFlags(scores.data(), pos.data(), n, budget, protect, max_score, weight);
  KeepSet keep;
  for (uint32_t j = 0; j < n; ++j) {
    if (flags[j]) keep.Add(j);
  }
  return keep;
}

inline void ModelKeep(SlotModel& m, const store::KeepSets& keep) {
  for (size_t s = 0; s < keep.size(); ++s) {
    if (!keep[s]) continue;
    std::vector<float> sc;
    std::vector<int64_t> po;
    for (uint32_t j : *keep[s]) {
      sc.push_back(m.scores[s][j]);
      po.push_back(m.positions[s][j]);
    }
    m.scores[s] = std::move(sc);
    m.positions[s] = std::move(po);
  }
}

inline void ExpectMatches(store::SlotState& state, const SlotModel& m, const std::string& at) {
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<int64_t>> positions;
  ASSERT_TRUE(state.ReadScores(&scores).ok()) << at;
  ASSERT_TRUE(state.ReadPositions(&positions).ok()) << at;
  for (size_t s = 0; s < m.scores.size(); ++s) {
    ASSERT_EQ(state.length(static_cast<uint32_t>(s)), m.positions[s].size()) << at << " s" << s;
    ASSERT_EQ(positions[s], m.positions[s]) << at << " stream " << s;
    ASSERT_TRUE(SameBits(scores[s], m.scores[s])) << at << " stream " << s;
  }
}

// `make` builds an empty state of the given stream count. Scores follow one rule per run
// (EMA from NaN, or accumulation from 0), as a policy's do.
template <typename Make>
void RunSlotStateScript(const Make& make, uint32_t seed, int rounds) {
  std::mt19937 rng(seed);
  const uint32_t S = 1 + rng() % 9;
  std::unique_ptr<store::SlotState> state = make(S);
  ASSERT_NE(state, nullptr);
  SlotModel m{std::vector<std::vector<float>>(S), std::vector<std::vector<int64_t>>(S)};
  const bool ema = seed % 2 == 0;
  const float initial = ema ? std::nanf("") : 0.0f;
  const float lambda = 0.9f;
  int64_t next_position = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::string at = "seed " + std::to_string(seed) + " round " + std::to_string(round);
    const uint32_t op = rng() % 10;
    if (op < 3) {  // append, sometimes undone
      const uint32_t n = 1 + rng() % (round % 7 == 0 ? 90 : 6);
      std::vector<int64_t> pos;
      for (uint32_t i = 0; i < n; ++i) pos.push_back(next_position += 1 + rng() % 3);
      ASSERT_TRUE(state->Append(pos, initial).ok()) << at;
      if (rng() % 8 == 0) {
        state->DropNewest(n);
      } else {
        for (uint32_t s = 0; s < S; ++s) {
          m.positions[s].insert(m.positions[s].end(), pos.begin(), pos.end());
          m.scores[s].insert(m.scores[s].end(), n, initial);
        }
      }
    } else if (op < 8) {  // a step, committed or dropped
      kernels::ScoreStep step;
      step.rule = ema ? kernels::ScoreRule::kEma : kernels::ScoreRule::kAccumulate;
      step.lambda = lambda;
      step.normalize = ema || rng() % 2 == 0;
      step.attention_weight = step.normalize ? 0.65f : 1.0f;
      step.select = rng() % 5 != 0;
      std::vector<std::vector<float>> rows(S);
      std::vector<uint32_t> budget(S);
      const uint32_t protect = rng() % 6;
      store::KeepSets want(S);
      for (uint32_t s = 0; s < S; ++s) {
        const uint32_t n = static_cast<uint32_t>(m.positions[s].size());
        for (uint32_t j = 0; j < n; ++j) rows[s].push_back(static_cast<float>(rng() % 8) / 8);
        // Half the streams one over the budget (the decode steady state).
        budget[s] = rng() % 2 == 0 && n > 1 ? n - 1 : 1 + rng() % 80;
        float mx = 0;
        for (uint32_t j = 0; j < n; ++j) {
          float& e = m.scores[s][j];
          const float a = rows[s][j];
          if (!ema) {
            e = e + a;
          } else if (std::isnan(e)) {
            e = a;
          } else {
            const float decayed = lambda * e;
            const float fresh = (1.0f - lambda) * a;
            e = decayed + fresh;
          }
          mx = std::max(mx, e);
        }
        if (step.select) {
          want[s] = ModelSelect(m.scores[s], m.positions[s], budget[s], protect,
                                step.normalize ? mx : 1.0f, step.attention_weight);
        }
      }
      std::vector<absl::Span<const float>> spans(rows.begin(), rows.end());
      store::KeepSets got;
      ASSERT_TRUE(state->Step(step, spans, budget, protect, &got).ok()) << at;
      ASSERT_EQ(got, want) << at;
      if (rng() % 5 != 0) {
        ASSERT_TRUE(state->CommitStep().ok()) << at;
        ModelKeep(m, want);
      }
    } else if (op == 8) {  // keep-sets decided on the host
      store::KeepSets keep(S);
      for (uint32_t s = 0; s < S; ++s) {
        if (rng() % 3 == 0) continue;
        KeepSet& k = keep[s].emplace();
        for (uint32_t j = 0; j < m.positions[s].size(); ++j) {
          if (rng() % 3 != 0) k.Add(j);
        }
      }
      ASSERT_TRUE(state->Keep(keep).ok()) << at;
      ModelKeep(m, keep);
    } else {  // scores over to the host and back, or a clone that takes over
      if (rng() % 2 == 0) {
        for (auto& sc : m.scores) {
          for (float& x : sc) x = static_cast<float>(rng() % 16) / 16;
        }
        ASSERT_TRUE(state->WriteScores(m.scores).ok()) << at;
      } else {
        absl::StatusOr<std::unique_ptr<store::SlotState>> copy = state->Clone();
        ASSERT_TRUE(copy.ok()) << at << ": " << copy.status();
        // The clone must not see what then happens to the original.
        store::KeepSets drop(S);
        for (uint32_t s = 0; s < S; ++s) drop[s].emplace();
        ASSERT_TRUE(state->Keep(drop).ok());
        for (uint32_t s = 0; s < S; ++s) ASSERT_EQ(state->length(s), 0u) << at;
        state = std::move(*copy);
      }
    }
    ExpectMatches(*state, m, at);
  }
  // Bad keep-sets are an error that changes nothing.
  store::KeepSets bad(S);
  bad[0] = KeepSet::Range(1u << 30, (1u << 30) + 1);
  EXPECT_FALSE(state->Keep(bad).ok());
  ExpectMatches(*state, m, "after a bad keep-set");
}

}  // namespace kvmem::testing
