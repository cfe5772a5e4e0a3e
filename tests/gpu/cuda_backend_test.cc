// CudaBackend against CpuBackend: the same batches of writes, moves (with the hazards the
// engine produces), quantization and reads leave byte-identical pools; the CUDA SlotState
// follows the same model as the host one; an engine on the CUDA backend (scores and the
// per-step selection on the device) decides exactly what the host policies decide. Skipped
// without a CUDA device. Creation errors: with no device, and with one, each test expecting
// the one exact code its case has (whether a device is there is asked of the runtime).
#include "server/store/cuda_backend.h"

#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmem/cuda_pool.h"
#include "kvmem/v1/attach.h"
#include "server/engine/engine.h"
#include "server/store/cpu_backend.h"
#include "server/store/cuda_internal.h"
#include "server/transport/attach_socket.h"
#include "tests/testing/engine_twins.h"
#include "tests/testing/slot_state_script.h"

namespace kvmem::store {
namespace {

// How many devices the CUDA runtime itself reports, asked directly rather than through the
// backend, so that the error tests below know which exact code to expect.
int VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

// Without a GPU every CudaBackend::Create is FAILED_PRECONDITION naming --backend=cuda (and
// suggesting --backend=cpu), whatever is asked of it. Never an abort.
TEST(CudaBackendTest, NoDeviceIsFailedPreconditionNamingTheFlag) {
  if (VisibleDevices() > 0) GTEST_SKIP() << "a CUDA device is visible";
  const std::pair<uint64_t, int> asks[] = {{1 << 20, 0}, {uint64_t{1} << 52, 0}, {1 << 20, 4096}};
  for (const auto& [pool_bytes, device] : asks) {
    auto created = CudaBackend::Create(pool_bytes, device);
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(created.status().code(), absl::StatusCode::kFailedPrecondition) << created.status();
    EXPECT_THAT(created.status().message(), ::testing::HasSubstr("--backend=cuda"));
    EXPECT_THAT(created.status().message(), ::testing::HasSubstr("--backend=cpu"));
  }
}

// With a device: a pool that cannot fit is RESOURCE_EXHAUSTED naming --pool-bytes, a device
// index outside those visible is INVALID_ARGUMENT naming --cuda-device. Never an abort.
TEST(CudaBackendTest, TooLargeOrAbsentDeviceIsAClearError) {
  const int devices = VisibleDevices();
  if (devices == 0) GTEST_SKIP() << "no CUDA device";
  auto huge = CudaBackend::Create(uint64_t{1} << 52);  // 4 PiB: no device has that
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(huge.status().message(), ::testing::HasSubstr("--pool-bytes"));
  for (int device : {devices, 4096, -1}) {
    auto absent = CudaBackend::Create(1 << 20, device);
    ASSERT_FALSE(absent.ok()) << device;
    EXPECT_EQ(absent.status().code(), absl::StatusCode::kInvalidArgument) << absent.status();
    EXPECT_THAT(absent.status().message(), ::testing::HasSubstr("--cuda-device"));
  }
  // The last device visible is accepted.
  auto last = CudaBackend::Create(1 << 20, devices - 1);
  EXPECT_TRUE(last.ok()) << last.status();
}

class CudaBackendParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device";
    auto cuda = CudaBackend::Create(kPool);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = *std::move(cuda);
    cpu_ = *CpuBackend::Create(kPool);
  }
  std::vector<uint8_t> ReadAll(Backend& b) {
    std::vector<uint8_t> out(kPool);
    ReadOp op{0, out.data(), kPool};
    EXPECT_TRUE(b.Read({&op, 1}).ok());
    return out;
  }
  static constexpr uint64_t kPool = 1 << 20;
  std::unique_ptr<CudaBackend> cuda_;
  std::unique_ptr<CpuBackend> cpu_;
};

