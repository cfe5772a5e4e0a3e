// Only under the emulated runtime: every device and pinned allocation the CUDA backend makes
// (pool, staging, op lists, slot states, their scratch pool) is given back when the engine
// and the backend go, including after forks, compressions and growth; and the emulation's
// streams are asynchronous, so the backend's tests see a missing wait.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda_runtime_api.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmem/cuda_pool.h"
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

// A copy into pinned memory lands when its stream is waited for, not before; a copy from
// pageable memory takes the bytes when called (the real runtime's rules). Without this the
// backend's tests could not see a result read before its stream is synchronized (tried:
// dropping CudaBackend::Read's wait, or the slot state's wait after a step, fails the
// backend's or the slot state's test and all 7 engine cases).
TEST(CudaEmulationTest, StreamsRunTheirWorkWhenWaitedFor) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  uint8_t* device = nullptr;
  uint8_t* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, 64), cudaSuccess);
  std::vector<uint8_t> pageable(64, 7);
  ASSERT_EQ(cudaMemcpyAsync(device, pageable.data(), 64, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  pageable.assign(64, 9);  // too late to change what was sent
  std::memset(pinned, 1, 64);
  ASSERT_EQ(cudaMemcpyAsync(pinned, device, 64, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  EXPECT_EQ(pinned[0], 1);  // queued, not done
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(pinned[0], 7);
  EXPECT_EQ(pinned[63], 7);
  // Into pageable memory the call returns once the copy (and the stream's work before it)
  // is done.
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, 1, cudaMemcpyHostToDevice, stream), cudaSuccess);
  pinned[0] = 5;  // pinned: read when the stream gets there
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), device, 64, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  EXPECT_EQ(pageable[0], 5);
  EXPECT_EQ(pageable[1], 7);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// What one decode token (Append of one token, then Step) costs a GPU beyond its work, in
// the steady state of confkv: the host's waits for the device and the copies between them
// (kernel launches vary with the K/V moves' waves: two per wave). On the H200 run
// (bench/RESULTS.md) the device step took 224 us per step for SmolLM2's shape, which is
// these round trips, not GPU work. The counts are exact, so that a change to the decode
// path's round trips shows here (and its figures in RESULTS.md are updated with it).
TEST(CudaEmulationTest, ADecodeTokenWaitsForTheDeviceAFewTimes) {
  struct Expected {
    bool device_step;
    size_t waits, transfers, min_launches, max_launches;
  };
  for (const Expected& want : {Expected{true, 5, 8, 8, 14}, Expected{false, 2, 3, 3, 9}}) {
    SCOPED_TRACE(want.device_step ? "device step" : "host policy code");
    FakeClock clock;
    EngineConfig config;
    config.pool_bytes = 32 << 20;
    config.page_bytes = 4096;
    config.device_step = want.device_step;
    auto engine = *Engine::Create(config, *store::CudaBackend::Create(config.pool_bytes), &clock);
    const Layout layout{twins::kL, twins::kH, twins::kD, DType::kF16, twins::kB, twins::kVocab};
    const uint64_t id =
        engine
            ->CreateSequence(layout, "confkv", {{"c_high", 48}, {"c_low", 80}, {"protect", 8}}, {},
                             {})
            ->sequence_id;
    ASSERT_TRUE(twins::Append(*engine, id, 0, 100).ok());
    std::mt19937 rng(3);
    size_t launches = 0;
    for (int64_t t = 100; t < 140; ++t) {
      const cuda_emulation::Counts start = cuda_emulation::Count();
      ASSERT_TRUE(twins::Append(*engine, id, t, 1).ok());
      const BlockTable table = *engine->GetBlockTable(id);  // host data only
      const std::vector<std::vector<float>> rows = twins::Rows(table, rng);
      StepInput in;
      in.attention = twins::Signals(rows);
      in.logits = RawLogitStats{2.0f, 0.5f, 0.1f, {}};
      in.epoch = table.epoch;
      absl::StatusOr<StepResult> r = engine->Step(id, in);
      ASSERT_TRUE(r.ok()) << r.status();
      const cuda_emulation::Counts end = cuda_emulation::Count();
      if (t < 110) continue;  // past the first steps' growth
      EXPECT_EQ(end.waits - start.waits, want.waits) << "step " << t;
      EXPECT_EQ(end.transfers - start.transfers, want.transfers) << "step " << t;
      EXPECT_GE(end.launches - start.launches, want.min_launches) << "step " << t;
      EXPECT_LE(end.launches - start.launches, want.max_launches) << "step " << t;
      launches = std::max(launches, end.launches - start.launches);
      if (t == 139) {
        std::printf("%s: %zu waits, %zu transfers, up to %zu launches per decode token\n",
                    want.device_step ? "device step" : "host policy", end.waits - start.waits,
                    end.transfers - start.transfers, launches);
      }
    }
  }
}

// The client's same-GPU attach in a worker's process: when it fails, the runtime's error
// record is cleared too (the worker's next launch check would report it as its own); when
// it works, the pool's GPU is the current one.
TEST(CudaEmulationTest, AFailedAttachLeavesNoErrorRecord) {
  const std::string board = "/kvmem-emulated-board-" + std::to_string(getpid());
  const int fd = shm_open(board.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 1), cudaSuccess);
  client::Info info;
  info.backend = "cuda";
  info.epoch_board_name = board;
  info.epoch_stride = 64;
  info.epoch_slots = 64;
  for (char c : prop.uuid.bytes) {
    absl::StrAppend(&info.cuda_device_uuid,
                    absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
  }
  info.cuda_pool_bytes = 4096;
  info.cuda_ipc_handle.assign(sizeof(cudaIpcMemHandle_t), '\0');  // a handle of nothing
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto failed = client::CudaPool::Attach(info);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_THAT(failed.status().message(), ::testing::HasSubstr("open the pool's handle"));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  uint8_t* pool = nullptr;
  ASSERT_EQ(cudaMalloc(&pool, 4096), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, pool), cudaSuccess);
  info.cuda_ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
  auto attached = client::CudaPool::Attach(info);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ((*attached)->device(), 1);
  EXPECT_EQ((*attached)->device_base(), pool);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);
  attached->reset();
  EXPECT_EQ(cudaFree(pool), cudaSuccess);
  shm_unlink(board.c_str());
}

}  // namespace
}  // namespace kvmem::engine
