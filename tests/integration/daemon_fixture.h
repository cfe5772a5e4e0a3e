#pragma once
// kvmemd started in-process on loopback (port 0) with a fake clock, driven through the
// C++ client exactly as a worker would.
#include <memory>
#include <optional>

#include "gtest/gtest.h"
#include "kvmem/client.h"
#include "server/service/server.h"
#include "tests/testing/payload.h"

namespace kvmem {

class DaemonTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kL = 4, kH = 2, kD = 64;

  void SetUp() override { StartDaemon(64ull << 20); }
  void TearDown() override {
    client_.reset();
    server_.reset();
  }

  void StartDaemon(uint64_t pool_bytes, uint64_t max_message_bytes = 8ull << 20) {
    client_.reset();
    server_.reset();
    service::ServerConfig config;
    config.listen = absl::StrCat("127.0.0.1:", listen_port_);
    config.engine.pool_bytes = pool_bytes;
    config.engine.max_sequences = 64;
    config.engine.max_append_bytes = max_message_bytes;
    config.limits = limits_;
    config.reaper_period = absl::Hours(1);  // tests expire leases explicitly
    config.metrics_listen = metrics_listen_;
    config.engine.in_place_writes = in_place_writes_;
    config.engine.table_area_bytes = table_area_bytes_;
    if (parse_memory_bytes_ != 0) config.parse_memory_bytes = parse_memory_bytes_;
    config.ucx = ucx_;
    config.ucx_trusted_network = ucx_;
    auto server = service::Server::Start(config, &clock_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client::ClientOptions options;
    options.deadline = absl::Seconds(20);
    client_ = *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()), options);
  }

  static client::Layout TestLayout() {
    return client::Layout{kL, kH, kD, client::DType::kF16, 16, 49152};
  }

  uint64_t Create(const std::string& policy = "full", std::map<std::string, double> params = {},
                  std::optional<absl::Duration> lease = std::nullopt) {
    auto seq = client_->CreateSequence(TestLayout(), {policy, params}, lease);
    EXPECT_TRUE(seq.ok()) << seq.status();
    return seq.ok() ? seq->id : 0;
  }

  absl::StatusOr<client::AppendResult> AppendRange(uint64_t id, int64_t first, uint32_t n) {
    positions_ = testing::Range(first, n);
    k_ = testing::Payload16(kL * kH, first, n, kD, 0);
    v_ = testing::Payload16(kL * kH, first, n, kD, 1);
    return client_->Append(id, {positions_, {}, k_, v_, {}, {}});
  }

  void ExpectContentMatchesPositions(uint64_t id) {
    auto streams = client_->ReadKv(id);
    ASSERT_TRUE(streams.ok()) << streams.status();
    ASSERT_EQ(streams->size(), kL * kH);
    for (const client::StreamKv& kv : *streams) {
      const uint32_t s = kv.layer * kH + kv.kv_head;
      ASSERT_EQ(kv.k, testing::Expected16(s, kv.positions, kD, 0)) << "stream " << s;
      ASSERT_EQ(kv.v, testing::Expected16(s, kv.positions, kD, 1)) << "stream " << s;
    }
  }

  // The service's limits; a fixture that wants others sets them in its constructor.
  service::ServiceLimits limits_;
  std::string metrics_listen_;  // empty: no /metrics endpoint
  bool in_place_writes_ = false;
  uint64_t table_area_bytes_ = 0;    // kvmemd --table_area_bytes
  uint64_t parse_memory_bytes_ = 0;  // kvmemd --parse-memory-bytes (0: the default)
  bool ucx_ = false;                 // kvmemd --ucx
  int listen_port_ = 0;              // 0: one of its own
  engine::FakeClock clock_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<client::Client> client_;
  std::vector<int64_t> positions_;
  std::string k_, v_;
};

}  // namespace kvmem
