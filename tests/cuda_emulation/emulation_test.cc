// Only under the emulated runtime: every device and pinned allocation the CUDA backend makes
// (pool, staging, op lists, slot states, their scratch pool, its memory pool) is given back
// when the engine and the backend go, including after forks, compressions and growth; the
// emulation's streams are asynchronous and its memory pools free in stream order, so the
// backend's tests see a missing wait or a use after free; every allocation that fails is
// RESOURCE_EXHAUSTED.
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
#include "kvmem/v1/attach.h"
#include "server/engine/engine.h"
#include "server/store/cuda_backend.h"
#include "server/store/slot_state.h"
#include "server/transport/attach_socket.h"
#include "server/transport/shared_segment.h"
#include "tests/testing/engine_twins.h"

namespace kvmem::engine {
namespace {

TEST(CudaEmulationTest, EveryAllocationIsGivenBack) {
  const size_t before = cuda_emulation::LiveAllocations();
  const size_t pools = cuda_emulation::LivePools();
  const size_t pool_bytes = cuda_emulation::PoolReservedBytes();
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
    EXPECT_EQ(cuda_emulation::LivePools(), pools + 1);
    ASSERT_TRUE(engine->Release(a).ok());
    // b is left for the engine's destructor to release.
  }
  EXPECT_EQ(cuda_emulation::LiveAllocations(), before);
  EXPECT_EQ(cuda_emulation::LivePools(), pools);
  EXPECT_EQ(cuda_emulation::PoolReservedBytes(), pool_bytes);
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

cudaMemPool_t MakeDevicePool(int device, size_t max_bytes = 0) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location = {cudaMemLocationTypeDevice, device};
  props.maxSize = max_bytes;
  cudaMemPool_t pool = nullptr;
  EXPECT_EQ(cudaMemPoolCreate(&pool, &props), cudaSuccess);
  return pool;
}
uint64_t PoolAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  uint64_t value = ~uint64_t{0};
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, attr, &value), cudaSuccess);
  return value;
}

