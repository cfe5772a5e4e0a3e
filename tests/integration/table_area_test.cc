// The table area (kvmemd --table_area_bytes): a client that reads its tables there holds,
// after every StepBatch, exactly the table GetBlockTable answers, with no update sent; a
// table that finds no room falls back to updates; a released sequence's slot holds nothing;
// a reader racing the daemon's rewrites never accepts a torn table.
#include "kvmem/table_area.h"

#include <atomic>
#include <deque>
#include <map>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

class TableAreaTest : public DaemonTest {
 protected:
  static constexpr uint32_t kStreams = kL * kH;

  void SetUp() override {
    table_area_bytes_ = 1 << 20;
    DaemonTest::SetUp();
  }

  // Blocks of every stream, to compare two tables by what a reader uses.
  static std::vector<std::vector<std::tuple<uint32_t, uint64_t, uint32_t, uint32_t, int>>> Blocks(
      const client::BlockTable& t) {
    std::vector<std::vector<std::tuple<uint32_t, uint64_t, uint32_t, uint32_t, int>>> out;
    for (const client::StreamTable& st : t.streams) {
      out.emplace_back();
      for (const client::TableBlock& b : st.blocks) {
        out.back().emplace_back(b.id, b.offset, b.start, b.count, static_cast<int>(b.precision));
      }
    }
    return out;
  }

  // What an entry's append points at, kept until its batch is done.
  struct Tokens {
    std::vector<int64_t> positions;
    std::string k, v;
  };
  std::deque<Tokens> tokens_;

  // One decode entry: a token at `position` with rows over the table and the new token.
  client::BatchEntry Entry(uint64_t id, int64_t position, client::BlockTable* table,
                           std::mt19937& rng) {
    client::BatchEntry e;
    e.sequence_id = id;
    Tokens& t = tokens_.emplace_back();
    t.positions = {position};
    t.k = testing::Payload16(kStreams, position, 1, kD, 0);
    t.v = testing::Payload16(kStreams, position, 1, kD, 1);
    client::AppendArgs append;
    append.positions = t.positions;
    append.k = t.k;
    append.v = t.v;
    e.append = append;
    client::StepArgs step;
    step.epoch = table->epoch;
    step.logit_stats = client::LogitStats{1.0f, 0.6f, 0.2f};
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    for (uint32_t s = 0; s < kStreams; ++s) {
      uint32_t live = 0;
      for (const client::TableBlock& b : table->streams[s].blocks) live += b.count;
      client::StreamSignal row{s / kH, s % kH, {}};
      for (uint32_t j = 0; j < live + 1; ++j) row.values.push_back(u(rng));
      step.attention.push_back(std::move(row));
    }
    e.step = std::move(step);
    e.table = table;
    return e;
  }
};

TEST_F(TableAreaTest, TablesReadFromTheAreaEqualTheDaemonsAfterEveryStep) {
  const std::vector<std::pair<std::string, std::map<std::string, double>>> policies = {
      {"confkv", {{"c_high", 70}, {"c_low", 90}, {"protect", 4}}},
      {"h2o", {{"budget", 80}}},
      {"window", {{"window", 100}}},
      {"full", {}}};
  ASSERT_TRUE(client_->AttachTableArea().ok());
  std::vector<uint64_t> ids;
  std::vector<client::BlockTable> tables;
  // Tables of several blocks a stream, so that a step leaves a run of them in the middle
  // untouched (the area moves it as a whole when the front block goes).
  constexpr int64_t kPrompt = 120;
  for (const auto& [name, params] : policies) {
    ids.push_back(Create(name, params));
    ASSERT_TRUE(AppendRange(ids.back(), 0, kPrompt).ok());
    // Without positions: a table the area can keep current.
    absl::StatusOr<client::BlockTable> t = client_->GetBlockTable(ids.back(), false);
    ASSERT_TRUE(t.ok()) << t.status();
    tables.push_back(*t);
  }
  const uint64_t refetches = client_->table_refetches();
  std::mt19937 rng(7);
  for (int64_t step = 0; step < 60; ++step) {
    std::vector<client::BatchEntry> entries;
    for (size_t i = 0; i < ids.size(); ++i) {
      entries.push_back(Entry(ids[i], kPrompt + step, &tables[i], rng));
    }
    absl::StatusOr<std::vector<client::BatchResult>> out = client_->StepBatch(entries);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << policies[i].first << ": " << (*out)[i].status;
      absl::StatusOr<client::BlockTable> fetched = client_->GetBlockTable(ids[i]);
      ASSERT_TRUE(fetched.ok());
      ASSERT_EQ(tables[i].version, fetched->version) << policies[i].first << " step " << step;
      ASSERT_EQ(tables[i].epoch, fetched->epoch);
      ASSERT_EQ(Blocks(tables[i]), Blocks(*fetched)) << policies[i].first << " step " << step;
    }
  }
  EXPECT_EQ(client_->table_refetches(), refetches) << "no table had to be fetched";
  EXPECT_EQ(client_->table_area_reads(), 60 * ids.size()) << "every table came from the area";
  for (uint64_t id : ids) ExpectContentMatchesPositions(id);
}

