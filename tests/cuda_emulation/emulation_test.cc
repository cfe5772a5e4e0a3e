// Only under the emulated runtime: every device and pinned allocation the CUDA backend makes
// (pool, staging, op lists, slot states, their scratch pool) is given back when the engine
// and the backend go, including after forks, compressions and growth.
#include "cuda_runtime_api.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"
#include "server/store/cuda_backend.h"
#include "tests/testing/engine_twins.h"

namespace kvmem::engine {
namespace {

TEST(CudaEmulationTest, EveryAllocationIsGivenBack) {
  const size_t before = cuda_emulation::LiveAllocations();
  {
    FakeClock clock;
    EngineConfig config;
    config.pool_bytes = 8 << 20;
    config.page_bytes = 4096;
    auto engine = *Engine::Create(config, *store::CudaBackend::Create(config.pool_bytes), &clock);
    const Layout layout{twins::kL, twins::kH, twins::kD, DType::kF16, twins::kB, twins::kVocab};
    const uint64_t a = engine->CreateSequence(layout, "h2o", {{"budget", 32}}, {}, {})->sequence_id;
    ASSERT_TRUE(twins::Append(*engine, a, 0, 300).ok());  // grows the slot state twice over
    const uint64_t b = engine->Fork(a, {})->sequence_id;
    CompressInput shrink;
    shrink.target_tokens = 16;
    ASSERT_TRUE(engine->Compress(b, shrink).ok());
    EXPECT_GT(cuda_emulation::LiveAllocations(), before);
    ASSERT_TRUE(engine->Release(a).ok());
    // b is left for the engine's destructor to release.
  }
  EXPECT_EQ(cuda_emulation::LiveAllocations(), before);
}

}  // namespace
}  // namespace kvmem::engine
