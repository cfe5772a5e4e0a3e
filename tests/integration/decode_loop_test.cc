// The decode loop through kvmemd: a client keeps its block tables from the updates its calls
// return (never fetching them), batches steps across sequences, and sends only the signals
// a policy uses.
#include <atomic>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

std::string Text(const client::BlockTable& t) {
  std::string out = absl::StrCat("epoch ", t.epoch, " version ", t.version, "\n");
  for (const client::StreamTable& st : t.streams) {
    for (const client::TableBlock& b : st.blocks) {
      absl::StrAppend(&out, b.id, "@", b.offset, "[", b.start, "+", b.count, "]",
                      static_cast<int>(b.precision), " ");
    }
    absl::StrAppend(&out, "|");
    for (int64_t p : st.positions) absl::StrAppend(&out, " ", p);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

class DecodeLoopTest : public DaemonTest {
 protected:
  static constexpr uint32_t kStreams = kL * kH;

  // One sequence's part of a round: its new token and random rows over its table + it.
  struct Entry {
    uint64_t id = 0;
    client::BlockTable table;
    int64_t next = 0;
    std::vector<int64_t> positions;
    std::string k, v;
  };

  client::BatchEntry MakeEntry(Entry& e, uint32_t n, std::mt19937& rng, bool f16) {
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    e.positions = testing::Range(e.next, n);
    e.k = testing::Payload16(kStreams, e.next, n, kD, 0);
    e.v = testing::Payload16(kStreams, e.next, n, kD, 1);
    client::StepArgs step;
    step.epoch = e.table.epoch;
    step.logit_stats = client::LogitStats{static_cast<float>(u(rng) * 3.0), 0.6f, 0.2f, {}};
    step.attention_f16 = f16;
    for (uint32_t s = 0; s < kStreams; ++s) {
      client::StreamSignal row{s / kH, s % kH, {}};
      for (size_t j = 0; j < e.table.streams[s].positions.size() + n; ++j) {
        row.values.push_back(u(rng));
      }
      step.attention.push_back(std::move(row));
    }
    client::BatchEntry entry;
    entry.sequence_id = e.id;
    entry.append = client::AppendArgs{e.positions, {}, e.k, e.v, {}, {}};
    entry.step = std::move(step);
    entry.table = &e.table;
    return entry;
  }
};

TEST_F(DecodeLoopTest, TablesKeptFromUpdatesMatchTheDaemonsAfterEveryBatch) {
  const std::vector<std::pair<std::string, std::map<std::string, double>>> policies = {
      {"full", {}},
      {"window", {{"window", 24}}},
      {"confkv", {{"c_high", 16}, {"c_low", 28}, {"protect", 4}}},
      {"h2o", {{"budget", 20}}}};
  std::vector<Entry> entries(policies.size());
  for (size_t i = 0; i < policies.size(); ++i) {
    entries[i].id = Create(policies[i].first, policies[i].second);
    auto table = client_->GetBlockTable(entries[i].id);  // attach (the only fetch)
    ASSERT_TRUE(table.ok()) << table.status();
    entries[i].table = *table;
  }
  std::mt19937 rng(1);
  int rewrites = 0;
  for (int round = 0; round < 80; ++round) {
    std::vector<client::BatchEntry> batch;
    const uint32_t n = round == 0 ? 20 : 1;
    for (Entry& e : entries) batch.push_back(MakeEntry(e, n, rng, round % 2 == 1));
    const std::vector<uint64_t> epochs = {entries[0].table.epoch, entries[1].table.epoch,
                                          entries[2].table.epoch, entries[3].table.epoch};
    absl::StatusOr<std::vector<client::BatchResult>> results = client_->StepBatch(batch);
    ASSERT_TRUE(results.ok()) << results.status();
    for (size_t i = 0; i < entries.size(); ++i) {
      ASSERT_TRUE((*results)[i].status.ok()) << policies[i].first << ": " << (*results)[i].status;
      ASSERT_TRUE((*results)[i].appended && (*results)[i].step);
      EXPECT_EQ((*results)[i].step->table_version, entries[i].table.version);
      entries[i].next += n;
      if (entries[i].table.epoch != epochs[i]) ++rewrites;
      auto fetched = client_->GetBlockTable(entries[i].id);
      ASSERT_TRUE(fetched.ok());
      ASSERT_EQ(Text(entries[i].table), Text(*fetched)) << policies[i].first << " round " << round;
    }
  }
  EXPECT_GT(rewrites, 100);
  EXPECT_EQ(client_->table_refetches(), 0u) << "every update applied as sent";
  // The tables name the right K/V: what ReadKv returns is what was appended there.
  for (const Entry& e : entries) ExpectContentMatchesPositions(e.id);
}

TEST_F(DecodeLoopTest, OneEntrysErrorFailsOnlyItAndChangesNothingOfIt) {
  Entry good, bad, gone;
  good.id = Create("h2o", {{"budget", 20}});  // uses attention rows: the epoch is checked
  bad.id = Create("window", {{"window", 24}});
  gone.id = Create("full");
  for (Entry* e : {&good, &bad, &gone}) e->table = *client_->GetBlockTable(e->id);
  ASSERT_TRUE(client_->Release(gone.id).ok());
  std::mt19937 rng(2);
  std::vector<client::BatchEntry> batch = {MakeEntry(good, 4, rng, false),
                                           MakeEntry(bad, 4, rng, false),
                                           MakeEntry(gone, 4, rng, false)};
  batch[1].append->positions = absl::MakeConstSpan(bad.positions).subspan(0, 3);  // k has 4
  const client::BlockTable before = *client_->GetBlockTable(bad.id);
  absl::StatusOr<std::vector<client::BatchResult>> results = client_->StepBatch(batch);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ((*results)[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE((*results)[1].appended.has_value());
  EXPECT_EQ(Text(*client_->GetBlockTable(bad.id)), Text(before));
  EXPECT_EQ((*results)[2].status.code(), absl::StatusCode::kNotFound);
  // The entry's status carries its google.rpc details like a call's would.
  EXPECT_TRUE((*results)[1].status.GetPayload(client::kFieldPayload).has_value());

  // A stale epoch: FAILED_PRECONDITION with the current epoch, the rest of the batch runs.
  good.next += 4;
  std::vector<client::BatchEntry> stale = {MakeEntry(good, 1, rng, false)};
  stale[0].step->epoch = 999999;
  results = client_->StepBatch(stale);
  ASSERT_TRUE(results.ok());
  EXPECT_EQ((*results)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::CurrentEpoch((*results)[0].status), good.table.epoch);

  // A sequence named twice: the batch as a whole is refused.
  // (Each entry's K/V in its own Entry: a second MakeEntry of `good` would free the first's;
  // AddressSanitizer found the test reading them.)
  Entry again = good;
  std::vector<client::BatchEntry> twice = {MakeEntry(good, 1, rng, false),
                                           MakeEntry(again, 1, rng, false)};
  results = client_->StepBatch(twice);
  EXPECT_EQ(results.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(results.status().message(), HasSubstr("entries[1].sequence_id"));
}

TEST_F(DecodeLoopTest, OnlyTheSignalsAPolicyUsesAreSent) {
  // `window` uses no attention rows: rows of a wrong length would be refused by the daemon,
  // so the step succeeding shows they never left the client. confkv uses them: refused.
  const uint64_t window = Create("window", {{"window", 8}});
  const uint64_t confkv = Create("confkv", {{"c_high", 8}, {"c_low", 12}, {"protect", 2}});
  for (uint64_t id : {window, confkv}) ASSERT_TRUE(AppendRange(id, 0, 10).ok());
  client::StepArgs args;
  args.logit_stats = client::LogitStats{1.0f, 0.5f, 0.3f, {}};
  for (uint32_t s = 0; s < kStreams; ++s) args.attention.push_back({s / kH, s % kH, {0.5f}});
  args.epoch = client_->GetBlockTable(window)->epoch;
  EXPECT_TRUE(client_->Step(window, args).ok());
  args.epoch = client_->GetBlockTable(confkv)->epoch;
  absl::StatusOr<client::StepResult> refused = client_->Step(confkv, args);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("attention["));
}

TEST_F(DecodeLoopTest, ThePlainCallsKeepATableTooAndAForkFollowsItsParentsTable) {
  const uint64_t id = Create("window", {{"window", 20}});
  client::BlockTable table = *client_->GetBlockTable(id, /*positions=*/false);
  EXPECT_FALSE(table.positions);
  positions_ = testing::Range(0, 30);
  k_ = testing::Payload16(kStreams, 0, 30, kD, 0);
  v_ = testing::Payload16(kStreams, 0, 30, kD, 1);
  ASSERT_TRUE(client_->Append(id, {positions_, {}, k_, v_, {}, {}}, &table).ok());
  client::StepArgs args;
  args.epoch = table.epoch;
  ASSERT_TRUE(client_->Step(id, args, &table).ok());  // evicts down to the window
  EXPECT_EQ(Text(table), Text(*client_->GetBlockTable(id, false)));
  EXPECT_TRUE(table.streams[0].positions.empty());

  absl::StatusOr<client::Sequence> child = client_->Fork(id);
  ASSERT_TRUE(child.ok());
  EXPECT_EQ(child->table_version, table.version);
  client::BlockTable child_table = table;  // carried over: same blocks, the child's epoch
  child_table.sequence_id = child->id;
  child_table.epoch = child->epoch;
  child_table.epoch_slot = child->epoch_slot;
  positions_ = testing::Range(30, 1);
  k_ = testing::Payload16(kStreams, 30, 1, kD, 0);
  v_ = testing::Payload16(kStreams, 30, 1, kD, 1);
  ASSERT_TRUE(client_->Append(child->id, {positions_, {}, k_, v_, {}, {}}, &child_table).ok());
  EXPECT_EQ(Text(child_table), Text(*client_->GetBlockTable(child->id, false)));
}

TEST_F(DecodeLoopTest, EntriesWhoseUpdatesPassedTheMessageLimitFetchTheirTables) {
  // A 64 KiB limit: 16 whole tables with positions (400 tokens: ~6.5 KiB each) do not fit,
  // so the daemon leaves the later entries' updates out; their tables must still end up
  // current (fetched), never left at the version they were.
  StartDaemon(64ull << 20, 64ull << 10);
  std::vector<Entry> entries(16);
  for (Entry& e : entries) {
    e.id = Create("full");
    for (int64_t first = 0; first < 400; first += 25) {
      ASSERT_TRUE(AppendRange(e.id, first, 25).ok());
    }
    e.next = 400;
    e.table.positions = true;  // none held yet (version 0): the update is the whole table
  }
  std::vector<client::BatchEntry> batch;
  for (Entry& e : entries) {
    e.positions = testing::Range(e.next, 1);
    e.k = testing::Payload16(kStreams, e.next, 1, kD, 0);
    e.v = testing::Payload16(kStreams, e.next, 1, kD, 1);
    client::BatchEntry entry;
    entry.sequence_id = e.id;
    entry.append = client::AppendArgs{e.positions, {}, e.k, e.v, {}, {}};
    entry.table = &e.table;
    batch.push_back(std::move(entry));
  }
  absl::StatusOr<std::vector<client::BatchResult>> results = client_->StepBatch(batch);
  ASSERT_TRUE(results.ok()) << results.status();
  for (size_t i = 0; i < entries.size(); ++i) {
    ASSERT_TRUE((*results)[i].status.ok()) << (*results)[i].status;
    auto fetched = client_->GetBlockTable(entries[i].id);
    ASSERT_TRUE(fetched.ok());
    EXPECT_EQ(entries[i].table.version, fetched->version) << "entry " << i;
    EXPECT_EQ(Text(entries[i].table), Text(*fetched)) << "entry " << i;
  }
  EXPECT_GT(client_->table_refetches(), 0u) << "the limit was not reached: the test is void";
}

TEST_F(DecodeLoopTest, ATableOfAnotherSequenceIsNeverKeptForThisOne) {
  // Versions are unique only within a sequence's history: a delta for B applied to A's
  // table would name A's blocks under B's epoch. The client replaces such a table.
  const uint64_t a = Create("full");
  const uint64_t b = Create("full");
  ASSERT_TRUE(AppendRange(a, 0, 40).ok());
  ASSERT_TRUE(AppendRange(b, 0, 3).ok());
  client::BlockTable table = *client_->GetBlockTable(a);
  positions_ = testing::Range(3, 1);
  k_ = testing::Payload16(kStreams, 3, 1, kD, 0);
  v_ = testing::Payload16(kStreams, 3, 1, kD, 1);
  ASSERT_TRUE(client_->Append(b, {positions_, {}, k_, v_, {}, {}}, &table).ok());
  EXPECT_EQ(table.sequence_id, b);
  EXPECT_EQ(Text(table), Text(*client_->GetBlockTable(b)));
  // The daemon did not know a's version for b: it answered with b's whole table.
  EXPECT_EQ(client_->table_refetches(), 0u);
}

TEST_F(DecodeLoopTest, AGuessedVersionGetsTheWholeTableWhileAnotherClientReadsIt) {
  // A unary call's update is computed after its mutation, under a lock of its own. A client
  // that claims the version its own Append will make (versions come from one counter) must
  // get the whole table even when another client is told that version in between, which
  // notes it as answered: else the claim earns the empty delta "current" and the client's
  // table silently lacks the appended token.
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 3).ok());
  client::ClientOptions options;
  options.deadline = absl::Seconds(20);
  std::unique_ptr<client::Client> reader =
      *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()), options);
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0};
  std::thread other([&] {
    while (!stop.load()) {
      if (reader->GetBlockTable(id, false).ok()) reads.fetch_add(1);
    }
  });
  for (int64_t next = 3; next < 603; ++next) {
    client::BlockTable table = *client_->GetBlockTable(id);
    const uint64_t guess = table.version + 1;  // nothing else changes this engine
    table.version = guess;
    positions_ = testing::Range(next, 1);
    k_ = testing::Payload16(kStreams, next, 1, kD, 0);
    v_ = testing::Payload16(kStreams, next, 1, kD, 1);
    ASSERT_TRUE(client_->Append(id, {positions_, {}, k_, v_, {}, {}}, &table).ok());
    ASSERT_EQ(table.version, guess) << "the guess must hit for the test to mean anything";
    ASSERT_EQ(Text(table), Text(*client_->GetBlockTable(id))) << "append of position " << next;
  }
  stop.store(true);
  other.join();
  EXPECT_GT(reads.load(), 100) << "the other client hardly read: the test is void";
}

}  // namespace
}  // namespace kvmem
