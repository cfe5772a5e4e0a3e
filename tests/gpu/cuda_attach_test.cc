// A worker process on the daemon's GPU: kvmemd --backend=cuda runs as its own process (CUDA
// IPC handles open only in another process), steps confkv with int8 quantization on the
// device, and the client maps the pool by its IPC handle and reads every stream in place —
// the same bytes ReadKv returns — under the epoch protocol. Skipped where kvmemd cannot
// start its CUDA backend (no GPU).
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvmem/client.h"
#include "kvmem/cuda_pool.h"
#include "tests/testing/kvmemd_process.h"
#include "tests/testing/payload.h"

namespace kvmem {
namespace {

constexpr uint32_t kL = 4, kH = 2, kD = 64;

// KVMEMD overrides the build's path (tests/gpu/bundle.sh carries the program elsewhere).
const char* KvmemdPath() {
  const char* path = std::getenv("KVMEMD");
  return path != nullptr ? path : KVMEMD_PATH;
}

TEST(CudaAttachTest, WorkerReadsBlocksInPlaceOnTheSameGpu) {
  testing::KvmemdProcess d = testing::StartKvmemd(
      KvmemdPath(),
      {"--listen=127.0.0.1:0", "--backend=cuda", "--pool-bytes=67108864", "--log-level=warn"});
  if (d.port == 0) {
    testing::StopKvmemd(d);
    GTEST_SKIP() << "kvmemd --backend=cuda did not start (no GPU here)";
  }
  auto client = *client::Client::Connect("127.0.0.1:" + std::to_string(d.port));
  auto info = client->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend, "cuda");
  EXPECT_TRUE(info->device_step);  // auto: on for CUDA
  auto pool = client::CudaPool::Attach(*info);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->bytes(), 67108864u);

  client::PolicySpec policy{"confkv", {{"c_high", 48}, {"c_low", 80}, {"protect", 8}}};
  policy.quantization = client::Precision::kInt8;
  policy.quantization_recent_tokens = 24;
  const client::Layout layout{kL, kH, kD, client::DType::kF16, 16, 1000};
  const uint64_t id = client->CreateSequence(layout, policy)->id;
  std::mt19937 rng(5);
  std::exponential_distribution<float> e(1.0f);
  uint64_t evicted = 0;
  for (int64_t t = 0; t < 160; ++t) {
    const uint32_t n = t == 0 ? 100 : 1;
    const int64_t first = t == 0 ? 0 : 99 + t;
    const std::vector<int64_t> positions = testing::Range(first, n);
    const std::string k = testing::Payload16(kL * kH, first, n, kD, 0);
    const std::string v = testing::Payload16(kL * kH, first, n, kD, 1);
    ASSERT_TRUE(client->Append(id, {positions, {}, k, v, {}, {}}).ok());
    const client::BlockTable table = *client->GetBlockTable(id);
    client::StepArgs step;
    step.epoch = table.epoch;
    step.logit_stats = client::LogitStats{2.0f + (t % 3), 0.5f, 0.1f, {}};
    for (const client::StreamTable& st : table.streams) {
      std::vector<float> row(st.positions.size());
      float sum = 0;
      for (float& a : row) {
        a = e(rng);
        sum += a;
      }
      for (float& a : row) a /= sum;  // a softmax row: each weight in [0, 1]
      step.attention.push_back({st.layer, st.kv_head, std::move(row)});
    }
    auto r = client->Step(id, step);
    ASSERT_TRUE(r.ok()) << r.status();
    evicted += r->evicted_tokens;
  }
  EXPECT_GT(evicted, 0u);

  const client::BlockTable table = *client->GetBlockTable(id);
  auto streams = *client->ReadKv(id, table.epoch);
  for (const client::StreamKv& kv : streams) {
    std::string k, v;
    ASSERT_TRUE((*pool)->ReadStream(table, kv.layer, kv.kv_head, &k, &v).ok());
    EXPECT_EQ(k, kv.k) << "layer " << kv.layer << " head " << kv.kv_head;
    EXPECT_EQ(v, kv.v) << "layer " << kv.layer << " head " << kv.kv_head;
  }
  // The newest slots are never quantized: they read back exactly as written.
  const client::StreamKv& last = streams.back();
  const uint32_t s = last.layer * kH + last.kv_head;
  const std::vector<int64_t> newest(last.positions.end() - 8, last.positions.end());
  const uint64_t row = kD * 2;
  EXPECT_EQ(last.k.substr(last.k.size() - 8 * row), testing::Expected16(s, newest, kD, 0));

  // After another step the old table is stale for in-place readers.
  ASSERT_TRUE(client
                  ->Append(id, {testing::Range(300, 1),
                                {},
                                testing::Payload16(kL * kH, 300, 1, kD, 0),
                                testing::Payload16(kL * kH, 300, 1, kD, 1),
                                {},
                                {}})
                  .ok());
  const client::BlockTable newer = *client->GetBlockTable(id);
  client::StepArgs step;
  step.epoch = newer.epoch;
  step.logit_stats = client::LogitStats{2.0f, 0.5f, 0.1f, {}};
  for (const client::StreamTable& st : newer.streams) {
    step.attention.push_back({st.layer, st.kv_head, std::vector<float>(st.positions.size(), 1.0f)});
  }
  ASSERT_TRUE(client->Step(id, step).ok());
  EXPECT_EQ((*pool)->BeginRead(table).code(), absl::StatusCode::kFailedPrecondition);
  pool->reset();
  EXPECT_EQ(testing::StopKvmemd(d), 0);
}

TEST(CudaAttachTest, ACpuDaemonExportsNoCudaPool) {
  client::Info info;
  info.backend = "cpu";
  auto pool = client::CudaPool::Attach(info);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pool.status().message().find("exports no CUDA pool"), std::string::npos);
}

}  // namespace
}  // namespace kvmem