TEST_F(CudaBackendParity, WritesMovesQuantizeAndReadsMatchTheCpuBackend) {
  std::mt19937 rng(9);
  std::vector<uint8_t> data(kPool);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  WriteOp w{data.data(), 0, kPool};
  ASSERT_TRUE(cpu_->Write({&w, 1}).ok());
  ASSERT_TRUE(cuda_->Write({&w, 1}).ok());
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<MoveOp> moves(1 + rng() % 40);
    for (MoveOp& m : moves) {
      m.bytes = rng() % 4096;
      m.src = rng() % (kPool - m.bytes);
      m.dst = rng() % (kPool - m.bytes);
    }
    ASSERT_TRUE(cpu_->Move(moves).ok());
    ASSERT_TRUE(cuda_->Move(moves).ok());
  }
  EXPECT_EQ(ReadAll(*cpu_), ReadAll(*cuda_));
  // f16 layout blocks at 0.., quantized into the second half.
  const kernels::QuantGeometry g{kernels::QuantType::kInt8, 16, 128};
  std::vector<QuantizeOp> q;
  for (uint32_t b = 0; b < 32; ++b) q.push_back({b * 8192ull, kPool / 2 + b * 8192ull, 0, 16});
  ASSERT_TRUE(cpu_->Quantize(kernels::ElemType::kF16, g, q).ok());
  ASSERT_TRUE(cuda_->Quantize(kernels::ElemType::kF16, g, q).ok());
  EXPECT_EQ(ReadAll(*cpu_), ReadAll(*cuda_));
  std::vector<uint8_t> k1(16 * 256), v1(16 * 256), k2(16 * 256), v2(16 * 256);
  DequantizeOp d1{kPool / 2, 0, 16, k1.data(), v1.data()},
      d2{kPool / 2, 0, 16, k2.data(), v2.data()};
  ASSERT_TRUE(cpu_->Dequantize(g, kernels::ElemType::kF16, {&d1, 1}).ok());
  ASSERT_TRUE(cuda_->Dequantize(g, kernels::ElemType::kF16, {&d2, 1}).ok());
  EXPECT_EQ(k1, k2);
  EXPECT_EQ(v1, v2);
  EXPECT_TRUE(cuda_->pool_export().has_value());
  MoveOp bad{kPool - 8, 0, 16};
  EXPECT_EQ(cuda_->Move({&bad, 1}).code(), absl::StatusCode::kInternal);
}

// The pool starts zeroed, and its clear is done before the first write: a clear queued on
// the legacy default stream is not ordered before the backend's own (non-blocking) stream,
// and could land on top of the first K/V when anything later waits for the whole device.
TEST_F(CudaBackendParity, ThePoolsClearIsDoneBeforeTheFirstWrite) {
  std::vector<uint8_t> data(8192), back(8192);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(1 + i % 251);
  WriteOp w{data.data(), 4096, data.size()};
  ASSERT_TRUE(cuda_->Write({&w, 1}).ok());
  void* other = nullptr;  // a free waits for the whole device
  ASSERT_EQ(cudaMalloc(&other, 256), cudaSuccess);
  ASSERT_EQ(cudaFree(other), cudaSuccess);
  ReadOp r{4096, back.data(), back.size()};
  ASSERT_TRUE(cuda_->Read({&r, 1}).ok());
  EXPECT_EQ(back, data);
  ReadOp zero{0, back.data(), 4096};
  ASSERT_TRUE(cuda_->Read({&zero, 1}).ok());
  EXPECT_EQ(std::vector<uint8_t>(back.begin(), back.begin() + 4096), std::vector<uint8_t>(4096, 0));
}

