// The decode loop in place (kvmemd --in_place_writes): K/V written into the pool where a
// write plan says and attention rows in the step channel's signal area decode exactly as
// the same tokens and rows sent as message bytes; the area is read as untrusted input; an
// in-place entry's control bytes stay small.
#include <random>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/shared_pool.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "kvmem/v1/kvmem.pb.h"
#include "kvmem/v1/step_channel.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

class InPlaceTest : public DaemonTest {
 protected:
  static constexpr uint32_t kStreams = kL * kH;

  void SetUp() override {
    in_place_writes_ = true;
    DaemonTest::SetUp();
  }

  struct Seq {
    uint64_t id = 0;
    client::BlockTable table;
    client::WritePlan plan;
  };

  Seq Attach(uint64_t id) {
    Seq s;
    s.id = id;
    absl::StatusOr<client::BlockTable> table = client_->GetBlockTable(id);
    EXPECT_TRUE(table.ok()) << table.status();
    if (table.ok()) s.table = *table;
    return s;
  }

  // The first plan of a sequence: an entry that asks only for it.
  void FirstPlan(Seq& s) {
    client::BatchEntry entry;
    entry.sequence_id = s.id;
    entry.plan_tokens = 1;
    absl::StatusOr<std::vector<client::BatchResult>> out =
        client_->StepBatch(absl::MakeConstSpan(&entry, 1));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)[0].plan.has_value()) << (*out)[0].plan_status;
    s.plan = *(*out)[0].plan;
  }

  std::vector<client::StreamSignal> Rows(const client::BlockTable& table, uint32_t n,
                                         std::mt19937& rng) {
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    std::vector<client::StreamSignal> rows;
    for (uint32_t s = 0; s < kStreams; ++s) {
      client::StreamSignal row{s / kH, s % kH, {}};
      for (size_t j = 0; j < table.streams[s].positions.size() + n; ++j) {
        row.values.push_back(u(rng));
      }
      rows.push_back(std::move(row));
    }
    return rows;
  }
};

TEST_F(InPlaceTest, KvInPlaceAndRowsInTheAreaDecodeExactlyAsMessageBytes) {
  const std::vector<std::pair<std::string, std::map<std::string, double>>> policies = {
      {"confkv", {{"c_high", 16}, {"c_low", 28}, {"protect", 4}}},
      {"h2o", {{"budget", 20}}},
      {"window", {{"window", 24}}}};
  ASSERT_TRUE(client_->OpenStepChannel(std::nullopt, 1 << 20).ok());
  absl::StatusOr<client::Info> info = client_->GetInfo();
  ASSERT_TRUE(info.ok() && info->in_place_writes);
  absl::StatusOr<std::unique_ptr<client::SharedPool>> pool =
      client::SharedPool::Attach(*info, /*writable=*/true);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<Seq> bytes, placed;
  for (const auto& [policy, params] : policies) {
    const uint64_t a = Create(policy, params);
    const uint64_t b = Create(policy, params);
    for (uint64_t id : {a, b}) ASSERT_TRUE(AppendRange(id, 0, 20).ok());
    bytes.push_back(Attach(a));
    placed.push_back(Attach(b));
    FirstPlan(placed.back());
  }
  std::mt19937 rng(11);
  std::vector<int64_t> positions;
  for (int64_t next = 20; next < 100; ++next) {
    positions = {next};
    const std::string k = testing::Payload16(kStreams, next, 1, kD, 0);
    const std::string v = testing::Payload16(kStreams, next, 1, kD, 1);
    std::vector<client::BatchEntry> entries;
    const client::Client::SignalArea area = client_->signal_area();
    ASSERT_FALSE(area.bytes.empty());
    uint64_t offset = 0;
    for (size_t i = 0; i < policies.size(); ++i) {
      std::vector<client::StreamSignal> rows = Rows(bytes[i].table, 1, rng);
      client::StepArgs step;
      step.epoch = bytes[i].table.epoch;
      step.logit_stats = client::LogitStats{1.5f, 0.6f, 0.2f, {}};
      step.attention = rows;
      client::BatchEntry a;
      a.sequence_id = bytes[i].id;
      a.append = client::AppendArgs{positions, {}, k, v, {}, {}};
      a.step = step;
      a.table = &bytes[i].table;
      entries.push_back(a);

      ASSERT_TRUE((*pool)->WritePlanned(placed[i].plan, placed[i].table, 1, k, v).ok());
      absl::StatusOr<uint64_t> written = client::WriteAttentionRows(area.bytes, offset, rows,
                                                                    /*f16=*/i % 2 == 1);
      ASSERT_TRUE(written.ok()) << written.status();
      if (i % 2 == 1) {  // what the area carries, the message sends the same way
        entries.back().step->attention_f16 = true;
      }
      client::StepArgs in_area;
      in_area.epoch = placed[i].table.epoch;
      in_area.logit_stats = step.logit_stats;
      in_area.attention_offset = offset;
      offset += (*written + 7) / 8 * 8;
      client::BatchEntry b;
      b.sequence_id = placed[i].id;
      b.append = client::AppendArgs{positions, {}, {}, {}, {}, {}};
      b.written_plan = placed[i].plan.plan_id;
      b.step = in_area;
      b.table = &placed[i].table;
      b.plan_tokens = 1;
      entries.push_back(b);
    }
    absl::StatusOr<std::vector<client::BatchResult>> out = client_->StepBatch(entries);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < policies.size(); ++i) {
      const client::BatchResult& a = (*out)[2 * i];
      const client::BatchResult& b = (*out)[2 * i + 1];
      ASSERT_TRUE(a.status.ok()) << policies[i].first << ": " << a.status;
      ASSERT_TRUE(b.status.ok()) << policies[i].first << ": " << b.status;
      ASSERT_TRUE(b.plan.has_value()) << b.plan_status;
      placed[i].plan = *b.plan;
      ASSERT_EQ(a.step->evicted_tokens, b.step->evicted_tokens) << policies[i].first;
      absl::StatusOr<std::vector<client::StreamKv>> ka = client_->ReadKv(bytes[i].id);
      absl::StatusOr<std::vector<client::StreamKv>> kb = client_->ReadKv(placed[i].id);
      ASSERT_TRUE(ka.ok() && kb.ok());
      for (size_t s = 0; s < ka->size(); ++s) {
        ASSERT_EQ((*ka)[s].positions, (*kb)[s].positions) << policies[i].first << " " << next;
        ASSERT_EQ((*ka)[s].k, (*kb)[s].k);
        ASSERT_EQ((*ka)[s].v, (*kb)[s].v);
      }
      ExpectContentMatchesPositions(placed[i].id);
    }
    if (HasFailure()) return;
  }
  EXPECT_GT(client_->step_channel_batches(), 80u);
}