// A block from a memory pool serves the work queued before its cudaFreeAsync, not the work
// queued after: the free takes effect when the stream gets to it, and work that touches the
// block later does not run; its stream reports cudaErrorIllegalAddress at the next wait (a
// GPU under compute-sanitizer reports the use after free). Without this the backend's tests
// could not see a scratch buffer freed before its last use (tried: releasing CudaBackend::
// Read's staging before the download fails the backend's parity tests and every engine
// case) nor a free that is never reached (ScratchIsBackInThePoolWhenACallReturns).
TEST(CudaEmulationTest, PoolBlocksAreFreedInStreamOrder) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const cudaMemPool_t pool = MakeDevicePool(0);
  const size_t live = cuda_emulation::LiveAllocations();
  uint8_t* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 256), cudaSuccess);
  std::vector<uint8_t> pageable(256, 7);
  uint8_t* block = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&block, 256, pool, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(block, pageable.data(), 256, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, block, 256, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(block, stream), cudaSuccess);  // behind the copies that use it
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrUsedMemCurrent), 256u);  // not reached yet
  EXPECT_EQ(cuda_emulation::LiveAllocations(), live + 2);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(pinned[0], 7);
  EXPECT_EQ(pinned[255], 7);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrUsedMemCurrent), 0u);
  // The release threshold is 0 by default: the synchronization handed the block back.
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 0u);
  EXPECT_EQ(cuda_emulation::LiveAllocations(), live + 1);

  // A copy queued after the free reads a block that is gone: it does not run.
  ASSERT_EQ(cudaMallocFromPoolAsync(&block, 256, pool, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(block, pageable.data(), 256, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(block, stream), cudaSuccess);
  std::memset(pinned, 1, 256);
  ASSERT_EQ(cudaMemcpyAsync(pinned, block, 256, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(pinned[0], 1);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // reported once

  // Freed twice, by cudaFree (which does not wait for the stream's users), or memory the
  // pool did not make: errors.
  ASSERT_EQ(cudaMallocFromPoolAsync(&block, 64, pool, stream), cudaSuccess);
  EXPECT_EQ(cudaFree(block), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFreeAsync(block, stream), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(block, stream), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFreeAsync(pinned, stream), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(block, stream), cudaErrorInvalidValue);  // gone already
  (void)cudaGetLastError();
  EXPECT_EQ(cuda_emulation::LiveAllocations(), live + 1);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaMemPoolDestroy(pool), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// A pool keeps freed blocks for reuse up to its release threshold across synchronizations,
// hands back the rest then (and on cudaMemPoolTrimTo), fails as out of memory past its
// maxSize, and a destroyed pool lasts until its last block is freed.
TEST(CudaEmulationTest, PoolsKeepUpToTheirReleaseThreshold) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const size_t pools = cuda_emulation::LivePools();
  const cudaMemPool_t pool = MakeDevicePool(1);
  uint64_t threshold = 4096;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaSuccess);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReleaseThreshold), 4096u);
  void* first = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&first, 4096, pool, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(first, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 4096u);  // kept
  void* again = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&again, 1000, pool, stream), cudaSuccess);
  EXPECT_EQ(again, first);  // reused
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 4096u);
  void* large = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&large, 8192, pool, stream), cudaSuccess);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 12288u);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrUsedMemCurrent), 12288u);
  ASSERT_EQ(cudaFreeAsync(again, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(large, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 4096u);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrUsedMemHigh), 12288u);
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  EXPECT_EQ(PoolAttribute(pool, cudaMemPoolAttrReservedMemCurrent), 0u);

  // Destroyed with a block outstanding: the pool goes when the block's free is reached.
  void* outstanding = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&outstanding, 64, pool, stream), cudaSuccess);
  ASSERT_EQ(cudaMemPoolDestroy(pool), cudaSuccess);
  EXPECT_EQ(cuda_emulation::LivePools(), pools + 1);
  ASSERT_EQ(cudaFreeAsync(outstanding, stream), cudaSuccess);
  EXPECT_EQ(cuda_emulation::LivePools(), pools + 1);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cuda_emulation::LivePools(), pools);

  // Out of memory: past maxSize, past the device, and where a test asks for it.
  const cudaMemPool_t small = MakeDevicePool(0, 1 << 20);
  void* p = nullptr;
  EXPECT_EQ(cudaMallocFromPoolAsync(&p, 2 << 20, small, stream), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaMallocFromPoolAsync(&p, cuda_emulation::kDeviceBytes + 1, small, stream),
            cudaErrorMemoryAllocation);
  cuda_emulation::FailAllocationAt(2);
  ASSERT_EQ(cudaMallocFromPoolAsync(&p, 64, small, stream), cudaSuccess);
  void* q = nullptr;
  EXPECT_EQ(cudaMallocFromPoolAsync(&q, 64, small, stream), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaMallocFromPoolAsync(&q, 64, small, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(p, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(q, stream), cudaSuccess);
  EXPECT_EQ(cudaMemPoolDestroy(small), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);  // its queued frees still run
  EXPECT_EQ(cuda_emulation::LivePools(), pools);
}

// The backend's pool keeps its high-water mark across calls (its release threshold is the
// whole pool): a Move, Write or Quantize inside a write section reuses scratch an earlier call
// took instead of asking the driver, which could fail and poison the sequence.
TEST(CudaEmulationTest, TheBackendKeepsItsScratchAcrossCalls) {
  constexpr uint64_t kPool = 160 << 20;
  auto backend = *store::CudaBackend::Create(kPool);
  const size_t reserved = cuda_emulation::PoolReservedBytes();
  std::vector<uint8_t> data(72 << 20, 3);  // a prefill's worth, past any small threshold
  store::WriteOp w{data.data(), 0, data.size()};
  ASSERT_TRUE(backend->Write({&w, 1}).ok());
  const size_t kept = cuda_emulation::PoolReservedBytes();
  EXPECT_GT(kept, reserved) << "the call's scratch went back to the driver";
  ASSERT_TRUE(backend->Write({&w, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolReservedBytes(), kept) << "a second Write took more";
  store::MoveOp m{0, kPool / 2, data.size()};
  ASSERT_TRUE(backend->Move({&m, 1}).ok());
  const size_t kept_after_move = cuda_emulation::PoolReservedBytes();
  ASSERT_TRUE(backend->Move({&m, 1}).ok());
  ASSERT_TRUE(backend->Write({&w, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolReservedBytes(), kept_after_move) << "repeated calls took more";
}

// Every call of the backend frees its device scratch behind its work, before its final wait:
// when it returns, the memory is back in the pool for the next call (with the free left to
// the scratch's destructor, after the wait, it would stay in use until the next call's wait).
TEST(CudaEmulationTest, ScratchIsBackInThePoolWhenACallReturns) {
  constexpr uint64_t kPool = 1 << 20;
  auto backend = *store::CudaBackend::Create(kPool);
  const size_t used = cuda_emulation::PoolUsedBytes();
  std::vector<uint8_t> data(64 << 10, 3), back(data.size());
  store::WriteOp w{data.data(), 0, data.size()};
  ASSERT_TRUE(backend->Write({&w, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  store::MoveOp m{0, kPool / 2, data.size()};
  ASSERT_TRUE(backend->Move({&m, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  store::ReadOp r{kPool / 2, back.data(), back.size()};
  ASSERT_TRUE(backend->Read({&r, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  EXPECT_EQ(back, data);
  const kernels::QuantGeometry g{kernels::QuantType::kInt8, 16, 128};
  store::QuantizeOp q{0, 16 << 10, 0, 16};
  ASSERT_TRUE(backend->Quantize(kernels::ElemType::kF16, g, {&q, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  std::vector<uint8_t> k(16 * 256), v(16 * 256);
  store::DequantizeOp d{16 << 10, 0, 16, k.data(), v.data()};
  ASSERT_TRUE(backend->Dequantize(g, kernels::ElemType::kF16, {&d, 1}).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  // A slot state's calls too (a selecting Step compacts into the other bank in its own round
  // trip: its commit takes nothing).
  auto state = *backend->CreateSlotState(4);
  std::vector<int64_t> positions(100);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(i);
  ASSERT_TRUE(state->Append(positions, 0.5f).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  std::vector<float> row(100, 0.25f);
  const std::vector<absl::Span<const float>> rows(4, row);
  const std::vector<uint32_t> budget(4, 60);
  store::KeepSets keep;
  ASSERT_TRUE(state->Step(kernels::ScoreStep{}, rows, budget, 8, &keep).ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  ASSERT_TRUE(state->CommitStep().ok());
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
  EXPECT_EQ(state->length(3), 60u);
  // A state that goes between ReserveCommit and EndCommit gives its reservation back too
  // (freed on its stream before the stream goes).
  ASSERT_TRUE(state->ReserveCommit().ok());
  EXPECT_GT(cuda_emulation::PoolUsedBytes(), used);
  state.reset();
  EXPECT_EQ(cuda_emulation::PoolUsedBytes(), used);
}

// The calls of a backend and a slot state, each status kept; a Step that fails is aborted,
// as the engine does. A Step or ReserveCommit that succeeded takes what its commit needs, so
// the CommitStep and the Keep after them must not fail. The Keep leaves a quarter of the
// slots, so it shrinks the state's capacity, which may fail without failing the Keep (the
// larger capacity holds the same slots, slot_state.h): kept_bytes tells.
struct CallsRun {
  std::vector<absl::Status> done;
  uint64_t kept_bytes = 0;  // the slot state's bytes after the Keep
};
CallsRun RunCalls(store::CudaBackend& backend, const std::vector<uint8_t>& data,
                  std::vector<uint8_t>* back) {
  CallsRun run;
  std::vector<absl::Status>& done = run.done;
  const uint64_t half = backend.pool_bytes() / 2;
  store::WriteOp w{data.data(), 0, data.size()};
  done.push_back(backend.Write({&w, 1}));
  store::MoveOp m{0, half, data.size()};
  done.push_back(backend.Move({&m, 1}));
  const kernels::QuantGeometry g{kernels::QuantType::kInt8, 16, 128};
  store::QuantizeOp q{0, half - (16 << 10), 0, 16};
  done.push_back(backend.Quantize(kernels::ElemType::kF16, g, {&q, 1}));
  std::vector<uint8_t> k(16 * 256), v(16 * 256);
  store::DequantizeOp d{half - (16 << 10), 0, 16, k.data(), v.data()};
  done.push_back(backend.Dequantize(g, kernels::ElemType::kF16, {&d, 1}));
  store::ReadOp r{half, back->data(), back->size()};
  done.push_back(backend.Read({&r, 1}));

  absl::StatusOr<std::unique_ptr<store::SlotState>> created = backend.CreateSlotState(8);
  done.push_back(created.status());
  if (!created.ok()) return run;
  store::SlotState& state = **created;
  std::vector<int64_t> positions(200);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(i);
  done.push_back(state.Append(positions, 0.5f));
  const uint32_t n = state.length(0);
  std::vector<float> row(n, 0.25f);
  const std::vector<absl::Span<const float>> rows(8, row);
  const std::vector<uint32_t> budget(8, n / 2);
  store::KeepSets keep;
  const absl::Status stepped = state.Step(kernels::ScoreStep{}, rows, budget, 4, &keep);
  done.push_back(stepped);
  if (stepped.ok()) {
    EXPECT_TRUE(state.CommitStep().ok());
  } else {
    EXPECT_TRUE(state.AbortStep().ok());
  }
  const absl::Status reserved = state.ReserveCommit();
  done.push_back(reserved);
  if (reserved.ok()) {
    EXPECT_TRUE(state.Keep(store::KeepSets(8, KeepSet::Range(0, state.length(0) / 4))).ok());
  }
  state.EndCommit();
  run.kept_bytes = state.bytes();
  std::vector<std::vector<float>> scores;
  done.push_back(state.ReadScores(&scores));
  if (done.back().ok()) done.push_back(state.WriteScores(scores));
  std::vector<std::vector<int64_t>> read_positions;
  done.push_back(state.ReadPositions(&read_positions));
  done.push_back(state.Clone().status());
  return run;
}

// The emulation fails the k-th allocation from the backend's creation on, for every k its
// calls reach (the pool, pinned staging, scratch from the memory pool, slot state arrays):
// each failure is RESOURCE_EXHAUSTED, never another code or an abort, and with the
// injection off the same calls on the same backend all succeed.
TEST(CudaEmulationTest, EveryFailedAllocationIsResourceExhausted) {
  std::vector<uint8_t> data(96 << 10), back(data.size());
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 13 + 1);
  size_t k = 1;
  for (;; ++k) {
    SCOPED_TRACE(absl::StrCat("allocation ", k));
    const size_t injected = cuda_emulation::InjectedFailures();
    cuda_emulation::FailAllocationAt(k);
    absl::StatusOr<std::unique_ptr<store::CudaBackend>> backend =
        store::CudaBackend::Create(1 << 20);
    if (!backend.ok()) {
      EXPECT_EQ(backend.status().code(), absl::StatusCode::kResourceExhausted) << backend.status();
      continue;
    }
    const CallsRun run = RunCalls(**backend, data, &back);
    size_t failed = 0;
    for (const absl::Status& s : run.done) {
      if (s.ok()) continue;
      ++failed;
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    }
    const bool reached = cuda_emulation::InjectedFailures() > injected;
    cuda_emulation::FailAllocationAt(0);
    if (!reached) break;  // past the last allocation the calls make
    std::fill(back.begin(), back.end(), 0);
    const CallsRun clean = RunCalls(**backend, data, &back);
    for (const absl::Status& s : clean.done) EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(back, data);
    // The one failure is a call's, or else the Keep's shrink's, which kept the capacity.
    EXPECT_LE(failed, 1u);
    if (failed == 0) {
      EXPECT_GT(run.kept_bytes, clean.kept_bytes);
    }
  }
  EXPECT_GT(k, 12u);  // the sweep went through the calls' allocations
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
  for (const Expected& want : {Expected{true, 4, 7, 8, 14}, Expected{false, 2, 3, 3, 9}}) {
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
  std::shared_ptr<transport::SharedSegment> board =
      *transport::SharedSegment::Create("board", 4096);
  std::unique_ptr<transport::AttachSocket> attach = *transport::AttachSocket::Start({});
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 1), cudaSuccess);
  client::Info info;
  info.backend = "cuda";
  info.attach = {attach->address(), attach->Issue({{v1::attach::kEpochBoard, board, false}}, "")};
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
}

}  // namespace
}  // namespace kvmem::engine