// A failed runtime call leaves a per-thread record that cudaGetLastError hands back, and a
// launch reports its errors through that call: a pool that did not fit must not fail the
// next good write of the thread (found on the first GPU run: the parity test's write after
// the too-large pool of the test before it).
TEST_F(CudaBackendParity, AFailedAllocationDoesNotFailTheNextLaunch) {
  auto huge = CudaBackend::Create(uint64_t{1} << 50);
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  std::vector<uint8_t> data(4096), back(4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  WriteOp w{data.data(), 512, data.size()};
  ASSERT_TRUE(cuda_->Write({&w, 1}).ok());
  MoveOp m{512, 8192, data.size()};
  ASSERT_TRUE(cuda_->Move({&m, 1}).ok());
  ReadOp r{8192, back.data(), back.size()};
  ASSERT_TRUE(cuda_->Read({&r, 1}).ok());
  EXPECT_EQ(back, data);
}

TEST(CudaSlotStateTest, FollowsTheModelThroughRandomScripts) {
  if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device";
  // One scratch pool for every state, as a backend shares it among its sequences.
  absl::StatusOr<std::shared_ptr<CudaMemoryPool>> memory = CudaMemoryPool::Create(0);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<std::shared_ptr<CudaScratchPool>> made = MakeCudaScratchPool(*memory);
  ASSERT_TRUE(made.ok()) << made.status();
  const std::shared_ptr<CudaScratchPool> scratch = *made;
  for (uint32_t seed = 0; seed < 40; ++seed) {
    testing::RunSlotStateScript(
        [&scratch](uint32_t streams) -> std::unique_ptr<SlotState> {
          absl::StatusOr<std::unique_ptr<SlotState>> s = MakeCudaSlotState(streams, 0, scratch);
          EXPECT_TRUE(s.ok()) << s.status();
          return s.ok() ? *std::move(s) : nullptr;
        },
        seed, 120);
    if (HasFatalFailure()) return;
  }
}

// A commit's reservation allocates on the slot state's own device whatever device the
// calling thread has current (kvmemd --cuda-device=1 on a gRPC thread that last worked for
// device 0): single-token appends keep the shared scratch small, so the reservation for
// 64 streams of 300 slots has to grow it, and the compaction's launch then reads it.
TEST(CudaSlotStateTest, ReservesItsCommitOnItsOwnDevice) {
  if (VisibleDevices() < 2) GTEST_SKIP() << "one CUDA device";
  absl::StatusOr<std::shared_ptr<CudaMemoryPool>> memory = CudaMemoryPool::Create(1);
  ASSERT_TRUE(memory.ok()) << memory.status();
  absl::StatusOr<std::shared_ptr<CudaScratchPool>> scratch = MakeCudaScratchPool(*memory);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  auto state = MakeCudaSlotState(64, 1, *scratch);
  ASSERT_TRUE(state.ok()) << state.status();
  for (int64_t p = 0; p < 300; ++p) ASSERT_TRUE((*state)->Append({&p, 1}, 0.5f).ok());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_TRUE((*state)->ReserveCommit().ok());
  KeepSets keep(64, KeepSet::Range(1, 300));
  absl::Status kept = (*state)->Keep(keep);
  (*state)->EndCommit();
  ASSERT_TRUE(kept.ok()) << kept;
  EXPECT_EQ((*state)->length(63), 299u);
}

class CudaEngineTest : public ::testing::TestWithParam<engine::twins::Case> {};

// An engine on a CudaBackend of `device` (the device step on) and its twin on the CPU
// backend (the host policy code), 8 MiB pools each.
struct TwinEngines {
  engine::FakeClock clock;
  std::unique_ptr<engine::Engine> gpu, host;
};
absl::StatusOr<std::unique_ptr<TwinEngines>> MakeTwinEngines(int device) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create(8 << 20, device);
  if (!cuda.ok()) return cuda.status();
  auto twins = std::make_unique<TwinEngines>();
  engine::EngineConfig config;
  config.pool_bytes = 8 << 20;
  config.page_bytes = 4096;
  twins->gpu = *engine::Engine::Create(config, *std::move(cuda), &twins->clock);
  config.device_step = false;
  twins->host = *engine::Engine::Create(config, *CpuBackend::Create(8 << 20), &twins->clock);
  return twins;
}

TEST_P(CudaEngineTest, DeviceStepMatchesTheHostPolicies) {
  if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device";
  auto twins = MakeTwinEngines(0);
  ASSERT_TRUE(twins.ok()) << twins.status();
  engine::twins::RunTwinWorkload(*(*twins)->gpu, *(*twins)->host, GetParam());
}

