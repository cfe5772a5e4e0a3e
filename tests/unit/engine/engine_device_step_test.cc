// The device step (scores in the backend's SlotState, kernels/select.h) against the host
// policies: the same workload through an engine with device_step on and one with it off
// must give the same results, block tables and K/V at every step, across compressions,
// quantization, forks and eviction intervals.
#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "server/store/cpu_backend.h"
#include "tests/testing/engine_twins.h"

namespace kvmem::engine {
namespace {

using twins::Case;

std::unique_ptr<Engine> CpuEngine(FakeClock* clock, bool device_step) {
  EngineConfig config;
  config.pool_bytes = 8 << 20;
  config.page_bytes = 4096;
  config.device_step = device_step;
  return *Engine::Create(config, *store::CpuBackend::Create(config.pool_bytes), clock);
}

class DeviceStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceStepTest, MatchesTheHostPolicyAtEveryStep) {
  FakeClock clock;
  std::unique_ptr<Engine> device = CpuEngine(&clock, true), host = CpuEngine(&clock, false);
  twins::RunTwinWorkload(*device, *host, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Policies, DeviceStepTest, ::testing::ValuesIn(twins::Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.policy) + "_" + std::to_string(info.index);
                         });

// confkv as ALGORITHMS.md words it, in double precision, written without the kernels:
// per stream an EMA per slot (a new slot starts at its first weight), priority
// r = 0.65 e / max e + 0.35 (pos - pos_min) / (pos_max - pos_min), the last P protected,
// the lowest r evicted until n = C_t. Both engines (device step on and off) must keep what
// it keeps, up to exact ties (priorities within 1e-5: float against double).
struct ConfKvOracle {
  struct Slot {
    int64_t position;
    double ema;
    bool scored;
  };
  std::vector<std::vector<Slot>> streams;
  uint32_t c_high, c_low, protect;
  double theta = 0.7, lambda = 0.9, weight = 0.65;

  uint32_t Budget(const RawLogitStats& ls, uint32_t vocab) const {
    const double c = 0.4 * (1 - ls.entropy / std::log(static_cast<double>(vocab))) +
                     0.3 * (1 - ls.p2 / ls.p1) + 0.3 * ls.p1;
    return c > theta ? c_high : c_low;
  }

