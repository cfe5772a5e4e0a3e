// The device step (scores in the backend's SlotState, kernels/select.h) against the host
// policies: the same workload through an engine with device_step on and one with it off
// must give the same results, block tables and K/V at every step, across compressions,
// quantization, forks and eviction intervals.
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
  // The host path keeps none.
  std::unique_ptr<Engine> host = CpuEngine(&clock, false);
  const uint64_t h = host->CreateSequence(layout, "confkv", {}, {}, {})->sequence_id;
  ASSERT_TRUE(twins::Append(*host, h, 0, 100).ok());
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