// In place on the GPU (kvmemd --in_place_writes over the CUDA backend): a worker copies each
// step's K/V from its own device buffers into the pool through the IPC mapping
// (CudaPool::WritePlanned) and commits them by plan id in the entry that steps; the device
// step decides exactly what the CPU engine decides for the same tokens sent as bytes, and
// the K/V read back is what was written.
TEST(CudaInPlaceTest, KvWrittenThroughTheIpcMappingDecodesAsBytes) {
  if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device";
  using namespace engine::twins;  // NOLINT: the twins' workload vocabulary
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create(8 << 20, 0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const auto exported = std::get<CudaIpcExport>(*(*cuda)->pool_export());
  engine::FakeClock clock;
  engine::EngineConfig config;
  config.pool_bytes = 8 << 20;
  config.page_bytes = 4096;
  config.in_place_writes = true;
  std::unique_ptr<engine::Engine> gpu = *engine::Engine::Create(config, *std::move(cuda), &clock);
  config.device_step = false;
  config.in_place_writes = false;
  std::unique_ptr<engine::Engine> host =
      *engine::Engine::Create(config, *CpuBackend::Create(8 << 20), &clock);

  // What a worker learns from GetInfo, for the same-GPU attach.
  client::Info info;
  info.backend = "cuda";
  info.cuda_ipc_handle = exported.handle;
  info.cuda_device_uuid = exported.device_uuid;
  info.cuda_pool_bytes = exported.bytes;
  std::unique_ptr<transport::AttachSocket> attach = *transport::AttachSocket::Start({});
  info.attach = {
      attach->address(),
      attach->Issue({{v1::attach::kEpochBoard, gpu->epoch_board().segment(), false}}, "")};
  info.epoch_stride = engine::EpochBoard::kStride;
  info.epoch_slots = gpu->epoch_board().slots();
  absl::StatusOr<std::unique_ptr<client::CudaPool>> pool = client::CudaPool::Attach(info, true);
  // A real runtime opens an IPC handle only in another process than the one that made it
  // (the emulated one here, in this one): there the worker's side is a process of its own,
  // as in cuda_attach_test.
  if (!pool.ok() && absl::StrContains(pool.status().message(), "open the pool's handle")) {
    GTEST_SKIP() << "this runtime opens IPC handles only in another process: " << pool.status();
  }
  ASSERT_TRUE(pool.ok()) << pool.status();
  client::BlockTable geometry;  // what WritePlanned needs of the table
  geometry.layout = client::Layout{kL, kH, kD, client::DType::kF16, kB, kVocab};
  geometry.block_tokens = kB;

  const engine::Layout layout{kL, kH, kD, engine::DType::kF16, kB, kVocab};
  const Case c{"confkv", {{"c_high", 40}, {"c_low", 72}, {"protect", 8}}, {}};
  const uint64_t d = gpu->CreateSequence(layout, c.policy, c.params, c.quant, {})->sequence_id;
  const uint64_t h = host->CreateSequence(layout, c.policy, c.params, c.quant, {})->sequence_id;
  ASSERT_TRUE(Append(*gpu, d, 0, 100).ok());
  ASSERT_TRUE(Append(*host, h, 0, 100).ok());
  auto run = [&](engine::StepCall call) {
    absl::StatusOr<std::vector<engine::StepOutcome>> out =
        gpu->StepBatch(absl::MakeConstSpan(&call, 1));
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) {
      engine::StepOutcome failed;
      failed.status = out.status();
      return failed;
    }
    return std::move((*out)[0]);
  };
  engine::StepCall first;
  first.sequence_id = d;
  first.plan_tokens = 1;
  engine::StepOutcome planned = run(first);
  ASSERT_TRUE(planned.plan && planned.plan->ok());
  engine::PlanView plan = **planned.plan;

  const uint64_t kv_bytes = uint64_t{kL} * kH * kD * 2;
  void* dk = nullptr;
  void* dv = nullptr;
  ASSERT_EQ(cudaMalloc(&dk, kv_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dv, kv_bytes), cudaSuccess);
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  uint64_t evicted = 0;
  for (int64_t t = 100; t < 220; ++t) {
    const std::string at = "step " + std::to_string(t);
    // The worker's kernels made this token's K/V in its own device memory.
    const std::string k = testing::PayloadF16(kL * kH, t, 1, kD, 0);
    const std::string v = testing::PayloadF16(kL * kH, t, 1, kD, 1);
    ASSERT_EQ(cudaMemcpy(dk, k.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dv, v.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    const client::WritePlan written{plan.id, plan.tokens, plan.block_offsets, plan.first_slots};
    ASSERT_TRUE((*pool)->WritePlanned(written, geometry, 1, dk, dv, kv_bytes).ok()) << at;
    // The same token as bytes to the host engine; rows over its table, the new token in.
    ASSERT_TRUE(Append(*host, h, t, 1).ok());
    const std::vector<std::vector<float>> rows = Rows(*host->GetBlockTable(h), rng);
    engine::StepInput in;
    in.attention = Signals(rows);
    const float p1 = 0.05f + 0.9f * unit(rng);
    in.logits = engine::RawLogitStats{unit(rng) * std::log(float(kVocab)), p1, p1 * unit(rng), {}};
    in.epoch = host->GetBlockTable(h)->epoch;
    absl::StatusOr<engine::StepResult> want = host->Step(h, in);
    ASSERT_TRUE(want.ok()) << at << ": " << want.status();
    const std::vector<int64_t> position = {t};
    engine::StepCall call;
    call.sequence_id = d;
    call.append = engine::AppendChunk{position, {}, {}, {}, {}, {}};
    call.plan_id = plan.id;
    in.epoch = gpu->GetBlockTable(d)->epoch;
    call.step = in;
    call.plan_tokens = 1;
    engine::StepOutcome got = run(call);
    ASSERT_TRUE(got.status.ok()) << at << ": " << got.status;
    ASSERT_TRUE(got.step && got.plan && got.plan->ok()) << at;
    EXPECT_EQ(got.step->evicted_tokens, want->evicted_tokens) << at;
    EXPECT_EQ(got.step->budget_tokens, want->budget_tokens) << at;
    ExpectSameTables(*gpu, d, *host, h, at);
    evicted += got.step->evicted_tokens;
    plan = **got.plan;
  }
  EXPECT_GT(evicted, 50u);
  ExpectContent(*gpu, d, c.quant.type);
  EXPECT_EQ(cudaFree(dk), cudaSuccess);
  EXPECT_EQ(cudaFree(dv), cudaSuccess);
}

// kvmemd --cuda-device=1 serves calls on gRPC threads whose current device is any other:
// every call of the backend and its slot states must make its own device current before it
// allocates or launches (a scratch buffer on device 0 read by a kernel on device 1 faults).
// Here every call of the engine on device 1 comes while device 0 is current. The emulated
// runtime has two devices and refuses a launch that touches another device's memory.
TEST(CudaEngineOnSecondGpuTest, EveryCallWorksWhateverDeviceIsCurrent) {
  if (VisibleDevices() < 2) GTEST_SKIP() << "one CUDA device";
  auto twins = MakeTwinEngines(1);
  ASSERT_TRUE(twins.ok()) << twins.status();
  engine::Engine& gpu = *(*twins)->gpu;
  engine::Engine& host = *(*twins)->host;
  const auto away = [] { ASSERT_EQ(cudaSetDevice(0), cudaSuccess); };
  const engine::Layout layout{engine::twins::kL,   engine::twins::kH, engine::twins::kD,
                              engine::DType::kF16, engine::twins::kB, engine::twins::kVocab};
  const policy::ParamOverrides params{{"c_high", 48}, {"c_low", 80}, {"protect", 8}};
  const engine::QuantConfig quant{kernels::QuantType::kInt8, 24};
  away();
  const uint64_t g = gpu.CreateSequence(layout, "confkv", params, quant, {})->sequence_id;
  const uint64_t h = host.CreateSequence(layout, "confkv", params, quant, {})->sequence_id;
  away();
  ASSERT_TRUE(engine::twins::Append(gpu, g, 0, 120).ok());
  ASSERT_TRUE(engine::twins::Append(host, h, 0, 120).ok());
  std::mt19937 rng(11);
  {
    const engine::BlockTable table = *host.GetBlockTable(h);
    const std::vector<std::vector<float>> window = engine::twins::Rows(table, rng);
    engine::CompressInput in;
    in.window_scores = engine::twins::Signals(window);
    in.epoch = table.epoch;
    ASSERT_TRUE(host.Compress(h, in).ok());
    in.epoch = gpu.GetBlockTable(g)->epoch;
    away();
    absl::StatusOr<engine::CompressResult> r = gpu.Compress(g, in);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  for (int64_t t = 120; t < 180; ++t) {
    away();
    ASSERT_TRUE(engine::twins::Append(gpu, g, t, 1).ok());
    ASSERT_TRUE(engine::twins::Append(host, h, t, 1).ok());
    const engine::BlockTable table = *host.GetBlockTable(h);
    const std::vector<std::vector<float>> rows = engine::twins::Rows(table, rng);
    engine::StepInput in;
    in.attention = engine::twins::Signals(rows);
    in.logits = engine::RawLogitStats{2.0f + (t % 3), 0.5f, 0.1f, {}};
    in.epoch = table.epoch;
    ASSERT_TRUE(host.Step(h, in).ok());
    in.epoch = gpu.GetBlockTable(g)->epoch;
    away();
    absl::StatusOr<engine::StepResult> r = gpu.Step(g, in);
    ASSERT_TRUE(r.ok()) << "step " << t << ": " << r.status();
    engine::twins::ExpectSameTables(gpu, g, host, h, "step " + std::to_string(t));
  }
  away();
  engine::twins::ExpectContent(gpu, g, kernels::QuantType::kInt8);
}

INSTANTIATE_TEST_SUITE_P(Policies, CudaEngineTest, ::testing::ValuesIn(engine::twins::Cases()),
                         [](const ::testing::TestParamInfo<engine::twins::Case>& info) {
                           return std::string(info.param.policy) + "_" + std::to_string(info.index);
                         });

}  // namespace
}  // namespace kvmem::store