// Tables through a sequence's whole life in the area: a fork (a new record from a copied
// sequence), a compression (most blocks go: the record shrinks), a release and a new
// sequence in the freed slot; after every call the area's table is the daemon's.
TEST_F(TableAreaTest, ForksCompressionsAndReusedSlotsKeepTheAreasTablesExact) {
  ASSERT_TRUE(client_->AttachTableArea().ok());
  absl::StatusOr<client::Info> info = client_->GetInfo();
  ASSERT_TRUE(info.ok());
  absl::StatusOr<std::unique_ptr<client::TableReader>> reader = client::TableReader::Attach(*info);
  ASSERT_TRUE(reader.ok()) << reader.status();
  struct Live {
    uint64_t id = 0;
    client::BlockTable table;
    int64_t next = 0;
  };
  std::vector<Live> live;
  auto start = [&](int64_t prompt) {
    Live l;
    l.id = Create("h2o", {{"budget", 80}});
    EXPECT_TRUE(AppendRange(l.id, 0, static_cast<uint32_t>(prompt)).ok());
    l.table = *client_->GetBlockTable(l.id, false);
    l.next = prompt;
    live.push_back(std::move(l));
  };
  // After every change: the area's copy, read fresh, is the daemon's table.
  auto check = [&](const std::string& at) {
    for (const Live& l : live) {
      absl::StatusOr<client::BlockTable> fetched = client_->GetBlockTable(l.id, false);
      ASSERT_TRUE(fetched.ok());
      client::BlockTable copy = *fetched;
      copy.version = 1;  // anything older: Read brings it to the area's
      ASSERT_TRUE((*reader)->Read(fetched->version, &copy).ok()) << at;
      ASSERT_EQ(copy.version, fetched->version) << at;
      ASSERT_EQ(Blocks(copy), Blocks(*fetched)) << at << ", sequence " << l.id;
      ASSERT_EQ(Blocks(l.table), Blocks(*fetched)) << at << ", the client's, " << l.id;
    }
  };
  start(120);
  std::mt19937 rng(5);
  for (int step = 0; step < 40; ++step) {
    const std::string at = "step " + std::to_string(step);
    if (step == 10) {  // a fork
      absl::StatusOr<client::Sequence> child = client_->Fork(live[0].id);
      ASSERT_TRUE(child.ok()) << child.status();
      Live l;
      l.id = child->id;
      l.table = *client_->GetBlockTable(l.id, false);
      l.next = live[0].next;
      live.push_back(std::move(l));
    }
    if (step == 20) {  // a compression to a quarter: the record shrinks
      client::CompressArgs args;
      args.epoch = live[0].table.epoch;
      args.target_tokens = 20;
      ASSERT_TRUE(client_->Compress(live[0].id, args, &live[0].table).ok());
    }
    if (step == 30) {  // a release, and a new sequence that may take its slot
      ASSERT_TRUE(client_->Release(live[0].id).ok());
      live.erase(live.begin());
      start(50);
    }
    check(at + " (before)");
    std::vector<client::BatchEntry> entries;
    for (Live& l : live) entries.push_back(Entry(l.id, l.next++, &l.table, rng));
    absl::StatusOr<std::vector<client::BatchResult>> out = client_->StepBatch(entries);
    ASSERT_TRUE(out.ok()) << out.status();
    for (const client::BatchResult& r : *out) ASSERT_TRUE(r.status.ok()) << at << ": " << r.status;
    check(at);
  }
  for (const Live& l : live) ExpectContentMatchesPositions(l.id);
}

