#include <unistd.h>

#include <thread>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/service/kv_cache_service.h"
#include "server/store/cpu_backend.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

TEST_F(DaemonTest, ThousandTokensOverFourLayersTwoHeadsReadBackBitExact) {
  const uint64_t id = Create();
  // A prefill of 600 in one Append, then 400 decode-style appends of one token.
  ASSERT_TRUE(AppendRange(id, 0, 600).ok());
  for (int64_t t = 600; t < 1000; ++t) ASSERT_TRUE(AppendRange(id, t, 1).ok());
  ExpectContentMatchesPositions(id);
  auto streams = *client_->ReadKv(id);
  EXPECT_EQ(streams[0].positions, testing::Range(0, 1000));
  auto table = *client_->GetBlockTable(id);
  EXPECT_EQ(table.streams.size(), kL * kH);
  ASSERT_EQ(table.streams[7].blocks.size(), 63u);  // ceil(1000 / 16)
  EXPECT_EQ(table.streams[7].blocks.back().count, 1000u - 62 * 16);
}

// A stream longer than one ReadKv response (2 MiB of K+V and positions) comes in pieces
// that the client puts back together; no response holds more than the bound.
TEST_F(DaemonTest, ALongStreamIsReadInPiecesAndJoined) {
  constexpr uint32_t kWideD = 4096;  // 16 KiB of K+V per slot: 127 slots a piece
  auto seq = client_->CreateSequence(client::Layout{1, 1, kWideD, client::DType::kF16, 4, 100},
                                     {"window", {{"window", 598}}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  for (int64_t first = 0; first < 700; first += 175) {  // 5.6 MB of K+V a call
    const std::vector<int64_t> positions = testing::Range(first, 175);
    const std::string k = testing::Payload16(1, first, 175, kWideD, 0);
    const std::string v = testing::Payload16(1, first, 175, kWideD, 1);
    auto appended = client_->Append(seq->id, {positions, {}, k, v, {}, {}});
    ASSERT_TRUE(appended.ok()) << appended.status();
  }
  ASSERT_TRUE(client_->Step(seq->id, {}).ok());  // keeps 102..699: mid-block start
  auto streams = client_->ReadKv(seq->id);
  ASSERT_TRUE(streams.ok()) << streams.status();
  ASSERT_EQ(streams->size(), 1u);
  EXPECT_EQ((*streams)[0].positions, testing::Range(102, 598));
  EXPECT_EQ((*streams)[0].k, testing::Expected16(0, testing::Range(102, 598), kWideD, 0));
  EXPECT_EQ((*streams)[0].v, testing::Expected16(0, testing::Range(102, 598), kWideD, 1));

  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::ReadKvRequest q;
  q.set_sequence_id(seq->id);
  auto reader = stub->ReadKv(&context, q);
  v1::ReadKvResponse piece;
  uint64_t next = 0, pieces = 0;
  while (reader->Read(&piece)) {
    EXPECT_EQ(piece.first_slot(), next);
    next += static_cast<uint64_t>(piece.positions_size());
    ++pieces;
    EXPECT_LE(piece.ByteSizeLong(), (2u << 20) + 64);
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(next, 598u);
  EXPECT_EQ(pieces, 5u);  // 127 slots of 16 KiB (and a position) a piece
}

// Polls `condition` until it holds (true) or `timeout` passes (false).
template <typename Condition>
bool WaitFor(Condition condition, absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time end = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST_F(DaemonTest, AReadKvWhoseClientStopsReadingIsCancelledAndFreesItsThread) {
  // Before, a client that opened ReadKv and never read kept a daemon thread blocked in
  // Write for as long as it kept the connection.
  limits_.read_stream_idle = absl::Milliseconds(300);
  limits_.max_read_streams = 1;
  StartDaemon(64ull << 20);
  constexpr uint32_t kWideD = 4096;  // 16 KiB of K+V per slot, 2 MiB pieces
  auto seq = client_->CreateSequence(client::Layout{1, 1, kWideD, client::DType::kF16, 4, 100},
                                     {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  for (int64_t first = 0; first < 1400; first += 175) {  // 22 MiB: past every flow window
    const std::vector<int64_t> positions = testing::Range(first, 175);
    const std::string k = testing::Payload16(1, first, 175, kWideD, 0);
    const std::string v = testing::Payload16(1, first, 175, kWideD, 1);
    ASSERT_TRUE(client_->Append(seq->id, {positions, {}, k, v, {}, {}}).ok());
  }
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext stalled;
  v1::ReadKvRequest q;
  q.set_sequence_id(seq->id);
  auto reader = stub->ReadKv(&stalled, q);
  // Open, and the only one allowed: a second reader is refused, naming the flag.
  ASSERT_TRUE(WaitFor([&] { return server_->service().read_streams().open() == 1; }));
  auto refused = client_->ReadKv(seq->id);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("--max-read-streams"));
  // Not read from: cancelled by the daemon within its idle time (and a tick).
  ASSERT_TRUE(
      WaitFor([&] { return server_->service().read_streams().open() == 0; }, absl::Seconds(10)));
  // What the transport held before the cancel arrives, then the end.
  v1::ReadKvResponse piece;
  uint64_t slots = 0;
  while (reader->Read(&piece)) slots += static_cast<uint64_t>(piece.positions_size());
  EXPECT_LT(slots, 1400u);
  const grpc::Status finished = reader->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::CANCELLED) << finished.error_message();
  // The thread and the slot are back: a reader that reads gets everything.
  auto streams = client_->ReadKv(seq->id);
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ((*streams)[0].positions.size(), 1400u);
}

TEST_F(DaemonTest, AppendStreamIsAtomic) {
  const uint64_t id = Create();
  std::vector<std::vector<int64_t>> pos = {testing::Range(0, 300), testing::Range(300, 300)};
  std::vector<std::string> ks = {testing::Payload16(kL * kH, 0, 300, kD, 0),
                                 testing::Payload16(kL * kH, 300, 300, kD, 0)};
  std::vector<std::string> vs = {testing::Payload16(kL * kH, 0, 300, kD, 1),
                                 testing::Payload16(kL * kH, 300, 300, kD, 1)};
  std::vector<client::AppendArgs> chunks = {{pos[0], {}, ks[0], vs[0], {}, {}},
                                            {pos[1], {}, ks[1], vs[1], {}, {}}};
  auto r = client_->AppendStream(id, chunks);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->appended_tokens, 600u);
  ExpectContentMatchesPositions(id);

  // A bad second chunk (positions going back) rejects the whole stream.
  std::vector<int64_t> bad_pos = testing::Range(650, 10);
  std::vector<int64_t> back_pos = testing::Range(640, 10);
  const std::string k10 = testing::Payload16(kL * kH, 650, 10, kD, 0);
  std::vector<client::AppendArgs> bad = {{bad_pos, {}, k10, k10, {}, {}},
                                         {back_pos, {}, k10, k10, {}, {}}};
  auto rejected = client_->AppendStream(id, bad);
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rejected.status().message(), HasSubstr("chunk 1: positions[0]"));
  EXPECT_EQ(client_->GetStats(true)->sequences[0].appended_tokens, 600u);
}

TEST_F(DaemonTest, WindowKeepsLastWAndEpochsChangeOnEveryEviction) {
  const uint64_t id = Create("window", {{"window", 100}});
  ASSERT_TRUE(AppendRange(id, 0, 1000).ok());
  uint64_t epoch = client_->GetBlockTable(id)->epoch;
  auto step = *client_->Step(id, {});
  EXPECT_EQ(step.evicted_tokens, 900u * kL * kH);
  EXPECT_EQ(step.budget_tokens, 100u);
  EXPECT_NE(step.epoch, epoch);
  EXPECT_EQ(step.kv_bytes_after, 100u * kL * kH * 2 * kD * 2);
  std::set<uint64_t> epochs = {epoch, step.epoch};
  for (int64_t t = 1000; t < 1050; ++t) {
    ASSERT_TRUE(AppendRange(id, t, 1).ok());
    auto s = *client_->Step(id, {});
    EXPECT_EQ(s.evicted_tokens, kL * kH);
    EXPECT_TRUE(epochs.insert(s.epoch).second) << "epoch reused at step " << t;
  }
  const client::BlockTable table = *client_->GetBlockTable(id);
  for (const auto& st : table.streams) {
    EXPECT_EQ(st.positions, testing::Range(950, 100));
  }
  ExpectContentMatchesPositions(id);
  // The pool holds only what the window needs: ceil(100/16) = 7 blocks per stream.
  EXPECT_EQ(client_->GetStats(false)->blocks_used, 7u * kL * kH);
}

TEST_F(DaemonTest, ForkChildrenDivergeWithoutTouchingTheParent) {
  const uint64_t parent = Create("window", {{"window", 64}});
  ASSERT_TRUE(AppendRange(parent, 0, 100).ok());
  auto a = client_->Fork(parent);
  auto b = client_->Fork(parent);
  ASSERT_TRUE(a.ok() && b.ok());
  // Child a evicts; child b appends different tokens.
  ASSERT_TRUE(client_->Step(a->id, {}).ok());
  const std::vector<int64_t> pos = {100};
  const std::string k = std::string(kL * kH * kD * 2, '\x5f');  // finite f16
  ASSERT_TRUE(client_->Append(b->id, {pos, {}, k, k, {}, {}}).ok());
  EXPECT_EQ(client_->GetBlockTable(a->id)->streams[0].positions, testing::Range(36, 64));
  EXPECT_EQ(client_->GetBlockTable(b->id)->streams[0].positions.size(), 101u);
  EXPECT_EQ(client_->GetBlockTable(parent)->streams[0].positions, testing::Range(0, 100));
  ExpectContentMatchesPositions(parent);
  ExpectContentMatchesPositions(a->id);
  auto stats = *client_->GetStats(true);
  ASSERT_EQ(stats.sequences.size(), 3u);
  EXPECT_EQ(stats.sequences[1].parent_id, parent);
}

TEST_F(DaemonTest, LapsedLeaseFreesEveryBlock) {
  const uint64_t id = Create("full", {}, absl::Seconds(5));
  ASSERT_TRUE(AppendRange(id, 0, 500).ok());
  EXPECT_GT(client_->GetStats(false)->blocks_used, 0u);
  clock_.Advance(absl::Seconds(3));
  ASSERT_TRUE(client_->KeepAlive({id}).ok());
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(server_->engine().ExpireLeases(), 0u);
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(server_->engine().ExpireLeases(), 1u);
  auto stats = *client_->GetStats(false);
  EXPECT_EQ(stats.blocks_used, 0u);
  EXPECT_EQ(stats.pages_used, 0u);
  EXPECT_EQ(stats.sequences_active, 0u);
  EXPECT_EQ(client_->GetBlockTable(id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DaemonTest, FullPoolGivesResourceExhaustedAndChangesNothing) {
  StartDaemon(1 << 20);  // 16 pages of 64 KiB; a block is 16*64*2*2 = 4 KiB
  const uint64_t a = Create();
  ASSERT_TRUE(AppendRange(a, 0, 16 * 30).ok());  // 30 blocks x 8 streams = 240 of 256
  const auto before = *client_->GetStats(true);
  auto r = AppendRange(a, 480, 64);  // 4 more blocks per stream = 32 > 16 free
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("pool"));
  EXPECT_THAT(r.status().message(), HasSubstr("32 blocks of 4096 bytes"));
  const auto after = *client_->GetStats(true);
  EXPECT_EQ(after.blocks_used, before.blocks_used);
  EXPECT_EQ(after.sequences[0].appended_tokens, before.sequences[0].appended_tokens);
  EXPECT_EQ(after.sequences[0].kv_bytes, before.sequences[0].kv_bytes);
  ExpectContentMatchesPositions(a);
  // Releasing another sequence's memory is how room comes back.
  const uint64_t b = Create();
  EXPECT_EQ(AppendRange(b, 0, 48).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(client_->Release(a).ok());
  EXPECT_TRUE(AppendRange(b, 0, 48).ok());
}

TEST_F(DaemonTest, APublishedPromptIsReusedOverGrpc) {
  // A publisher sends its prompt with token ids (token i = 1000 + i) and publishes it.
  const uint64_t a = Create();
  std::vector<int32_t> tokens(70);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 1000 + static_cast<int32_t>(i);
  const std::vector<int64_t> positions = testing::Range(0, 40);
  const std::string k = testing::Payload16(kL * kH, 0, 40, kD, 0);
  const std::string v = testing::Payload16(kL * kH, 0, 40, kD, 1);
  client::AppendArgs args{positions, absl::MakeConstSpan(tokens).first(40), k, v, {}, {}};
  ASSERT_TRUE(client_->Append(a, args).ok());
  auto published = client_->Publish(a);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(*published, 32u);

  client::Prompt prompt{tokens, "", "smollm2"};
  EXPECT_EQ(*client_->Lookup(TestLayout(), prompt), 0u);  // another model's namespace
  prompt.model = "";
  EXPECT_EQ(*client_->Lookup(TestLayout(), prompt), 32u);
  auto b = client_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->reused_prefix_tokens, 32u);
  ExpectContentMatchesPositions(b->id);
  auto stats = client_->GetStats(false);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->prefix_reused_tokens, 32u);
  EXPECT_EQ(stats->prefix_entries, 2u);
  EXPECT_EQ(stats->prefix_queries, 3u);
  EXPECT_EQ(stats->prefix_hits, 2u);

  // Bad input: a token id outside the vocabulary, named with its index.
  prompt.token_ids[3] = -5;
  auto bad = client_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("prompt_token_ids[3]"));
  EXPECT_EQ(client_->Publish(424242).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DaemonTest, ACompressedDocumentIsSharedOverGrpc) {
  const client::PolicySpec snap{"snapkv", {{"budget", 24}, {"window", 8}}};
  std::vector<int32_t> tokens(105);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 2000 + static_cast<int32_t>(i);
  auto a = client_->CreateSequence(TestLayout(), snap);
  ASSERT_TRUE(a.ok());
  const std::vector<int64_t> positions = testing::Range(0, 100);
  const std::string k = testing::Payload16(kL * kH, 0, 100, kD, 0);
  const std::string v = testing::Payload16(kL * kH, 0, 100, kD, 1);
  client::BlockTable table;
  ASSERT_TRUE(
      client_
          ->Append(a->id, {positions, absl::MakeConstSpan(tokens).first(100), k, v, {}, {}}, &table)
          .ok());
  client::CompressArgs compress;
  compress.epoch = table.epoch;
  for (uint32_t s = 0; s < kL * kH; ++s) {
    std::vector<float> row(100);
    for (uint32_t j = 0; j < 100; ++j) row[j] = static_cast<float>((j * 5 + s) % 17);
    compress.window_scores.push_back({s / kH, s % kH, row});
  }
  ASSERT_TRUE(client_->Compress(a->id, compress).ok());
  auto published = client_->PublishDocument(a->id);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(*published, 100u);

  client::Prompt prompt{tokens};
  prompt.document_tokens = 100;
  EXPECT_EQ(*client_->Lookup(TestLayout(), prompt, snap), 100u);
  EXPECT_EQ(*client_->Lookup(TestLayout(), prompt), 0u);  // "full": another representation
  auto b = client_->CreateSequence(TestLayout(), snap, std::nullopt, &prompt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->reused_prefix_tokens, 100u);
  auto ta = client_->GetBlockTable(a->id), tb = client_->GetBlockTable(b->id);
  ASSERT_TRUE(ta.ok() && tb.ok());
  for (size_t s = 0; s < ta->streams.size(); ++s) {
    EXPECT_EQ(tb->streams[s].positions, ta->streams[s].positions);  // 24 kept of 100
    EXPECT_EQ(tb->streams[s].positions.size(), 24u);
  }
  ExpectContentMatchesPositions(b->id);
  // A sequence changed since its Compress is no document.
  ASSERT_TRUE(AppendRange(a->id, 100, 1).ok());
  EXPECT_EQ(client_->PublishDocument(a->id).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A huge sequence's table comes in pieces: asked for whole past --max-message-bytes it is
// RESOURCE_EXHAUSTED naming `layers` (before, the daemon built and sent it whole however
// large); a layer range answers those layers only; the client joins the pieces.
TEST_F(DaemonTest, AHugeTableComesInPieces) {
  StartDaemon(64ull << 20, /*max_message_bytes=*/64 << 10);
  const uint64_t id = Create();
  // 8 streams x (4000 positions of 2 bytes + 250 block entries of 16) > 64 KiB
  constexpr int64_t kTokens = 4000;
  for (int64_t first = 0; first < kTokens; first += 25) {
    ASSERT_TRUE(AppendRange(id, first, 25).ok());
  }
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  v1::GetBlockTableRequest q;
  q.set_sequence_id(id);
  q.set_positions(true);
  v1::GetBlockTableResponse whole;
  grpc::ClientContext context;
  const grpc::Status refused = stub->GetBlockTable(&context, q, &whole);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("layers: the table of layers [0, 4)"));
  EXPECT_THAT(refused.error_message(), HasSubstr("--max-message-bytes"));
  q.mutable_layers()->set_begin(1);
  q.mutable_layers()->set_end(2);
  v1::GetBlockTableResponse piece;
  grpc::ClientContext piece_context;
  ASSERT_TRUE(stub->GetBlockTable(&piece_context, q, &piece).ok());
  ASSERT_EQ(piece.table().streams_size(), static_cast<int>(kH));
  EXPECT_EQ(piece.table().streams(0).layer(), 1u);
  EXPECT_EQ(piece.table().streams(0).positions_size(), kTokens);
  q.mutable_layers()->set_end(5);
  v1::GetBlockTableResponse past;
  grpc::ClientContext past_context;
  const grpc::Status bad = stub->GetBlockTable(&past_context, q, &past);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("layers: [1, 5)"));
  // The client asks in pieces and joins them; without positions one message holds it.
  auto table = client_->GetBlockTable(id, /*positions=*/true);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->streams.size(), kL * kH);
  for (uint32_t s = 0; s < kL * kH; ++s) {
    EXPECT_EQ(table->streams[s].layer * kH + table->streams[s].kv_head, s);
    EXPECT_EQ(table->streams[s].positions, testing::Range(0, kTokens)) << "stream " << s;
  }
  auto blocks = client_->GetBlockTable(id, /*positions=*/false);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  EXPECT_EQ(blocks->streams.size(), kL * kH);
  EXPECT_EQ(blocks->version, table->version);
}

TEST_F(DaemonTest, InfoListsPoliciesAndTheSharedPool) {
  auto info = client_->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->backend, "cpu");
  EXPECT_EQ(info->pool_bytes, 64ull << 20);
  ASSERT_GE(info->policies.size(), 2u);
  EXPECT_EQ(info->policies[1].name, "window");
  EXPECT_EQ(info->policies[1].params[0].default_value, 512);
  EXPECT_NE(info->shm_bytes, 0u);
  EXPECT_NE(info->epoch_slots, 0u);
  EXPECT_FALSE(info->attach.ticket.empty());
  EXPECT_FALSE(info->device_step);  // --device_step=auto on the CPU backend: host policy code
}

