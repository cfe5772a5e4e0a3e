// /metrics after a known workload: every counter is exact and agrees with Stats (one source),
// RPCs are counted by method and code, and the attention mass a step evicts is measured.
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

// GET http://127.0.0.1:port/metrics, the body only.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// "name{labels}" -> value, for every sample line.
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

class MetricsTest : public DaemonTest {
 protected:
  MetricsTest() { metrics_listen_ = "127.0.0.1:0"; }
};

TEST_F(MetricsTest, CountersAreExactAndAgreeWithStats) {
  ASSERT_NE(server_->metrics_port(), 0);
  // window 16: 32 tokens, then 10 steps of one token each; the first step evicts 17, the
  // others 1 each: 26 tokens from each of the 8 streams.
  const uint64_t a = Create("window", {{"window", 16}});
  ASSERT_TRUE(AppendRange(a, 0, 32).ok());
  for (int64_t pos = 32; pos < 42; ++pos) {
    ASSERT_TRUE(AppendRange(a, pos, 1).ok());
    ASSERT_TRUE(client_->Step(a, {}).ok());
  }
  const uint64_t b = Create("full");
  ASSERT_TRUE(AppendRange(b, 0, 20).ok());
  EXPECT_FALSE(client_->Step(999, {}).ok());  // NOT_FOUND

  const auto m = Samples(Scrape(server_->metrics_port()));
  auto stats = client_->GetStats(false);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(m.at("kvmem_tokens_appended_total{policy=\"window\"}"), 42);
  EXPECT_EQ(m.at("kvmem_tokens_appended_total{policy=\"full\"}"), 20);
  EXPECT_EQ(m.at("kvmem_tokens_evicted_total{policy=\"window\"}"), 26);
  EXPECT_EQ(m.at("kvmem_stream_slots_evicted_total{policy=\"window\"}"), 26 * kL * kH);
  EXPECT_EQ(m.at("kvmem_tokens_evicted_total{policy=\"full\"}"), 0);
  EXPECT_EQ(stats->tokens_appended, 62u);
  EXPECT_EQ(stats->tokens_evicted, 26);
  EXPECT_EQ(stats->stream_slots_evicted, 26u * kL * kH);
  for (const client::PolicyCounters& p : stats->policies) {
    const std::string label = "{policy=\"" + p.policy + "\"}";
    EXPECT_EQ(m.at("kvmem_tokens_appended_total" + label), p.tokens_appended) << p.policy;
    EXPECT_EQ(m.at("kvmem_tokens_evicted_total" + label), p.tokens_evicted) << p.policy;
    EXPECT_EQ(m.at("kvmem_stream_slots_evicted_total" + label), p.stream_slots_evicted);
  }
  EXPECT_EQ(m.at("kvmem_step_duration_seconds_count{policy=\"window\",where=\"host\"}"), 10);
  EXPECT_EQ(m.at("kvmem_append_duration_seconds_count{policy=\"window\"}"), 11);
  EXPECT_EQ(m.at("kvmem_sequences"), 2);
  EXPECT_EQ(m.at("kvmem_sequences_created_total"), 2);
  EXPECT_EQ(stats->sequences_created, 2u);
  EXPECT_EQ(m.at("kvmem_kv_bytes"), stats->kv_bytes);
  // f16 K and V of 62 tokens in 8 streams of head_dim 64.
  EXPECT_EQ(m.at("kvmem_kv_full_cache_bytes"), 62.0 * kL * kH * 2 * kD * 2);
  EXPECT_EQ(stats->full_cache_bytes, 62u * kL * kH * 2 * kD * 2);
  EXPECT_LT(stats->kv_bytes, stats->full_cache_bytes);  // window dropped some
  EXPECT_EQ(m.at("kvmem_pool_capacity_bytes"), stats->pool_bytes);
  EXPECT_EQ(m.at("kvmem_pool_bytes{state=\"free\"}"), stats->pool_free_bytes);
  EXPECT_EQ(m.at("kvmem_pool_blocks{state=\"sequences\"}"), stats->blocks_used);
  EXPECT_EQ(m.at("kvmem_kv_block_bytes{precision=\"f16\"}"), stats->blocks_used * 16 * kD * 2 * 2);
  // RPCs by method and code: 12 Appends, 10 Steps and one unknown sequence.
  EXPECT_EQ(m.at("kvmem_rpc_requests_total{code=\"OK\",method=\"Append\"}"), 12);
  EXPECT_EQ(m.at("kvmem_rpc_requests_total{code=\"OK\",method=\"Step\"}"), 10);
  EXPECT_EQ(m.at("kvmem_rpc_requests_total{code=\"NOT_FOUND\",method=\"Step\"}"), 1);
  EXPECT_EQ(m.at("kvmem_rpc_duration_seconds_count{method=\"Step\"}"), 11);
  // The K/V the appends carried (62 tokens, 8 streams, f16 K and V) went in over gRPC.
  EXPECT_GT(m.at("kvmem_data_plane_bytes_total{direction=\"in\",transport=\"grpc\"}"),
            62.0 * kL * kH * kD * 2 * 2);
  EXPECT_GT(m.at("kvmem_data_plane_bytes_total{direction=\"out\",transport=\"grpc\"}"), 0);
  EXPECT_EQ(m.at("kvmem_build_info{backend=\"cpu\",device=\"" +
                 std::string(server_->engine().backend().device_name()) + "\",version=\"" +
                 client_->GetInfo()->version + "\"}"),
            1);
  // The endpoint serves what the collector renders.
  EXPECT_TRUE(
      absl::StrContains(server_->RenderMetrics(), "# TYPE kvmem_tokens_evicted_total counter"));
}