TEST_F(TableAreaTest, TheAnswerNamesTheVersionInsteadOfCarryingTheUpdate) {
  const uint64_t id = Create("window", {{"window", 20}});
  ASSERT_TRUE(AppendRange(id, 0, 30).ok());
  absl::StatusOr<client::BlockTable> table = client_->GetBlockTable(id, false);
  ASSERT_TRUE(table.ok());
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  auto batch = [&](bool from_area, uint64_t held, int64_t position) {
    v1::StepBatchRequest q;
    v1::StepBatchEntry* e = q.add_entries();
    e->set_sequence_id(id);
    e->mutable_append()->add_positions(position);
    e->mutable_append()->set_k(testing::Payload16(kStreams, position, 1, kD, 0));
    e->mutable_append()->set_v(testing::Payload16(kStreams, position, 1, kD, 1));
    e->mutable_client_table()->set_version(held);
    e->mutable_client_table()->set_from_area(from_area);
    v1::StepBatchResponse r;
    grpc::ClientContext c;
    EXPECT_TRUE(stub->StepBatch(&c, q, &r).ok());
    return r.results(0);
  };
  const v1::StepBatchResult plain = batch(false, table->version, 30);
  EXPECT_TRUE(plain.has_table_update());
  EXPECT_EQ(plain.table_in_area(), 0u);
  const uint64_t after = plain.table_update().delta().version();
  const v1::StepBatchResult in_area = batch(true, after, 31);
  EXPECT_FALSE(in_area.has_table_update());
  EXPECT_GT(in_area.table_in_area(), after);
  absl::StatusOr<client::Info> info = client_->GetInfo();
  ASSERT_TRUE(info.ok());
  absl::StatusOr<std::unique_ptr<client::TableReader>> reader = client::TableReader::Attach(*info);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_TRUE((*reader)->Read(in_area.table_in_area(), &*table).ok());
  absl::StatusOr<client::BlockTable> fetched = client_->GetBlockTable(id);
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ(table->version, fetched->version);
  EXPECT_EQ(Blocks(*table), Blocks(*fetched));
  // Read where it lies: the same blocks, good until the sequence changes.
  absl::StatusOr<client::TableView> view =
      (*reader)->View(table->epoch_slot, id, in_area.table_in_area());
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->version, fetched->version);
  EXPECT_EQ(view->epoch, fetched->epoch);
  for (uint32_t s = 0; s < kStreams; ++s) {
    std::vector<std::tuple<uint32_t, uint64_t, uint32_t, uint32_t, int>> blocks;
    for (const v1::table_area::Entry& e : view->stream(s)) {
      blocks.emplace_back(e.id, e.offset, e.start, e.count, static_cast<int>(e.precision));
    }
    EXPECT_EQ(blocks, Blocks(*fetched)[s]) << "stream " << s;
  }
  EXPECT_TRUE((*reader)->Unchanged(*view));
  batch(false, 0, 32);
  EXPECT_FALSE((*reader)->Unchanged(*view)) << "the view outlived a change of the table";
  EXPECT_EQ((*reader)->View(table->epoch_slot, id, fetched->version + 1000).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A version the area has not reached is refused, the table untouched.
  const client::BlockTable before = *table;
  absl::Status ahead = (*reader)->Read(table->version + 1000, &*table);
  EXPECT_EQ(ahead.code(), absl::StatusCode::kFailedPrecondition) << ahead;
  EXPECT_EQ(table->version, before.version);
  // A released sequence's slot holds nothing.
  ASSERT_TRUE(client_->Release(id).ok());
  absl::Status gone = (*reader)->Read(before.version, &*table);
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition) << gone;
  EXPECT_THAT(gone.message(), HasSubstr("no table"));
}