  // One step of stream s; returns the positions kept and, per position, its priority.
  std::vector<int64_t> Step(size_t s, const std::vector<float>& row, uint32_t budget,
                            std::vector<std::pair<double, int64_t>>* ranked) {
    std::vector<Slot>& st = streams[s];
    double max_e = 0;
    for (size_t j = 0; j < st.size(); ++j) {
      st[j].ema = st[j].scored ? lambda * st[j].ema + (1 - lambda) * row[j] : row[j];
      st[j].scored = true;
      max_e = std::max(max_e, st[j].ema);
    }
    std::vector<int64_t> kept;
    for (const Slot& slot : st) kept.push_back(slot.position);
    if (st.size() <= budget) return kept;
    const double span = static_cast<double>(st.back().position - st.front().position);
    const size_t unprotected = st.size() - std::min<size_t>(protect, budget);
    ranked->clear();
    for (size_t j = 0; j < unprotected; ++j) {
      const double e = max_e > 0 ? st[j].ema / max_e : 0;
      const double rho = span > 0 ? (st[j].position - st.front().position) / span : 1;
      ranked->push_back({weight * e + (1 - weight) * rho, st[j].position});
    }
    std::sort(ranked->begin(), ranked->end());
    std::vector<int64_t> evict;
    for (size_t i = 0; i < st.size() - budget; ++i) evict.push_back((*ranked)[i].second);
    kept.clear();
    for (const Slot& slot : st) {
      if (std::find(evict.begin(), evict.end(), slot.position) == evict.end()) {
        kept.push_back(slot.position);
      }
    }
    return kept;
  }
  // Takes the engine's choice where the two differ only by a tie.
  void Keep(size_t s, const std::vector<int64_t>& positions) {
    std::vector<Slot> next;
    for (const Slot& slot : streams[s]) {
      if (std::binary_search(positions.begin(), positions.end(), slot.position)) {
        next.push_back(slot);
      }
    }
    streams[s] = std::move(next);
  }
};

class ConfKvSpecTest : public ::testing::TestWithParam<bool> {};

TEST_P(ConfKvSpecTest, KeepsWhatTheSpecificationKeeps) {
  FakeClock clock;
  std::unique_ptr<Engine> engine = CpuEngine(&clock, GetParam());
  const Layout layout{twins::kL, twins::kH, twins::kD, DType::kF16, twins::kB, twins::kVocab};
  const uint64_t id = engine
                          ->CreateSequence(layout, "confkv",
                                           {{"c_high", 40}, {"c_low", 72}, {"protect", 8}}, {}, {})
                          ->sequence_id;
  ConfKvOracle oracle;
  oracle.c_high = 40;
  oracle.c_low = 72;
  oracle.protect = 8;
  oracle.streams.resize(twins::kL * twins::kH);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  int evictions = 0, ties = 0;
  for (int64_t t = 0; t < 260; ++t) {
    ASSERT_TRUE(twins::Append(*engine, id, t, 1).ok());
    for (auto& st : oracle.streams) st.push_back({t, 0.0, false});
    const BlockTable table = *engine->GetBlockTable(id);
    const std::vector<std::vector<float>> rows = twins::Rows(table, rng);
    StepInput in;
    in.epoch = table.epoch;
    const float p1 = 0.3f + 0.7f * unit(rng);
    in.logits = RawLogitStats{3.0f * unit(rng), p1, p1 * unit(rng) * 0.5f, {}};
    in.attention = twins::Signals(rows);
    ASSERT_TRUE(engine->Step(id, in).ok());
    const uint32_t budget = oracle.Budget(*in.logits, twins::kVocab);
    const BlockTable after = *engine->GetBlockTable(id);
    for (size_t s = 0; s < after.streams.size(); ++s) {
      std::vector<std::pair<double, int64_t>> ranked;
      const std::vector<int64_t> want = oracle.Step(s, rows[s], budget, &ranked);
      const std::vector<int64_t>& got = after.streams[s].positions;
      if (want.size() < table.streams[s].positions.size()) ++evictions;
      ASSERT_EQ(got.size(), want.size()) << "step " << t << " stream " << s;
      if (got != want) {
        // Allowed only where the oracle ranks the slots it kept and the engine's within 1e-5.
        const size_t cut = table.streams[s].positions.size() - budget;
        ASSERT_LT(cut, ranked.size());
        ASSERT_NEAR(ranked[cut - 1].first, ranked[cut].first, 1e-5)
            << "step " << t << " stream " << s << ": the engine kept other slots than the rule";
        // And every slot on which the two differ is one of the tied ones at the cut.
        const double tie = ranked[cut].first;
        for (const auto& [priority, position] : ranked) {
          const bool in_got = std::binary_search(got.begin(), got.end(), position);
          const bool in_want = std::binary_search(want.begin(), want.end(), position);
          if (in_got != in_want) {
            EXPECT_NEAR(priority, tie, 1e-5) << "step " << t << " stream " << s << ": position "
                                             << position << " is not tied at the cut";
          }
        }
        ++ties;
      }
      oracle.Keep(s, got);
    }
  }
  EXPECT_GT(evictions, 1000);
  EXPECT_LT(ties, 5);
}

INSTANTIATE_TEST_SUITE_P(DeviceStepOnAndOff, ConfKvSpecTest, ::testing::Bool());

TEST(DeviceStepTest, SlotStateMemoryIsCountedAndGivenBack) {
  FakeClock clock;
  std::unique_ptr<Engine> engine = CpuEngine(&clock, true);
  const Layout layout{twins::kL, twins::kH, twins::kD, DType::kF16, twins::kB, twins::kVocab};
  const uint64_t a = engine->CreateSequence(layout, "confkv", {}, {}, {})->sequence_id;
  const uint64_t w = engine->CreateSequence(layout, "window", {}, {}, {})->sequence_id;
  ASSERT_TRUE(twins::Append(*engine, a, 0, 100).ok());
  ASSERT_TRUE(twins::Append(*engine, w, 0, 100).ok());
  EngineStats stats = engine->Stats(true);
  // 8 streams x capacity 128 x (score 4 + saved score 4 + position 8 + flag 1) bytes.
  EXPECT_EQ(stats.slot_state_bytes, 8u * 128 * 17);
  EXPECT_EQ(stats.sequences[0].slot_state_bytes, stats.slot_state_bytes);
  EXPECT_EQ(stats.sequences[1].slot_state_bytes, 0u);  // window: no scores to keep
  // A compression to 20 tokens per stream gives capacity back: 512 -> 64 slots per stream.
  ASSERT_TRUE(twins::Append(*engine, a, 100, 400).ok());  // capacity 512
  CompressInput shrink;
  shrink.target_tokens = 20;
  ASSERT_TRUE(engine->Compress(a, shrink).ok());
  EXPECT_EQ(engine->Stats(false).slot_state_bytes, 8u * 64 * 17);
  ASSERT_TRUE(twins::Append(*engine, a, 500, 100).ok());  // 120 per stream: 128 again
  stats = engine->Stats(true);
  const uint64_t child = engine->Fork(a, {})->sequence_id;
  EXPECT_EQ(engine->Stats(false).slot_state_bytes, 2 * stats.slot_state_bytes);
  ASSERT_TRUE(engine->Release(a).ok());
  ASSERT_TRUE(engine->Release(child).ok());
  EXPECT_EQ(engine->Stats(false).slot_state_bytes, 0u);
  // The host path keeps its scores in a host score state (their one home: f32 per slot).
  std::unique_ptr<Engine> host = CpuEngine(&clock, false);
  const uint64_t h = host->CreateSequence(layout, "confkv", {}, {}, {})->sequence_id;
  ASSERT_TRUE(twins::Append(*host, h, 0, 100).ok());
  EXPECT_EQ(host->Stats(false).slot_state_bytes, 8u * 200 * 4);  // room for twice the append
  ASSERT_TRUE(host->Release(h).ok());
  EXPECT_EQ(host->Stats(false).slot_state_bytes, 0u);
}

TEST(DeviceStepTest, OnlyPoliciesWithAKernelStepKeepSlotState) {
  for (const char* name : {"confkv", "confkv_l", "h2o"}) {
    auto p = *policy::CreatePolicy(name, {});
    EXPECT_TRUE(p->has_kernel_step()) << name;
  }
  for (const char* name : {"full", "window", "streaming_llm", "snapkv", "refreekv", "infokv"}) {
    auto p = *policy::CreatePolicy(name, {});
    EXPECT_FALSE(p->has_kernel_step()) << name;
  }
  // The random ablation has no priority to select by.
  EXPECT_FALSE((*policy::CreatePolicy("confkv", {{"random", 1}}))->has_kernel_step());
}

}  // namespace
}  // namespace kvmem::engine