TEST(ServerConfigTest, DeviceStepIsAutoOnOrOff) {
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 1 << 20;
  config.device_step = "on";
  auto server = service::Server::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->engine().config().device_step);
  config.device_step = "sometimes";
  auto bad = service::Server::Start(config);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--device_step"));
}

// --pool-prefault: the whole pool is mapped by a thread of its own (where the kernel can).
TEST(ServerConfigTest, PrefaultMapsThePoolInTheBackground) {
  absl::Status supported = (*store::CpuBackend::Create(1 << 20))->Prefault(0, 1 << 20);
  if (supported.code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << supported;
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 16 << 20;
  auto off = service::Server::Start(config);
  ASSERT_TRUE(off.ok()) << off.status();
  config.prefault_pool = true;
  auto on = service::Server::Start(config);
  ASSERT_TRUE(on.ok()) << on.status();
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while ((*on)->prefaulted_bytes() < config.engine.pool_bytes && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*on)->prefaulted_bytes(), config.engine.pool_bytes);
  EXPECT_EQ((*off)->prefaulted_bytes(), 0u);
}

}  // namespace
}  // namespace kvmem

namespace kvmem {
namespace {

// A client made to wait for its daemon (wait_for_ready) gets an answer once the daemon
// listens; without it, a missing daemon is UNAVAILABLE (after gRPC's retries) quickly.
TEST(ClientRetryTest, WaitsForADaemonThatStartsLate) {
  const std::string socket = "unix:/tmp/kvmem-retry-" + std::to_string(getpid()) + ".sock";
  client::ClientOptions options;
  options.wait_for_ready = true;
  options.deadline = absl::Seconds(10);
  auto client = *client::Client::Connect(socket, options);
  std::unique_ptr<service::Server> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(400));
    service::ServerConfig config;
    config.listen = socket;
    config.engine.pool_bytes = 1 << 20;
    server = *service::Server::Start(config);
  });
  auto info = client->GetInfo();
  starter.join();
  EXPECT_TRUE(info.ok()) << info.status();
  options.wait_for_ready = false;
  auto lone = *client::Client::Connect("unix:/tmp/kvmem-nobody-here.sock", options);
  const absl::Time start = absl::Now();
  EXPECT_EQ(lone->GetInfo().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  options.max_attempts = 6;
  EXPECT_EQ(client::Client::Connect(socket, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvmem
