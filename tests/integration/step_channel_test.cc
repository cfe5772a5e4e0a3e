// The same-host step channel: StepBatch through shared memory gives exactly what gRPC's
// StepBatch gives; the daemon reads the segment as untrusted input (garbage, lengths past
// the area; its size sealed against shrinking); channels are bounded, end with their client,
// and their descriptors go only to their opener.
// (The client against a fake daemon and the channel alone: step_channel_unit_test.cc.)
#include "kvmem/v1/step_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/attach.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/service/error_details.h"
#include "server/service/kv_cache_service.h"
#include "server/transport/step_channel.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;
namespace layout = v1::step_channel;
// A table as text; without `where`, the blocks' places in the pool are left out (two
// sequences with the same history have the same table but other blocks and versions).
std::string TableText(const client::BlockTable& t, bool where = true) {
  std::string out = where ? absl::StrCat("version ", t.version, "\n") : "";
  for (const client::StreamTable& st : t.streams) {
    for (const client::TableBlock& b : st.blocks) {
      if (where) absl::StrAppend(&out, b.offset);
      absl::StrAppend(&out, "[", b.start, "+", b.count, "]", static_cast<int>(b.precision), " ");
    }
    absl::StrAppend(&out, "|");
    for (int64_t p : st.positions) absl::StrAppend(&out, " ", p);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

// A channel opened with the raw stub, its segment mapped by the test: the protocol as a
// client that does not use the C++ client library (or misuses it) would speak it.
struct RawChannel {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::OpenStepChannelResponse>> reader;
  v1::OpenStepChannelResponse opened;
  int fd = -1;
  uint8_t* data = nullptr;
  uint32_t seq = 0;

  layout::Header* header() { return reinterpret_cast<layout::Header*>(data); }

  // Posts `bytes` as the request (request_bytes = `claimed`, or the real length).
  void Post(const std::string& bytes, std::optional<uint32_t> claimed = std::nullopt) {
    std::memcpy(data + layout::kHeaderBytes, bytes.data(), bytes.size());
    header()->request_bytes = claimed.value_or(static_cast<uint32_t>(bytes.size()));
    header()->request_kind = layout::kBatch;
    header()->request_seq.store(++seq, std::memory_order_release);
    layout::FutexWakeAll(&header()->request_seq);
  }
  // The answer to the last Post: its code and body.
  std::pair<uint32_t, std::string> Answer() {
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (header()->response_seq.load(std::memory_order_acquire) != seq && absl::Now() < end) {
      layout::FutexWait(&header()->response_seq, header()->response_seq.load(), 10'000'000);
    }
    EXPECT_EQ(header()->response_seq.load(), seq) << "no answer";
    const uint8_t* body = data + layout::kHeaderBytes + opened.capacity_bytes();
    return {header()->response_code.load(),
            std::string(reinterpret_cast<const char*>(body), header()->response_bytes.load())};
  }
  grpc::Status Close() {
    context.TryCancel();
    v1::OpenStepChannelResponse more;
    while (reader->Read(&more)) {
    }
    return reader->Finish();
  }
  ~RawChannel() {
    if (data != nullptr) munmap(data, opened.segment_bytes());
    if (fd >= 0) close(fd);
  }
};

// The field a channel error's google.rpc.BadRequest names ("" when it carries none).
std::string ViolatedField(const google::rpc::Status& rich) {
  for (const google::protobuf::Any& detail : rich.details()) {
    google::rpc::BadRequest bad;
    if (detail.UnpackTo(&bad) && bad.field_violations_size() > 0) {
      return bad.field_violations(0).field();
    }
  }
  return "";
}

class StepChannelTest : public DaemonTest {
 protected:
  static constexpr uint32_t kStreams = kL * kH;

  std::unique_ptr<v1::KvCache::Stub> Stub() {
    return v1::KvCache::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                                    grpc::InsecureChannelCredentials()));
  }

  // Opens a raw channel; false (with the call's status in *status) when refused.
  bool OpenRaw(v1::KvCache::Stub* stub, RawChannel* ch, std::optional<uint64_t> capacity,
               grpc::Status* status = nullptr) {
    v1::OpenStepChannelRequest q;
    if (capacity) q.set_capacity_bytes(*capacity);
    ch->reader = stub->OpenStepChannel(&ch->context, q);
    if (!ch->reader->Read(&ch->opened)) {
      grpc::Status s = ch->reader->Finish();
      if (status != nullptr) *status = s;
      return false;
    }
    // The segment by descriptor, as the client library receives it.
    auto received = client::ReceiveSegments(
        {ch->opened.attach().socket(), ch->opened.attach().ticket()}, "channel");
    EXPECT_TRUE(received.ok()) << received.status();
    if (!received.ok()) return false;
    for (const client::ReceivedSegment& r : *received) {
      if (r.kind == v1::attach::kChannel) {
        ch->fd = r.fd;
      } else {
        close(r.fd);
      }
    }
    EXPECT_GE(ch->fd, 0);
    void* m =
        mmap(nullptr, ch->opened.segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, ch->fd, 0);
    EXPECT_NE(m, MAP_FAILED);
    ch->data = static_cast<uint8_t*>(m);
    return true;
  }

  // One decode round for a sequence: its next token, logit stats and attention rows.
  client::BatchEntry Round(uint64_t id, client::BlockTable* table, int64_t next, uint32_t n,
                           std::mt19937& rng, std::vector<int64_t>* positions, std::string* k,
                           std::string* v) {
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    *positions = testing::Range(next, n);
    *k = testing::Payload16(kStreams, next, n, kD, 0);
    *v = testing::Payload16(kStreams, next, n, kD, 1);
    client::StepArgs step;
    step.epoch = table->epoch;
    step.logit_stats = client::LogitStats{static_cast<float>(u(rng) * 3.0), 0.6f, 0.2f, {}};
    for (uint32_t s = 0; s < kStreams; ++s) {
      client::StreamSignal row{s / kH, s % kH, {}};
      for (size_t j = 0; j < table->streams[s].positions.size() + n; ++j) {
        row.values.push_back(u(rng));
      }
      step.attention.push_back(std::move(row));
    }
    client::BatchEntry entry;
    entry.sequence_id = id;
    entry.append = client::AppendArgs{*positions, {}, *k, *v, {}, {}};
    entry.step = std::move(step);
    entry.table = table;
    return entry;
  }

  // A raw StepBatchRequest of one entry appending tokens [0, n) to `id` (no request_id).
  static v1::StepBatchRequest AppendOnly(uint64_t id, uint32_t n) {
    v1::StepBatchRequest q;
    v1::StepBatchEntry* e = q.add_entries();
    e->set_sequence_id(id);
    v1::NewTokens* chunk = e->mutable_append();
    const std::vector<int64_t> pos = testing::Range(0, n);
    chunk->mutable_positions()->Add(pos.begin(), pos.end());
    chunk->set_k(testing::Payload16(kStreams, 0, n, kD, 0));
    chunk->set_v(testing::Payload16(kStreams, 0, n, kD, 1));
    return q;
  }

  uint64_t Appended(uint64_t id) {
    auto stats = client_->GetStats(true);
    EXPECT_TRUE(stats.ok()) << stats.status();
    for (const client::SequenceStats& s : stats->sequences) {
      if (s.sequence_id == id) return s.appended_tokens;
    }
    return ~0ull;
  }
};

TEST_F(StepChannelTest, GivesExactlyWhatGrpcGivesForTheSameWorkload) {
  auto grpc_only = client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()));
  ASSERT_TRUE(grpc_only.ok());
  ASSERT_TRUE(client_->OpenStepChannel().ok());
  ASSERT_TRUE(client_->step_channel_open());
  const std::vector<std::pair<std::string, std::map<std::string, double>>> policies = {
      {"full", {}},
      {"window", {{"window", 24}}},
      {"confkv", {{"c_high", 16}, {"c_low", 28}, {"protect", 4}}},
      {"h2o", {{"budget", 20}}}};
  struct Side {
    client::Client* c;
    std::vector<uint64_t> ids;
    std::vector<client::BlockTable> tables;
  };
  Side sides[2] = {{client_.get(), {}, {}}, {grpc_only->get(), {}, {}}};
  for (Side& side : sides) {
    for (const auto& [name, params] : policies) {
      auto seq = side.c->CreateSequence(TestLayout(), {name, params});
      ASSERT_TRUE(seq.ok()) << seq.status();
      side.ids.push_back(seq->id);
      auto table = side.c->GetBlockTable(seq->id);
      ASSERT_TRUE(table.ok());
      side.tables.push_back(*table);
    }
  }
  // The same random draws on both sides: one generator per side, same seed.
  std::mt19937 rngs[2] = {std::mt19937(7), std::mt19937(7)};
  int64_t next = 0;
  for (int round = 0; round < 60; ++round) {
    const uint32_t n = round == 0 ? 20 : 1;
    std::vector<client::BatchResult> results[2];
    for (int side = 0; side < 2; ++side) {
      std::vector<std::vector<int64_t>> positions(policies.size());
      std::vector<std::string> k(policies.size()), v(policies.size());
      std::vector<client::BatchEntry> batch;
      for (size_t i = 0; i < policies.size(); ++i) {
        batch.push_back(Round(sides[side].ids[i], &sides[side].tables[i], next, n, rngs[side],
                              &positions[i], &k[i], &v[i]));
      }
      auto r = sides[side].c->StepBatch(batch);
      ASSERT_TRUE(r.ok()) << r.status();
      results[side] = *std::move(r);
    }
    next += n;
    for (size_t i = 0; i < policies.size(); ++i) {
      ASSERT_TRUE(results[0][i].status.ok()) << results[0][i].status;
      ASSERT_TRUE(results[0][i].step && results[1][i].step);
      EXPECT_EQ(results[0][i].step->evicted_tokens, results[1][i].step->evicted_tokens);
      ASSERT_EQ(TableText(sides[0].tables[i], false), TableText(sides[1].tables[i], false))
          << policies[i].first << " round " << round;
      auto fetched = client_->GetBlockTable(sides[0].ids[i]);
      ASSERT_TRUE(fetched.ok());
      ASSERT_EQ(TableText(sides[0].tables[i]), TableText(*fetched)) << "round " << round;
    }
  }
  EXPECT_EQ(client_->step_channel_batches(), 60u) << "every batch went through the channel";
  EXPECT_EQ((*grpc_only)->step_channel_batches(), 0u);
  EXPECT_EQ(client_->table_refetches(), 0u);
  for (size_t i = 0; i < policies.size(); ++i) {
    auto a = client_->ReadKv(sides[0].ids[i]);
    auto b = client_->ReadKv(sides[1].ids[i]);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->size(), b->size());
    for (size_t s = 0; s < a->size(); ++s) {
      EXPECT_EQ((*a)[s].positions, (*b)[s].positions);
      EXPECT_EQ((*a)[s].k, (*b)[s].k);
      EXPECT_EQ((*a)[s].v, (*b)[s].v);
    }
    ExpectContentMatchesPositions(sides[0].ids[i]);
  }
}

TEST_F(StepChannelTest, PerEntryErrorsAndRequestsPastTheAreaBehaveAsOverGrpc) {
  ASSERT_TRUE(client_->OpenStepChannel(1ull << 20).ok());
  const uint64_t id = Create("window", {{"window", 64}});
  client::BlockTable table = *client_->GetBlockTable(id);
  std::mt19937 rng(1);
  std::vector<int64_t> positions;
  std::string k, v;
  // An unknown sequence next to a good one: NOT_FOUND for it alone.
  std::vector<client::BatchEntry> batch;
  batch.push_back(Round(id, &table, 0, 4, rng, &positions, &k, &v));
  client::BatchEntry unknown;
  unknown.sequence_id = 987654;
  unknown.step = client::StepArgs{};
  batch.push_back(unknown);
  auto r = client_->StepBatch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].status.ok());
  EXPECT_EQ((*r)[1].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->step_channel_batches(), 1u);
  // A batch-wide error (the same sequence twice) comes back as the call's status.
  std::vector<client::BatchEntry> twice = {Round(id, &table, 4, 1, rng, &positions, &k, &v)};
  twice.push_back(twice[0]);
  twice[1].table = nullptr;
  auto bad = client_->StepBatch(twice);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Appended(id), 4u) << "nothing of the refused batch applied";
  // 1.5 MiB of K/V does not fit a 1 MiB area: it goes by gRPC, and applies once.
  const uint32_t n = (3u << 19) / (kStreams * kD * 2 * 2) + 1;
  auto big = client_->StepBatch({Round(id, &table, 4, n, rng, &positions, &k, &v)});
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_TRUE((*big)[0].status.ok()) << (*big)[0].status;
  EXPECT_EQ(client_->step_channel_batches(), 2u) << "the large batch went by gRPC";
  EXPECT_EQ(Appended(id), 4u + n);
  auto fetched = client_->GetBlockTable(id);
  EXPECT_EQ(TableText(table), TableText(*fetched));
}

TEST_F(StepChannelTest, GarbageLengthsAndMissingIdsGetErrorsAndTheChannelServesOn) {
  const uint64_t id = Create("full");
  auto stub = Stub();
  RawChannel ch;
  ASSERT_TRUE(OpenRaw(stub.get(), &ch, std::nullopt));
  EXPECT_EQ(ch.opened.capacity_bytes(), transport::StepChannel::kDefaultCapacity);
  EXPECT_EQ(ch.opened.layout_version(), layout::kLayoutVersion);

  ch.Post(std::string("\xff\xff\xff\xff\x0f garbage", 13));
  auto [code, body] = ch.Answer();
  EXPECT_EQ(code, static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  google::rpc::Status rich;
  ASSERT_TRUE(rich.ParseFromString(body));
  EXPECT_THAT(rich.message(), HasSubstr("StepBatchRequest"));
  EXPECT_EQ(ViolatedField(rich), "request");

  ch.Post("", ch.opened.capacity_bytes() + 1);
  std::tie(code, body) = ch.Answer();
  EXPECT_EQ(code, static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  ASSERT_TRUE(rich.ParseFromString(body));
  EXPECT_THAT(rich.message(), HasSubstr("request_bytes"));
  EXPECT_EQ(ViolatedField(rich), "request_bytes");

  v1::StepBatchRequest q = AppendOnly(id, 2);
  ch.Post(q.SerializeAsString());  // no request_id
  std::tie(code, body) = ch.Answer();
  EXPECT_EQ(code, static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  ASSERT_TRUE(rich.ParseFromString(body));
  EXPECT_THAT(rich.message(), HasSubstr("request_id"));
  EXPECT_EQ(ViolatedField(rich), "request_id");
  EXPECT_EQ(Appended(id), 0u);

  q.set_request_id("raw-1");
  ch.Post(q.SerializeAsString());
  std::tie(code, body) = ch.Answer();
  ASSERT_EQ(code, 0u);
  v1::StepBatchResponse response;
  ASSERT_TRUE(response.ParseFromString(body));
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).status().code(), 0);
  EXPECT_EQ(Appended(id), 2u);
  // The same request id again: the first answer, not a second append.
  ch.Post(q.SerializeAsString());
  std::tie(code, body) = ch.Answer();
  EXPECT_EQ(code, 0u);
  EXPECT_EQ(Appended(id), 2u);
  EXPECT_EQ(ch.Close().error_code(), grpc::StatusCode::CANCELLED);
}

// A client cannot shrink its channel's segment under the daemon's reads (its size is
// sealed), so a batch it posts after trying runs as any other.
TEST_F(StepChannelTest, AClientCannotShrinkItsSegment) {
  const uint64_t id = Create("full");
  auto stub = Stub();
  RawChannel ch;
  ASSERT_TRUE(OpenRaw(stub.get(), &ch, std::nullopt));
  EXPECT_NE(ftruncate(ch.fd, layout::kHeaderBytes), 0);
  EXPECT_EQ(errno, EPERM);
  v1::StepBatchRequest q = AppendOnly(id, 64);
  q.set_request_id("not-shrunk");
  ch.Post(q.SerializeAsString());
  auto [code, body] = ch.Answer();
  EXPECT_EQ(code, 0u);
  EXPECT_EQ(Appended(id), 64u);
  ExpectContentMatchesPositions(id);
}

// A channel's descriptors go to its opener only: a ticket is bound to the channel it was
// issued for (another ticket, a forged one, or one whose channel closed gets nothing).
TEST_F(StepChannelTest, AChannelsDescriptorsGoOnlyWithItsOwnTicket) {
  auto stub = Stub();
  RawChannel a, b;
  ASSERT_TRUE(OpenRaw(stub.get(), &a, 1ull << 20));
  ASSERT_TRUE(OpenRaw(stub.get(), &b, 1ull << 20));
  EXPECT_NE(a.opened.attach().ticket(), b.opened.attach().ticket());
  // b's ticket maps b's segment, never a's: the nonces differ.
  EXPECT_NE(std::memcmp(a.header()->nonce, b.header()->nonce, layout::kNonceBytes), 0);
  std::string forged = a.opened.attach().ticket();
  forged[0] = static_cast<char>(forged[0] ^ 1);
  auto refused = client::ReceiveSegments({a.opened.attach().socket(), forged}, "forged");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  const client::SegmentTicket closed{a.opened.attach().socket(), a.opened.attach().ticket()};
  a.Close();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (server_->service().step_channels_open() != 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto gone = client::ReceiveSegments(closed, "closed");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
}

TEST_F(StepChannelTest, ChannelsAreBoundedAndEndWithTheirClient) {
  limits_.max_step_channels = 2;
  limits_.step_channel_bytes = 80ull << 20;  // one 8 MiB channel holds ~64.3 MiB, 1 MiB ~8.3
  StartDaemon(64ull << 20);
  auto stub = Stub();
  grpc::Status status;
  RawChannel small;
  EXPECT_FALSE(OpenRaw(stub.get(), &small, 4096, &status));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("capacity_bytes"));
  RawChannel huge;
  EXPECT_FALSE(OpenRaw(stub.get(), &huge, 1ull << 40, &status));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  RawChannel a, b, c;
  ASSERT_TRUE(OpenRaw(stub.get(), &a, 8ull << 20));
  EXPECT_FALSE(OpenRaw(stub.get(), &b, 8ull << 20, &status)) << "2 x 64.3 MiB > 80 MiB";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--step-channel-bytes"));
  RawChannel b2;
  ASSERT_TRUE(OpenRaw(stub.get(), &b2, 1ull << 20));
  EXPECT_FALSE(OpenRaw(stub.get(), &c, 1ull << 20, &status));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max-step-channels"));
  EXPECT_EQ(server_->service().step_channels_open(), 2u);

  // A client that goes away (its call cancelled, as when a worker dies) frees its channel.
  a.Close();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (server_->service().step_channels_open() != 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->service().step_channels_open(), 1u);
  // The C++ client's channel too.
  client_->CloseStepChannel();
  ASSERT_TRUE(client_->OpenStepChannel(1ull << 20).ok());
  EXPECT_EQ(server_->service().step_channels_open(), 2u);
  client_.reset();
  while (server_->service().step_channels_open() != 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->service().step_channels_open(), 1u);
  b2.Close();
}

TEST_F(StepChannelTest, ADrainEndsTheChannelAndTheClientGetsUnavailable) {
  ASSERT_TRUE(client_->OpenStepChannel().ok());
  const uint64_t id = Create("window", {{"window", 16}});
  client::BlockTable table = *client_->GetBlockTable(id);
  std::mt19937 rng(3);
  std::vector<int64_t> positions;
  std::string k, v;
  ASSERT_TRUE(client_->StepBatch({Round(id, &table, 0, 8, rng, &positions, &k, &v)}).ok());
  // An idle channel does not hold the drain up to its deadline: it ends at once.
  const absl::Time drain_start = absl::Now();
  server_->Drain(absl::Seconds(30));
  EXPECT_LT(absl::Now() - drain_start, absl::Seconds(5));
  const absl::Time start = absl::Now();
  auto r = client_->StepBatch({Round(id, &table, 8, 1, rng, &positions, &k, &v)});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_FALSE(client_->step_channel_open());
}

}  // namespace
}  // namespace kvmem