TEST_F(InPlaceTest, AHostileSignalAreaFailsOnlyTheEntryThatNamesIt) {
  ASSERT_TRUE(client_->OpenStepChannel(std::nullopt, 64 << 10).ok());
  const uint64_t good = Create("h2o", {{"budget", 20}});
  const uint64_t bad = Create("h2o", {{"budget", 20}});
  for (uint64_t id : {good, bad}) ASSERT_TRUE(AppendRange(id, 0, 8).ok());
  Seq g = Attach(good), b = Attach(bad);
  std::mt19937 rng(3);
  const client::Client::SignalArea area = client_->signal_area();
  ASSERT_EQ(area.bytes.size(), 64u << 10);
  namespace sa = v1::signal_area;
  struct Case {
    std::string name;
    uint64_t offset;
    std::function<void(uint8_t*)> write;
    std::string expect;
  };
  const auto header = [](uint32_t rows, uint32_t dtype) {
    return [rows, dtype](uint8_t* at) {
      const sa::RowsHeader h{rows, dtype};
      std::memcpy(at, &h, sizeof h);
    };
  };
  const std::vector<Case> cases = {
      {"past the end", (64 << 10) - 4, [](uint8_t*) {}, "outside the signal area"},
      {"far past the end", ~uint64_t{0} - 3, [](uint8_t*) {}, "outside the signal area"},
      {"no rows", 1024, header(0, 0), "rows (1 to"},
      {"too many rows", 1024, header(sa::kMaxRows + 1, 0), "rows (1 to"},
      {"bad dtype", 1024, header(kStreams, 7), "dtype"},
      {"rows past the end", 1024,
       [](uint8_t* at) {
         const sa::RowsHeader h{kStreams, sa::kF32};
         std::memcpy(at, &h, sizeof h);
         for (uint32_t s = 0; s < kStreams; ++s) {
           const sa::RowEntry e{s / kH, s % kH, 0xFFFFFFFFu, 0};
           std::memcpy(at + 8 + 16 * s, &e, sizeof e);
         }
       },
       "outside the signal area"},
      {"rows a stream short", 1024,
       [&](uint8_t* at) {
         std::vector<client::StreamSignal> rows = Rows(b.table, 1, rng);
         rows.pop_back();
         ASSERT_TRUE(client::WriteAttentionRows(absl::MakeSpan(at, 8192), 0, rows, false).ok());
       },
       "attention"},
      {"a NaN in a row", 1024,
       [&](uint8_t* at) {
         std::vector<client::StreamSignal> rows = Rows(b.table, 0, rng);
         rows[3].values[1] = std::nanf("");
         ASSERT_TRUE(client::WriteAttentionRows(absl::MakeSpan(at, 8192), 0, rows, false).ok());
       },
       "attention"},
  };
  for (const Case& c : cases) {
    if (c.offset < area.bytes.size()) c.write(area.bytes.data() + c.offset);
    std::vector<client::StreamSignal> rows = Rows(g.table, 0, rng);
    ASSERT_TRUE(client::WriteAttentionRows(area.bytes, 0, rows, false).ok());
    client::BatchEntry eg, eb;
    eg.sequence_id = good;
    eg.step = client::StepArgs{g.table.epoch, {}, {}, false, 0};
    eg.table = &g.table;
    eb.sequence_id = bad;
    eb.step = client::StepArgs{b.table.epoch, {}, {}, false, c.offset};
    eb.table = &b.table;
    const client::BatchEntry both[] = {eg, eb};
    absl::StatusOr<std::vector<client::BatchResult>> out = client_->StepBatch(both);
    ASSERT_TRUE(out.ok()) << c.name << ": " << out.status();
    EXPECT_TRUE((*out)[0].status.ok()) << c.name << ": " << (*out)[0].status;
    EXPECT_EQ((*out)[1].status.code(), absl::StatusCode::kInvalidArgument)
        << c.name << ": " << (*out)[1].status;
    EXPECT_THAT(std::string((*out)[1].status.message()), HasSubstr(c.expect)) << c.name;
    EXPECT_FALSE((*out)[1].step.has_value()) << c.name;
  }
  // Entries that name the same bytes copy the area once, not once each: past its size in
  // all, the batch's later entries are refused (before anything is allocated for them).
  {
    std::vector<client::StreamSignal> big;
    for (uint32_t s = 0; s < kStreams; ++s)
      big.push_back({s / kH, s % kH, std::vector<float>(1200, 0.5f)});
    ASSERT_TRUE(client::WriteAttentionRows(area.bytes, 0, big, false).ok());  // ~38 KiB of 64
    client::BatchEntry e1, e2;
    e1.sequence_id = good;
    e1.step = client::StepArgs{g.table.epoch, {}, {}, false, 0};
    e2.sequence_id = bad;
    e2.step = client::StepArgs{b.table.epoch, {}, {}, false, 0};
    const client::BatchEntry both[] = {e1, e2};
    absl::StatusOr<std::vector<client::BatchResult>> twice = client_->StepBatch(both);
    ASSERT_TRUE(twice.ok()) << twice.status();
    EXPECT_EQ((*twice)[1].status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string((*twice)[1].status.message()),
                HasSubstr("more bytes of the signal area"));
  }
  // Over gRPC there is no area to name (the C++ client moves the rows into the message
  // then: a raw call here).
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  v1::StepBatchRequest q;
  v1::StepBatchEntry* entry = q.add_entries();
  entry->set_sequence_id(bad);
  entry->mutable_step()->set_epoch(b.table.epoch);
  entry->mutable_step()->set_attention_offset(0);
  v1::StepBatchResponse r;
  grpc::ClientContext context;
  ASSERT_TRUE(stub->StepBatch(&context, q, &r).ok());
  EXPECT_EQ(r.results(0).status().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.results(0).status().message(), HasSubstr("step channel"));
  ExpectContentMatchesPositions(good);
  ExpectContentMatchesPositions(bad);
}