// A decode loop on the same-host fast path shows in the RPC panels: each StepBatch a step
// channel answers counts as a StepBatch call (its code, its latency), its bytes under their
// own transport, and the channel's batches on their own.
TEST_F(MetricsTest, StepChannelBatchesAreStepBatchCalls) {
  const uint64_t a = Create("window", {{"window", 16}});
  ASSERT_TRUE(AppendRange(a, 0, 32).ok());
  ASSERT_TRUE(client_->OpenStepChannel().ok());
  std::vector<client::BatchEntry> batch(1);
  batch[0].sequence_id = a;
  batch[0].step = client::StepArgs{};
  for (int i = 0; i < 3; ++i) {
    auto r = client_->StepBatch(batch);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  }
  batch[0].sequence_id = 999;  // the entry fails; the call does not
  auto r = client_->StepBatch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(client_->step_channel_batches(), 4u) << "the batches went by the channel";

  const auto m = Samples(Scrape(server_->metrics_port()));
  EXPECT_EQ(m.at("kvmem_rpc_requests_total{code=\"OK\",method=\"StepBatch\"}"), 4);
  EXPECT_EQ(m.at("kvmem_rpc_duration_seconds_count{method=\"StepBatch\"}"), 4);
  EXPECT_EQ(m.at("kvmem_step_channel_batches_total"), 4);
  EXPECT_GT(m.at("kvmem_data_plane_bytes_total{direction=\"in\",transport=\"step_channel\"}"),
            4 * 3);  // each request: an id, an entry, a request_id
  EXPECT_GT(m.at("kvmem_data_plane_bytes_total{direction=\"out\",transport=\"step_channel\"}"), 0);
}

// h2o with budget 8 over 17 slots: the step keeps the 8 slots its row weighs most, so the
// row (weights 1..17, normalized, the heaviest last) loses the 9 lightest: (1+...+9)/153 of
// its mass, not the 9/17 a count would give.
TEST_F(MetricsTest, TheAttentionMassAStepEvictsIsMeasured) {
  const uint64_t id = Create("h2o", {{"budget", 8}});
  ASSERT_TRUE(AppendRange(id, 0, 17).ok());
  auto table = client_->GetBlockTable(id);
  ASSERT_TRUE(table.ok());
  client::StepArgs args;
  args.epoch = table->epoch;
  std::vector<float> row(17);
  for (int i = 0; i < 17; ++i) row[i] = static_cast<float>(i + 1) / 153.0f;
  for (uint32_t s = 0; s < kL * kH; ++s) args.attention.push_back({s / kH, s % kH, row});
  auto step = client_->Step(id, args);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->evicted_tokens, 9u * kL * kH);
  const auto m = Samples(server_->RenderMetrics());
  EXPECT_EQ(m.at("kvmem_evicted_attention_mass_count{policy=\"h2o\"}"), 1);
  EXPECT_NEAR(m.at("kvmem_evicted_attention_mass_sum{policy=\"h2o\"}"), 45.0 / 153, 1e-5);
  EXPECT_EQ(m.at("kvmem_quantized_attention_mass_sum{policy=\"h2o\"}"), 0);
  EXPECT_EQ(m.at("kvmem_budget_tokens_count{policy=\"h2o\"}"), 1);
  EXPECT_GT(m.at("kvmem_step_duration_seconds_sum{policy=\"h2o\",where=\"host\"}"), 0);
}

