// Remote reads by UCX RMA (kvmemd --ucx, kvmem/ucx_pool.h): blocks read from the daemon's
// pool bit-exact over TCP and over shared memory, quantized blocks dequantized as a mapping
// reads them, a stale table or a read across an epoch change refused, and the remote key
// given only to a caller that may read the pool.
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "kvmem/ucx_pool.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

// UCX_TLS for both ends (the daemon's worker and the client's read it when made).
class UcxTest : public DaemonTest, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", GetParam(), 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    ucx_ = true;
    DaemonTest::SetUp();
    if (HasFatalFailure()) return;
    auto info = client_->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_FALSE(info->ucx.worker_address.empty());
    auto pool = client::UcxPool::Connect(*info);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
  }
  void TearDown() override {
    pool_.reset();
    DaemonTest::TearDown();
    unsetenv("UCX_TLS");
  }
  std::unique_ptr<client::UcxPool> pool_;
};

TEST_P(UcxTest, ReadsEveryStreamBitExact) {
  const uint64_t id = Create("window", {{"window", 50}});
  ASSERT_TRUE(AppendRange(id, 0, 120).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());
  auto table = client_->GetBlockTable(id);
  ASSERT_TRUE(table.ok()) << table.status();
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t h = 0; h < kH; ++h) {
      std::string k, v;
      const absl::Status read = pool_->ReadStream(*table, l, h, &k, &v);
      ASSERT_TRUE(read.ok()) << read;
      const auto& positions = table->streams[l * kH + h].positions;
      EXPECT_EQ(positions, testing::Range(70, 50));
      EXPECT_EQ(k, testing::Expected16(l * kH + h, positions, kD, 0));
      EXPECT_EQ(v, testing::Expected16(l * kH + h, positions, kD, 1));
    }
  }
  EXPECT_GT(pool_->bytes_read(), 2u * kL * kH * 50 * kD * 2);
}

TEST_P(UcxTest, QuantizedBlocksReadAsReadKvReturnsThem) {
  auto seq = client_->CreateSequence(TestLayout(), {"full", {}, client::Precision::kInt8, 16});
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(AppendRange(seq->id, 0, 80).ok());
  ASSERT_TRUE(client_->Step(seq->id, {}).ok());
  auto table = *client_->GetBlockTable(seq->id);
  auto streams = client_->ReadKv(seq->id);
  ASSERT_TRUE(streams.ok()) << streams.status();
  bool quantized = false;
  for (const client::StreamKv& kv : *streams) {
    for (const client::TableBlock& b : table.streams[kv.layer * kH + kv.kv_head].blocks) {
      quantized |= b.precision != client::Precision::kLayout;
    }
    std::string k, v;
    ASSERT_TRUE(pool_->ReadStream(table, kv.layer, kv.kv_head, &k, &v).ok());
    EXPECT_EQ(k, kv.k);
    EXPECT_EQ(v, kv.v);
  }
  EXPECT_TRUE(quantized);
}

TEST_P(UcxTest, AStaleTableIsRefused) {
  const uint64_t id = Create("window", {{"window", 10}});
  ASSERT_TRUE(AppendRange(id, 0, 30).ok());
  auto table = *client_->GetBlockTable(id);
  ASSERT_TRUE(pool_->BeginRead(table).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());  // evicts: a new epoch
  EXPECT_EQ(pool_->EndRead(table).code(), absl::StatusCode::kFailedPrecondition);
  std::string k, v;
  EXPECT_EQ(pool_->ReadStream(table, 0, 0, &k, &v).code(), absl::StatusCode::kFailedPrecondition);
  auto fresh = *client_->GetBlockTable(id);
  EXPECT_TRUE(pool_->ReadStream(fresh, 1, 1, &k, &v).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxTest, ::testing::Values("tcp", "sm,self"),
                         [](const auto& info) {
                           return std::string(info.param[0] == 't' ? "Tcp" : "SharedMemory");
                         });

// The remote key reads every tenant's blocks: only an admin (or anyone, in one trust
// domain) is given it.
TEST(UcxAuthTest, OnlyACallerThatMayReadThePoolGetsTheKey) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/kvmem_ucx_tokens.", getpid());
  std::ofstream(tokens) << "alice alice-token-0123456789\nops admin-token-0123456789 admin\n";
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 8ull << 20;
  config.auth_tokens = tokens;
  config.ucx = true;
  // Refused unless the network is said to be trusted (software RMA checks no key).
  auto refused = service::Server::Start(config);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("--ucx_trusted_network"));
  config.ucx_trusted_network = true;
  auto server = service::Server::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  auto info_of = [&](const std::string& token) {
    client::ClientOptions options;
    options.auth_token = token;
    auto client = *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
    return *client->GetInfo();
  };
  const client::Info alice = info_of("alice-token-0123456789");
  EXPECT_TRUE(alice.ucx.worker_address.empty());
  EXPECT_TRUE(alice.ucx.pool_rkey.empty());
  EXPECT_EQ(client::UcxPool::Connect(alice).status().code(), absl::StatusCode::kFailedPrecondition);
  const client::Info ops = info_of("admin-token-0123456789");
  EXPECT_FALSE(ops.ucx.worker_address.empty());
  EXPECT_FALSE(ops.ucx.pool_rkey.empty());
  std::remove(tokens.c_str());
}

}  // namespace
}  // namespace kvmem