// What crosses the control path for one in-place decode entry of a SmolLM2-shape sequence
// (90 streams): ids, versions, the plan, offsets; no K/V, no row.
TEST(InPlaceEntryTest, AnInPlaceDecodeEntryTakesAtMost256BytesOfTheBatch) {
  v1::StepBatchRequest batch;
  for (int i = 0; i < 64; ++i) {
    v1::StepBatchEntry* e = batch.add_entries();
    e->set_sequence_id(1'000'000 + i);
    e->mutable_append()->add_positions(131'072 + i);
    e->mutable_append()->add_token_ids(49'151);
    e->mutable_append()->set_plan_id(uint64_t{1} << 40);
    e->mutable_step()->set_epoch(uint64_t{1} << 40);
    e->mutable_step()->mutable_logit_stats()->set_entropy(3.25f);
    e->mutable_step()->mutable_logit_stats()->set_p1(0.5f);
    e->mutable_step()->mutable_logit_stats()->set_p2(0.25f);
    e->mutable_step()->set_attention_offset(uint64_t{1} << 29);
    e->mutable_client_table()->set_version(uint64_t{1} << 40);
    e->set_plan_tokens(1);
  }
  batch.set_request_id(std::string(32, 'f'));
  EXPECT_LE(batch.ByteSizeLong() / 64, 256u) << batch.ByteSizeLong() << " bytes for 64 entries";
}

}  // namespace
}  // namespace kvmem