// int8 beyond the newest 16 tokens: a step over 48 tokens quantizes their first two blocks
// (nothing was quantized before it: mass 0); after one more token, a row of weights 1..49
// (normalized) puts (1+...+32)/1225 of its mass on those 32 slots.
TEST_F(MetricsTest, TheAttentionMassQuantizedSlotsHoldIsMeasured) {
  auto seq = client_->CreateSequence(TestLayout(),
                                     {"h2o", {{"budget", 1000}}, client::Precision::kInt8, 16});
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(AppendRange(seq->id, 0, 48).ok());
  auto first = client_->GetBlockTable(seq->id);
  ASSERT_TRUE(first.ok());
  client::StepArgs quantize;
  quantize.epoch = first->epoch;
  for (uint32_t s = 0; s < kL * kH; ++s) {
    quantize.attention.push_back({s / kH, s % kH, std::vector<float>(48, 1.0f / 48)});
  }
  ASSERT_TRUE(client_->Step(seq->id, quantize).ok());
  ASSERT_TRUE(AppendRange(seq->id, 48, 1).ok());
  auto table = client_->GetBlockTable(seq->id);
  ASSERT_TRUE(table.ok());
  uint64_t quantized = 0;
  for (const auto& b : table->streams[0].blocks) {
    if (b.precision == client::Precision::kInt8) quantized += b.count;
  }
  ASSERT_EQ(quantized, 32u);
  client::StepArgs args;
  args.epoch = table->epoch;
  std::vector<float> row(49);
  for (int i = 0; i < 49; ++i) row[i] = static_cast<float>(i + 1) / 1225.0f;
  for (uint32_t s = 0; s < kL * kH; ++s) args.attention.push_back({s / kH, s % kH, row});
  ASSERT_TRUE(client_->Step(seq->id, args).ok());
  const auto m = Samples(server_->RenderMetrics());
  EXPECT_EQ(m.at("kvmem_quantized_attention_mass_count{policy=\"h2o\"}"), 2);
  EXPECT_NEAR(m.at("kvmem_quantized_attention_mass_sum{policy=\"h2o\"}"), 528.0 / 1225, 1e-5);
  EXPECT_EQ(m.at("kvmem_evicted_attention_mass_sum{policy=\"h2o\"}"), 0);
}

// A published prefix nobody holds is cached: the pool's states add up, cached > 0.
TEST_F(MetricsTest, CachedPrefixBlocksAreTheirOwnState) {
  std::vector<int32_t> tokens(33);
  for (int i = 0; i < 33; ++i) tokens[i] = 100 + i;
  client::Prompt prompt{tokens, "", "m", /*auto_publish=*/true};
  auto seq = client_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
  ASSERT_TRUE(seq.ok());
  positions_ = testing::Range(0, 33);
  k_ = testing::Payload16(kL * kH, 0, 33, kD, 0);
  v_ = testing::Payload16(kL * kH, 0, 33, kD, 1);
  ASSERT_TRUE(client_->Append(seq->id, {positions_, tokens, k_, v_, {}, {}}).ok());
  ASSERT_TRUE(client_->Release(seq->id).ok());
  const auto m = Samples(server_->RenderMetrics());
  EXPECT_EQ(m.at("kvmem_pool_blocks{state=\"cached\"}"), 2 * kL * kH);
  EXPECT_EQ(m.at("kvmem_pool_blocks{state=\"sequences\"}"), 0);
  EXPECT_EQ(m.at("kvmem_pool_bytes{state=\"cached\"}"), 2.0 * kL * kH * 16 * kD * 2 * 2);
  EXPECT_EQ(m.at("kvmem_pool_bytes{state=\"sequences\"}") +
                m.at("kvmem_pool_bytes{state=\"cached\"}") +
                m.at("kvmem_pool_bytes{state=\"free\"}"),
            m.at("kvmem_pool_capacity_bytes"));
}

}  // namespace
}  // namespace kvmem