TEST_F(TableAreaTest, TablesThatFindNoRoomComeAsUpdates) {
  // 64 slots leave a heap of about 8 KiB: a few small tables fit, then none.
  table_area_bytes_ = 64 + 64 * 64 + 8192;
  StartDaemon(64ull << 20);
  ASSERT_TRUE(client_->AttachTableArea().ok());
  const uint64_t refetches = client_->table_refetches();
  std::vector<uint64_t> ids;
  std::vector<client::BlockTable> tables;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(Create("window", {{"window", 200}}));
    ASSERT_TRUE(AppendRange(ids.back(), 0, 100).ok());
    tables.push_back(*client_->GetBlockTable(ids.back(), false));
  }
  std::mt19937 rng(3);
  for (int64_t step = 0; step < 20; ++step) {
    std::vector<client::BatchEntry> entries;
    for (size_t i = 0; i < ids.size(); ++i) {
      entries.push_back(Entry(ids[i], 100 + step, &tables[i], rng));
    }
    absl::StatusOr<std::vector<client::BatchResult>> out = client_->StepBatch(entries);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << (*out)[i].status;
      absl::StatusOr<client::BlockTable> fetched = client_->GetBlockTable(ids[i]);
      ASSERT_TRUE(fetched.ok());
      ASSERT_EQ(tables[i].version, fetched->version);
      ASSERT_EQ(Blocks(tables[i]), Blocks(*fetched)) << "sequence " << i << " step " << step;
    }
  }
  // The daemon sent the update to those the area could not hold: no client had to fetch.
  EXPECT_EQ(client_->table_refetches(), refetches);
  EXPECT_GT(client_->table_area_reads(), 0u) << "the first tables fit";
  EXPECT_LT(client_->table_area_reads(), 20 * ids.size()) << "the last ones do not";
  for (uint64_t id : ids) ExpectContentMatchesPositions(id);
  // Stats count what the heap holds and the writes that found no room; releases give the
  // heap back whole.
  absl::StatusOr<client::Stats> stats = client_->GetStats(false);
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->table_area_misses, 0u);
  EXPECT_GT(stats->table_area_used_bytes, 0u);
  EXPECT_LE(stats->table_area_used_bytes, stats->table_area_heap_bytes);
  for (uint64_t id : ids) ASSERT_TRUE(client_->Release(id).ok());
  stats = client_->GetStats(false);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->table_area_used_bytes, 0u);
}

TEST_F(TableAreaTest, AReaderRacingTheDaemonNeverAcceptsATornTable) {
  // A long table (8 streams of 94 blocks: 18 KiB of record), so that the daemon's rewrites
  // take long enough for the reader to land in them.
  table_area_bytes_ = 8 << 20;
  StartDaemon(256ull << 20);
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 1500).ok());
  absl::StatusOr<client::BlockTable> first = client_->GetBlockTable(id);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<client::Info> info = client_->GetInfo();
  ASSERT_TRUE(info.ok());
  absl::StatusOr<std::unique_ptr<client::TableReader>> reader = client::TableReader::Attach(*info);
  ASSERT_TRUE(reader.ok());
  // The reader copies whatever version the area holds, as fast as it can, while the test
  // appends; every copy it accepts must be the table the daemon answers for that version.
  std::atomic<bool> stop{false};
  std::atomic<size_t> copies{0};  // seen.size(), for the appending thread
  std::vector<client::BlockTable> seen;
  std::thread racer([&] {
    client::BlockTable t = *first;
    while (!stop.load()) {
      // Read takes no version older than the one held: t starts at the prompt's each time,
      // and one copy of each version is kept.
      t.version = first->version;
      if ((*reader)->Read(1, &t).ok() && (seen.empty() || seen.back().version != t.version)) {
        seen.push_back(t);
        copies.store(seen.size());
      }
    }
  });
  std::map<uint64_t, client::BlockTable> truth;
  // 300 appends at least, more on a loaded machine where the reader runs less often (it
  // must have copied enough versions to tell), 3,000 at most.
  for (int64_t token = 1500; token < 1800 || (copies.load() < 80 && token < 4500); ++token) {
    ASSERT_TRUE(AppendRange(id, token, 1).ok());
    absl::StatusOr<client::BlockTable> now = client_->GetBlockTable(id);
    ASSERT_TRUE(now.ok());
    truth[now->version] = *now;
  }
  stop = true;
  racer.join();
  size_t compared = 0;
  for (const client::BlockTable& t : seen) {
    auto it = truth.find(t.version);
    if (it == truth.end()) continue;  // the prompt's version, before the first append
    ++compared;
    ASSERT_EQ(t.epoch, it->second.epoch) << "version " << t.version;
    ASSERT_EQ(Blocks(t), Blocks(it->second)) << "version " << t.version;
  }
  EXPECT_GT(compared, 50u) << "the reader raced too few appends to tell";
}

}  // namespace
}  // namespace kvmem
