// Table versions and deltas: a client that applies the updates it is sent holds exactly the
// table GetBlockTable returns, after every kind of change; a client too far behind gets the
// whole table; and the batched step behaves as the calls it folds.
#include <random>
#include <regex>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

// A client's copy of one sequence's tables, kept only from updates.
struct ClientTable {
  uint64_t version = 0;
  uint64_t epoch = 0;
  std::vector<std::vector<TableBlock>> blocks;
  std::vector<std::vector<int64_t>> positions;
  bool with_positions = true;  // false: the updates carry none, and none are kept

  size_t Slots(size_t s) const {
    size_t n = 0;
    for (const TableBlock& b : blocks[s]) n += b.count;
    return n;
  }

  void Apply(const TableUpdate& update, size_t streams) {
    if (update.full()) {
      ASSERT_EQ(update.table->streams.size(), streams);
      blocks.clear();
      positions.clear();
      for (const StreamTable& st : update.table->streams) {
        blocks.push_back(st.blocks);
        positions.push_back(st.positions);
      }
      EXPECT_EQ(update.table->version, update.version);
    } else {
      EXPECT_EQ(update.base_version, version) << "a delta applied to another version";
    }
    for (const StreamDelta& d : update.streams) {
      ASSERT_LT(d.stream, blocks.size());
      const std::vector<TableBlock>& held = blocks[d.stream];
      // Slot offsets of the held blocks, to carry a kept block's positions over.
      std::vector<size_t> offset = {0};
      for (const TableBlock& b : held) offset.push_back(offset.back() + b.count);
      if (with_positions) {
        ASSERT_EQ(offset.back(), positions[d.stream].size());
      }
      std::vector<TableBlock> next(d.block_count);
      std::vector<bool> filled(d.block_count, false);
      std::vector<std::vector<int64_t>> next_positions(d.block_count);
      for (const KeptRun& run : d.kept) {
        for (uint32_t j = 0; j < run.count; ++j) {
          ASSERT_LT(run.at + j, d.block_count) << "stream " << d.stream;
          ASSERT_LT(run.from + j, held.size()) << "stream " << d.stream;
          ASSERT_FALSE(filled[run.at + j]) << "two runs fill one entry";
          next[run.at + j] = held[run.from + j];
          filled[run.at + j] = true;
          if (!with_positions) continue;
          const auto& p = positions[d.stream];
          next_positions[run.at + j].assign(p.begin() + offset[run.from + j],
                                            p.begin() + offset[run.from + j + 1]);
        }
      }
      size_t given = 0, slot = 0;
      for (uint32_t i = 0; i < d.block_count; ++i) {
        if (filled[i]) continue;
        ASSERT_LT(given, d.blocks.size()) << "stream " << d.stream;
        next[i] = d.blocks[given++];
        if (!with_positions) continue;
        ASSERT_LE(slot + next[i].count, d.positions.size());
        next_positions[i].assign(d.positions.begin() + slot,
                                 d.positions.begin() + slot + next[i].count);
        slot += next[i].count;
      }
      ASSERT_EQ(given, d.blocks.size()) << "stream " << d.stream;
      ASSERT_EQ(slot, d.positions.size()) << "stream " << d.stream;  // none without positions
      blocks[d.stream] = next;
      positions[d.stream].clear();
      for (const auto& p : next_positions) {
        positions[d.stream].insert(positions[d.stream].end(), p.begin(), p.end());
      }
    }
    version = update.version;
    epoch = update.epoch;
  }
};

// The table as text: blocks (id, offset, run, precision) and positions per stream.
std::string Text(const std::vector<std::vector<TableBlock>>& blocks,
                 const std::vector<std::vector<int64_t>>& positions) {
  std::string out;
  for (size_t s = 0; s < blocks.size(); ++s) {
    absl::StrAppend(&out, "stream ", s, ":");
    for (const TableBlock& b : blocks[s]) {
      absl::StrAppend(&out, " ", b.id, "@", b.offset, "[", b.start, "+", b.count, "]p",
                      static_cast<int>(b.precision));
    }
    absl::StrAppend(&out, " |");
    for (int64_t p : positions[s]) absl::StrAppend(&out, " ", p);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

std::string Text(const BlockTable& table) {
  std::vector<std::vector<TableBlock>> blocks;
  std::vector<std::vector<int64_t>> positions;
  for (const StreamTable& st : table.streams) {
    blocks.push_back(st.blocks);
    positions.push_back(st.positions);
  }
  return Text(blocks, positions);
}

class DeltaTest : public EngineTest {
 protected:
  static constexpr size_t kStreams = kL * kH;

  // Holds the buffers a StepCall's spans point into.
  struct CallData {
    std::vector<int64_t> positions;
    std::vector<float> entropy, distance;
    std::string k, v;
    std::vector<std::vector<float>> rows;
    StepCall call;
  };

  // A folded step of `n` new tokens on `id`, with random rows over the client's table plus
  // the new tokens.
  void MakeCall(uint64_t id, const ClientTable& table, int64_t first, uint32_t n, std::mt19937& rng,
                CallData* data) {
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    data->positions = testing::Range(first, n);
    data->entropy.assign(n, 1.0f);
    data->distance.assign(n, 0.5f);
    data->k = testing::Payload16(kStreams, first, n, kD, 0);
    data->v = testing::Payload16(kStreams, first, n, kD, 1);
    data->call = StepCall{};
    data->call.sequence_id = id;
    if (n > 0) {
      data->call.append =
          AppendChunk{data->positions, {}, data->k, data->v, data->entropy, data->distance};
    }
    StepInput in;
    in.epoch = table.epoch;
    in.logits = RawLogitStats{static_cast<float>(u(rng) * 3.0), 0.6f, 0.2f, {}};
    data->rows.assign(kStreams, {});
    for (size_t s = 0; s < kStreams; ++s) {
      for (size_t j = 0; j < table.Slots(s) + n; ++j) data->rows[s].push_back(u(rng));
      in.attention.push_back(
          {static_cast<uint32_t>(s / kH), static_cast<uint32_t>(s % kH), data->rows[s]});
    }
    data->call.step = std::move(in);
    data->call.held = HeldTable{table.version, table.with_positions};
  }

  ClientTable Attach(uint64_t id) {
    ClientTable table;
    table.Apply(*engine_->GetTableUpdate(id, 0, true), kStreams);
    return table;
  }

  void ExpectSame(uint64_t id, const ClientTable& client, const std::string& where) {
    absl::StatusOr<BlockTable> table = engine_->GetBlockTable(id);
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(client.version, table->version) << where;
    EXPECT_EQ(client.epoch, table->epoch) << where;
    if (client.with_positions) {
      ASSERT_EQ(Text(client.blocks, client.positions), Text(*table)) << where;
    } else {
      std::vector<std::vector<TableBlock>> blocks;
      for (const StreamTable& st : table->streams) blocks.push_back(st.blocks);
      const std::vector<std::vector<int64_t>> none(client.blocks.size());
      ASSERT_EQ(Text(client.blocks, none), Text(blocks, none)) << where;
    }
    // The same-host reader's check passes for the client's table.
    EXPECT_EQ(engine_->epoch_board().Load(table->epoch_slot), 2 * client.epoch) << where;
  }
};

TEST_F(DeltaTest, ClientTablesFollowEveryKindOfChange) {
  struct Case {
    std::string policy;
    policy::ParamOverrides params;
    bool int8;
  };
  const std::vector<Case> cases = {
      {"full", {}, false},
      {"window", {{"window", 20}}, false},
      {"window", {{"window", 40}}, true},
      {"streaming_llm", {{"sinks", 2}, {"budget", 20}}, false},
      {"h2o", {{"budget", 24}}, true},
      {"confkv", {{"c_high", 16}, {"c_low", 28}, {"protect", 4}}, false},
      {"confkv", {{"c_high", 20}, {"c_low", 36}, {"protect", 4}}, true},
  };
  MakeEngine(8 << 20);
  std::mt19937 rng(7);
  int steps = 0, rewrites = 0;
  // With positions the delta walks every block; without, an update after one change sends
  // the entries it left untouched as one run without walking them (Stream::untouched).
  for (const bool with_positions : {true, false}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.policy + (c.int8 ? "+int8" : "") + (with_positions ? "" : ", no positions"));
      QuantConfig quant;
      if (c.int8) quant = QuantConfig{kernels::QuantType::kInt8, 16};
      auto created =
          engine_->CreateSequence(TestLayout(), c.policy, c.params, quant, absl::ZeroDuration());
      ASSERT_TRUE(created.ok()) << created.status();
      // Two sequences: the second is a fork whose client carried the parent's table over.
      std::vector<uint64_t> ids = {created->sequence_id};
      std::vector<ClientTable> tables(1);
      tables[0].with_positions = with_positions;
      tables[0].Apply(*engine_->GetTableUpdate(ids[0], 0, with_positions), kStreams);
      std::vector<int64_t> next(1, 0);
      for (int round = 0; round < 300; ++round) {
        if (round == 40) {
          auto child = engine_->Fork(ids[0], absl::ZeroDuration());
          ASSERT_TRUE(child.ok()) << child.status();
          EXPECT_EQ(child->version, tables[0].version);
          ids.push_back(child->sequence_id);
          tables.push_back(tables[0]);         // the parent's table, followed by the child's deltas
          tables.back().epoch = child->epoch;  // under the child's own epoch
          next.push_back(next[0]);
        }
        for (size_t i = 0; i < ids.size(); ++i) {
          const uint64_t before_epoch = tables[i].epoch;
          const uint32_t n = round < 2 ? 12 + rng() % 10 : (rng() % 5 == 0 ? 0 : 1 + rng() % 2);
          CallData data;
          MakeCall(ids[i], tables[i], next[i], n, rng, &data);
          absl::StatusOr<std::vector<StepOutcome>> out =
              engine_->StepBatch(absl::MakeConstSpan(&data.call, 1));
          ASSERT_TRUE(out.ok()) << out.status();
          ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
          ASSERT_TRUE((*out)[0].table.has_value());
          EXPECT_FALSE((*out)[0].table->full()) << "round " << round;
          tables[i].Apply(*(*out)[0].table, kStreams);
          next[i] += n;
          ++steps;
          if (tables[i].epoch != before_epoch) ++rewrites;
          ExpectSame(ids[i], tables[i], absl::StrCat("round ", round, " sequence ", i));
          if (HasFailure()) return;
        }
      }
      for (uint64_t id : ids) ASSERT_TRUE(engine_->Release(id).ok());
    }
  }
  EXPECT_GT(rewrites, 200) << "the tables were rewritten (evictions, quantization) " << rewrites
                           << " times in " << steps << " steps";
}

TEST(StreamVersionsTest, StampsOnlyTheEntriesThatChanged) {
  Stream st;
  std::vector<StreamBlock> list = {{1, 0, 16, Precision::kLayout},
                                   {2, 0, 16, Precision::kLayout},
                                   {3, 0, 16, Precision::kLayout},
                                   {4, 0, 4, Precision::kLayout}};
  st.SwapBlocks(list, 10);
  st.MarkPublished(0, 10);
  EXPECT_EQ(st.changed_version(), 10u);
  auto versions = [&st] {
    std::vector<uint64_t> v;
    for (const StreamBlock& b : st.blocks()) v.push_back(b.version);
    return v;
  };
  auto indices = [&st](int which) {
    std::vector<uint32_t> v;
    for (const StreamBlock& b : st.blocks()) v.push_back(b.published_index[which]);
    return v;
  };
  EXPECT_THAT(indices(0), ::testing::ElementsAre(0, 1, 2, 3));

  // The head evicted (the first run shrinks) and a token appended (the last grows): the
  // blocks between keep their versions.
  list = st.blocks();
  list[0].start = 1;
  list[0].count = 15;
  list[3].count = 5;
  st.SwapBlocks(list, 11);
  EXPECT_THAT(versions(), ::testing::ElementsAre(11, 10, 10, 11));
  EXPECT_EQ(st.changed_version(), 11u);

  // The first block dropped whole: the others move up one index, unchanged.
  list = {st.blocks()[1], st.blocks()[2], st.blocks()[3]};
  st.SwapBlocks(list, 12);
  EXPECT_THAT(versions(), ::testing::ElementsAre(10, 10, 11));
  EXPECT_EQ(st.changed_version(), 12u);
  // Their index at the published version 10 travels with them.
  EXPECT_THAT(indices(0), ::testing::ElementsAre(1, 2, 3));
  st.MarkPublished(1, 12);
  EXPECT_THAT(indices(1), ::testing::ElementsAre(0, 1, 2));
  EXPECT_THAT(indices(0), ::testing::ElementsAre(1, 2, 3));

  // A block replaced by a new one (quantized, copied on write: version 0 from the plan),
  // and one whose id the old list lacks although the plan left its version: both new.
  list = st.blocks();
  list[0] = {7, 0, 16, Precision::kInt8};
  list[2].id = 9;
  st.SwapBlocks(list, 13);
  EXPECT_THAT(versions(), ::testing::ElementsAre(13, 10, 13));

  // The last block dropped whole, the rest as they were: the list is shorter.
  list = {st.blocks()[0], st.blocks()[1]};
  st.SwapBlocks(list, 14);
  EXPECT_THAT(versions(), ::testing::ElementsAre(13, 10));
  EXPECT_EQ(st.changed_version(), 14u);
  // Nothing at all changed: the versions stay.
  list = st.blocks();
  st.SwapBlocks(list, 15);
  EXPECT_EQ(st.changed_version(), 14u);
  EXPECT_THAT(versions(), ::testing::ElementsAre(13, 10));
  // The next mark of slot 0 indexes block 3 where it is now (its index there was 2).
  st.MarkPublished(0, 14);
  EXPECT_THAT(indices(0), ::testing::ElementsAre(0, 1));
}

TEST(StreamVersionsTest, GrowTailIsTheSwapOfAOneEntryTailThatGrew) {
  // What an append that fits the last block does without a plan (Stream::GrowTail) must
  // leave the stream as the planned one-entry tail did (SwapBlocks from the last entry):
  // entries, versions, tallies, the untouched run and the indices the next marks write.
  const auto state = [](const Stream& st) {
    std::string out;
    for (const StreamBlock& b : st.blocks()) {
      absl::StrAppend(&out, b.id, "[", b.start, "+", b.count, "]p", static_cast<int>(b.precision),
                      "v", b.version, "i", b.published_index[0], ",", b.published_index[1], " ");
    }
    absl::StrAppend(&out, "| layout ", st.layout_slots(), " quantized ", st.quantized_slots(),
                    " changed ", st.changed_version(), " previous ", st.previous_changed_version(),
                    " run ", st.untouched().begin, "-", st.untouched().end, "@",
                    st.untouched().shift, " base ", st.untouched_base());
    return out;
  };
  Stream a;
  std::vector<StreamBlock> list = {{1, 0, 16, Precision::kInt8},
                                   {2, 0, 16, Precision::kLayout},
                                   {3, 2, 10, Precision::kLayout},
                                   {4, 0, 5, Precision::kLayout}};
  a.SwapBlocks(list, 10);
  a.MarkPublished(0, 10);
  for (int round = 0; round < 3; ++round) {
    // Round 0: the first change since a mark; round 1: after another change at the same
    // version window (an eviction of entry 1's head); round 2: after a mark of slot 1.
    if (round == 1) {
      std::vector<StreamBlock> middle = {a.blocks()[1]};
      middle[0].start += 3;
      middle[0].count -= 3;
      a.SwapBlocks(middle, 20, /*from=*/1, /*to=*/2);
    }
    if (round == 2) a.MarkPublished(1, 20);
    Stream b = a;  // a copy keeps the blocks, tallies and run (not the slot columns' fronts)
    const uint64_t version = 30 + round;
    a.GrowTail(2, version);
    std::vector<StreamBlock> tail = {b.blocks().back()};
    tail[0].count += 2;
    b.SwapBlocks(tail, version, b.blocks().size() - 1);
    ASSERT_EQ(state(a), state(b)) << "round " << round;
    a.MarkPublished(round % 2, version);
    b.MarkPublished(round % 2, version);
    ASSERT_EQ(state(a), state(b)) << "round " << round << ", marked";
  }
}

TEST(StreamVersionsTest, AnAppendSwapsOnlyItsTailAndKeepsTheTally) {
  Stream st;
  std::vector<StreamBlock> list = {
      {1, 0, 16, Precision::kInt8}, {2, 0, 16, Precision::kLayout}, {3, 0, 4, Precision::kLayout}};
  st.SwapBlocks(list, 10);
  EXPECT_EQ(st.layout_slots(), 20u);
  EXPECT_EQ(st.quantized_slots(), 16u);
  EXPECT_EQ(st.quantized_blocks(), 1u);
  st.MarkPublished(0, 10);
  // The planned tail: the last block, filled, and a new one after it.
  std::vector<StreamBlock> tail = {st.blocks()[2], {4, 0, 3, Precision::kLayout}};
  tail[0].count = 16;
  st.ReserveBlocks(4);
  st.SwapBlocks(tail, 11, /*from=*/2);
  ASSERT_EQ(st.blocks().size(), 4u);
  EXPECT_EQ(st.blocks()[2].count, 16u);
  EXPECT_EQ(st.blocks()[3].id, 4u);
  std::vector<uint64_t> versions;
  for (const StreamBlock& b : st.blocks()) versions.push_back(b.version);
  EXPECT_THAT(versions, ::testing::ElementsAre(10, 10, 11, 11));
  ASSERT_EQ(tail.size(), 1u);  // the old tail, for an unwind
  EXPECT_EQ(tail[0].count, 4u);
  EXPECT_EQ(st.layout_slots(), 16u + 16u + 3u);
  EXPECT_EQ(st.quantized_slots(), 16u);
  EXPECT_EQ(st.changed_version(), 11u);
  // The blocks before the tail kept their index; only the new one is indexed.
  st.MarkPublished(1, 11);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(st.blocks()[i].published_index[1], i);
  // A tail that shrank (not an append's, but the exchange allows it).
  tail = {st.blocks()[3]};
  st.SwapBlocks(tail, 12, /*from=*/2);
  ASSERT_EQ(st.blocks().size(), 3u);
  EXPECT_EQ(st.blocks()[2].id, 4u);
  // Moved up an index, unchanged: not stamped (a delta names it by its old index), but
  // the list changed and the entry is indexed again at the next mark.
  EXPECT_EQ(st.blocks()[2].version, 11u);
  EXPECT_EQ(st.changed_version(), 12u);
  st.MarkPublished(0, 12);  // the older of the two published versions makes room
  EXPECT_EQ(st.blocks()[2].published_index[0], 2u);
  EXPECT_EQ(st.blocks()[2].published_index[1], 3u);  // where a client of version 11 has it
  EXPECT_EQ(tail.size(), 2u);
  EXPECT_EQ(st.layout_slots(), 16u + 3u);
}

// A decode step appends (one version) and evicts (the next) before it publishes: the run
// is the blocks between its head and its tail, relative to the list last published, so
// that the step's delta names them without reading them. A publish starts a new run.
TEST(StreamVersionsTest, AStepsRunSpansItsAppendAndItsEviction) {
  Stream st;
  std::vector<StreamBlock> list;
  for (store::BlockId id = 1; id <= 5; ++id) list.push_back({id, 0, 16, Precision::kLayout});
  list.back().count = 3;
  st.SwapBlocks(list, 10);
  st.MarkPublished(0, 10);
  std::vector<StreamBlock> tail = {st.blocks()[4]};  // the append: the last block grows
  tail[0].count = 4;
  st.SwapBlocks(tail, 11, /*from=*/4);
  std::vector<StreamBlock> head = {st.blocks()[0]};  // the eviction: the head loses a slot
  head[0].start = 1;
  head[0].count = 15;
  st.SwapBlocks(head, 12, /*from=*/0, /*to=*/1);
  EXPECT_EQ(st.untouched_base(), 10u);
  EXPECT_EQ(st.untouched().begin, 1u);
  EXPECT_EQ(st.untouched().end, 4u);
  EXPECT_EQ(st.untouched().shift, 0);

  st.MarkPublished(1, 12);
  head.clear();  // the head block dropped whole: the rest move up one index
  st.SwapBlocks(head, 13, /*from=*/0, /*to=*/1);
  EXPECT_EQ(st.untouched_base(), 12u);
  EXPECT_EQ(st.untouched().begin, 0u);
  EXPECT_EQ(st.untouched().end, 4u);
  EXPECT_EQ(st.untouched().shift, -1);  // entry i was entry i + 1
}

TEST_F(DeltaTest, HeadEvictionSendsOnlyTheEntriesThatChanged) {
  // window keeps the last 64 slots of a stream: 4-5 blocks of 16. Every step evicts the
  // head and appends one token; the update names the two changed entries (the first run
  // shrank, the last grew, or a block dropped or added), never the blocks between.
  const uint64_t id = Create("window", {{"window", 64}});
  ClientTable client = Attach(id);
  std::mt19937 rng(5);
  int64_t next = 0;
  size_t max_given = 0, kept_entries = 0;
  for (int round = 0; round < 120; ++round) {
    CallData data;
    const uint32_t n = round == 0 ? 64 : 1;
    MakeCall(id, client, next, n, rng, &data);
    absl::StatusOr<std::vector<StepOutcome>> out =
        engine_->StepBatch(absl::MakeConstSpan(&data.call, 1));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
    const TableUpdate& update = *(*out)[0].table;
    ASSERT_FALSE(update.full());
    client.Apply(update, kStreams);
    next += n;
    if (round < 2) continue;
    ASSERT_EQ(update.streams.size(), kStreams);
    for (const StreamDelta& d : update.streams) {
      max_given = std::max(max_given, d.blocks.size());
      for (const KeptRun& run : d.kept) kept_entries += run.count;
    }
    ExpectSame(id, client, absl::StrCat("round ", round));
    if (HasFailure()) return;
  }
  EXPECT_LE(max_given, 2u);
  EXPECT_GT(kept_entries, 118u * kStreams * 2) << "the blocks between were sent again";
}

TEST_F(DeltaTest, CompressAndPlainCallsReportVersionsThatDeltasFollow) {
  const uint64_t id = Create("snapkv", {{"budget", 12}, {"window", 4}});
  ClientTable client = Attach(id);
  absl::StatusOr<AppendResult> appended = AppendRange(id, 0, 40);
  ASSERT_TRUE(appended.ok());
  client.Apply(*engine_->GetTableUpdate(id, client.version, true), kStreams);
  EXPECT_EQ(client.version, appended->version);
  ExpectSame(id, client, "after the prefill");

  std::vector<std::vector<float>> scores(kStreams, std::vector<float>(40));
  std::mt19937 rng(3);
  CompressInput in;
  in.epoch = client.epoch;
  for (size_t s = 0; s < kStreams; ++s) {
    for (float& x : scores[s]) x = static_cast<float>(rng() % 1000) / 1000.0f;
    in.window_scores.push_back(
        {static_cast<uint32_t>(s / kH), static_cast<uint32_t>(s % kH), scores[s]});
  }
  absl::StatusOr<CompressResult> compressed = engine_->Compress(id, in);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  TableUpdate update = *engine_->GetTableUpdate(id, client.version, true);
  EXPECT_FALSE(update.full());
  EXPECT_EQ(update.version, compressed->version);
  client.Apply(update, kStreams);
  ExpectSame(id, client, "after the compression");
}

TEST_F(DeltaTest, AClientMoreThanOneVersionBehindGetsTheWholeTable) {
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 20).ok());
  ClientTable current = Attach(id);
  ClientTable old = current;
  ASSERT_TRUE(AppendRange(id, 20, 1).ok());
  TableUpdate one_behind = *engine_->GetTableUpdate(id, current.version, true);
  EXPECT_FALSE(one_behind.full());
  // Every stream gained a slot in its last block: that block and its position, nothing else.
  ASSERT_EQ(one_behind.streams.size(), kStreams);
  EXPECT_EQ(one_behind.streams[0].block_count, 2u);
  ASSERT_EQ(one_behind.streams[0].kept.size(), 1u);
  EXPECT_EQ(one_behind.streams[0].kept[0].at, 0u);
  EXPECT_EQ(one_behind.streams[0].kept[0].from, 0u);
  EXPECT_EQ(one_behind.streams[0].kept[0].count, 1u);
  EXPECT_THAT(one_behind.streams[0].positions, ::testing::ElementsAre(16, 17, 18, 19, 20));
  current.Apply(one_behind, kStreams);
  ExpectSame(id, current, "one behind");

  ASSERT_TRUE(AppendRange(id, 21, 1).ok());
  TableUpdate two_behind = *engine_->GetTableUpdate(id, old.version, true);
  EXPECT_TRUE(two_behind.full());
  old.Apply(two_behind, kStreams);
  ExpectSame(id, old, "two behind");

  // Nothing changed since the client's version: an empty delta.
  TableUpdate same = *engine_->GetTableUpdate(id, old.version, true);
  EXPECT_FALSE(same.full());
  EXPECT_TRUE(same.streams.empty());
  // A version this sequence never had (another's, or made up) gets the whole table.
  const uint64_t other = Create("full");
  ASSERT_TRUE(AppendRange(other, 0, 3).ok());
  const uint64_t foreign = engine_->GetBlockTable(other)->version;
  EXPECT_TRUE(engine_->GetTableUpdate(id, foreign, true)->full());
  EXPECT_TRUE(engine_->GetTableUpdate(id, old.version + 1000, true)->full());
}

// Versions come from one engine-wide counter, so a client can guess the version a call will
// produce. Claiming it as held must not earn the empty delta "you are current": the call's
// update is the whole table (outside test: an Append that claimed the next version got an
// empty delta and the client's table silently lacked the appended token).
TEST_F(DeltaTest, AGuessedFutureVersionGetsTheWholeTable) {
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 3).ok());
  for (const bool batched : {true, false}) {
    ClientTable table = Attach(id);
    const uint64_t guess = table.version + 1;  // nothing else runs in this engine
    const int64_t next = table.positions[0].back() + 1;
    absl::StatusOr<TableUpdate> update;
    if (batched) {
      std::mt19937 rng(3);
      CallData data;
      MakeCall(id, table, next, 1, rng, &data);
      data.call.step.reset();
      data.call.held->version = guess;
      absl::StatusOr<std::vector<StepOutcome>> out =
          engine_->StepBatch(absl::MakeConstSpan(&data.call, 1));
      ASSERT_TRUE(out.ok() && (*out)[0].status.ok());
      ASSERT_TRUE((*out)[0].table.has_value());
      update = *(*out)[0].table;
    } else {  // a unary call: its update comes under the call's own lock, as a batch entry's
      const RangeChunk range(next, 1);
      const AppendChunk chunk = range.chunk();
      absl::StatusOr<AppendResult> appended =
          engine_->Append(id, absl::MakeConstSpan(&chunk, 1), HeldTable{guess, true});
      ASSERT_TRUE(appended.ok()) << appended.status();
      ASSERT_TRUE(appended->table.has_value());
      update = *appended->table;
    }
    ASSERT_TRUE(update.ok()) << update.status();
    ASSERT_EQ(update->version, guess) << "the guess must hit for the test to mean anything";
    EXPECT_TRUE(update->full()) << (batched ? "batched" : "unary");
    table.Apply(*update, kStreams);
    ExpectSame(id, table, batched ? "batched" : "unary");
    // Once told of, the version is one a client may hold: deltas from it as usual.
    ASSERT_TRUE(AppendRange(id, next + 1, 1).ok());
    EXPECT_FALSE(engine_->GetTableUpdate(id, guess, true)->full());
  }
}

TEST_F(DeltaTest, BatchedStepsEqualStepsOneByOne) {
  // Two engines, the same workload: one batch per round on one, Append then Step per
  // sequence on the other. Tables and K/V must come out identical.
  const std::vector<std::pair<std::string, policy::ParamOverrides>> policies = {
      {"window", {{"window", 20}}},
      {"confkv", {{"c_high", 16}, {"c_low", 28}, {"protect", 4}}},
      {"h2o", {{"budget", 24}}},
      {"full", {}}};
  MakeEngine(8 << 20);
  std::unique_ptr<Engine> batched = std::move(engine_);
  MakeEngine(8 << 20);
  std::unique_ptr<Engine>& single = engine_;
  std::vector<uint64_t> a, b;
  for (const auto& [name, params] : policies) {
    a.push_back(batched->CreateSequence(TestLayout(), name, params, {}, {})->sequence_id);
    b.push_back(single->CreateSequence(TestLayout(), name, params, {}, {})->sequence_id);
  }
  std::vector<ClientTable> tables(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    tables[i].Apply(*batched->GetTableUpdate(a[i], 0, true), kStreams);
  }
  std::mt19937 rng(11);
  int64_t next = 0;
  for (int round = 0; round < 60; ++round) {
    const uint32_t n = round == 0 ? 24 : 1;
    std::vector<CallData> data(a.size());
    std::vector<StepCall> calls;
    for (size_t i = 0; i < a.size(); ++i) {
      MakeCall(a[i], tables[i], next, n, rng, &data[i]);
      calls.push_back(data[i].call);
    }
    absl::StatusOr<std::vector<StepOutcome>> out = batched->StepBatch(calls);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << (*out)[i].status;
      tables[i].Apply(*(*out)[i].table, kStreams);
      ASSERT_TRUE(single->Append(b[i], absl::MakeConstSpan(&*calls[i].append, 1)).ok());
      StepInput in = *calls[i].step;
      in.epoch = single->GetBlockTable(b[i])->epoch;
      absl::StatusOr<StepResult> stepped = single->Step(b[i], in);
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      EXPECT_EQ(stepped->evicted_tokens, (*out)[i].step->evicted_tokens);
      EXPECT_EQ(stepped->budget_tokens, (*out)[i].step->budget_tokens);
    }
    next += n;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    // Block ids and offsets differ (the batch's entries allocate in parallel); every block's
    // run and precision, the slots' metadata and scores, and the K/V must not.
    auto content = [](absl::StatusOr<std::string> fp) {
      EXPECT_TRUE(fp.ok()) << fp.status();
      static const std::regex kIdAtOffset("[0-9]+@[0-9]+");
      return std::regex_replace(fp.value_or(""), kIdAtOffset, "#");
    };
    EXPECT_EQ(content(batched->Fingerprint(a[i])), content(single->Fingerprint(b[i])))
        << policies[i].first;
  }
  engine_ = std::move(batched);  // the fixture's engine, torn down as usual
  engine_.reset();
  single.reset();
}

TEST_F(DeltaTest, AFailingEntryChangesNothingAndLeavesTheOthersAlone) {
  const uint64_t good = Create("window", {{"window", 20}});
  const uint64_t bad_rows = Create("window", {{"window", 20}});
  const uint64_t gone = Create("full");
  ASSERT_TRUE(engine_->Release(gone).ok());
  std::vector<ClientTable> tables = {Attach(good), Attach(bad_rows), Attach(good)};
  std::mt19937 rng(5);
  std::vector<CallData> data(3);
  MakeCall(good, tables[0], 0, 4, rng, &data[0]);
  MakeCall(bad_rows, tables[1], 0, 4, rng, &data[1]);
  data[1].rows[3].pop_back();  // one row too short: the step's input is wrong
  data[1].call.step->attention[3].values = data[1].rows[3];
  MakeCall(gone, tables[2], 0, 4, rng, &data[2]);
  const std::string before = *engine_->Fingerprint(bad_rows);
  std::vector<StepCall> calls = {data[0].call, data[1].call, data[2].call};
  absl::StatusOr<std::vector<StepOutcome>> out = engine_->StepBatch(calls);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  EXPECT_EQ((*out)[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT((*out)[1].status.message(), HasSubstr("attention[3]"));
  EXPECT_FALSE((*out)[1].appended.has_value()) << "the append of a rejected entry applied";
  EXPECT_EQ(*engine_->Fingerprint(bad_rows), before);
  EXPECT_EQ((*out)[2].status.code(), absl::StatusCode::kNotFound);

  // A stale epoch: FAILED_PRECONDITION carrying the current epoch and version.
  CallData stale;
  MakeCall(good, tables[0], 4, 1, rng, &stale);
  stale.call.step->epoch = 123456;
  out = engine_->StepBatch(absl::MakeConstSpan(&stale.call, 1));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  const BlockTable now = *engine_->GetBlockTable(good);
  EXPECT_EQ((*out)[0].status.GetPayload(kCurrentEpochPayload).value_or(absl::Cord()),
            absl::StrCat(now.epoch));
  EXPECT_EQ((*out)[0].status.GetPayload(kCurrentVersionPayload).value_or(absl::Cord()),
            absl::StrCat(now.version));

  // A sequence named twice: the whole batch is refused, nothing runs.
  calls = {data[0].call, data[0].call};
  EXPECT_THAT(engine_->StepBatch(calls).status().message(), HasSubstr("entries[1].sequence_id"));
}

// A step's eviction swaps only the entries it planned (SwapBlocks(list, v, from, to)); the
// stream must end up exactly as if the whole list had been swapped: entries, versions,
// published indices, the change record and the KV tally.
TEST(StreamVersionsTest, ARangeSwapEqualsTheWholeListSwap) {
  std::mt19937 rng(23);
  store::BlockId next_id = 1;
  for (int round = 0; round < 500; ++round) {
    std::vector<StreamBlock> list;
    const size_t n = 1 + rng() % 8;
    for (size_t i = 0; i < n; ++i) {
      const auto precision = rng() % 4 == 0 ? Precision::kInt8 : Precision::kLayout;
      list.push_back({next_id++, 0, 1 + static_cast<uint32_t>(rng() % 16), precision});
    }
    Stream ranged, whole;
    std::vector<StreamBlock> copy = list;
    ranged.SwapBlocks(list, 10);
    whole.SwapBlocks(copy, 10);
    uint64_t version = 10;
    // The list at the last MarkPublished and its version: the untouched run of the changes
    // since then is relative to it.
    std::vector<StreamBlock> base;
    uint64_t base_version = 0;
    bool changed_since = true;
    const auto mark = [&](int which) {
      ranged.MarkPublished(which, version);
      whole.MarkPublished(which, version);
      base = ranged.blocks();
      base_version = version;
      changed_since = false;
    };
    for (int step = 0; step < 8 && !ranged.blocks().empty(); ++step) {
      if (rng() % 2 == 0) mark(static_cast<int>(version % 2));
      ++version;
      const std::vector<StreamBlock>& now = ranged.blocks();
      const size_t from = rng() % now.size();
      const size_t to = from + 1 + rng() % (now.size() - from);
      // The planned middle: entries shrunk, dropped, merged into a neighbour, or replaced.
      std::vector<StreamBlock> middle;
      for (size_t i = from; i < to; ++i) {
        StreamBlock b = now[i];
        const int what = static_cast<int>(rng() % 5);
        if (what == 0) continue;  // dropped
        if (what == 1 && b.count > 1) {
          ++b.start;
          --b.count;
        }
        if (what == 2) b = {next_id++, 0, b.count, b.precision};  // copied: a new id
        if (what == 4 && rng() % 2 == 0) {  // a new entry after it: the list grows
          middle.push_back(b);
          b = {next_id++, 0, 1 + static_cast<uint32_t>(rng() % 16), Precision::kLayout};
        }
        if (what == 3 && !middle.empty()) {  // merged into the last
          middle.back().count += b.count;
          middle.back().version = 0;
          continue;
        }
        middle.push_back(b);
      }
      std::vector<StreamBlock> full(now.begin(), now.begin() + static_cast<ptrdiff_t>(from));
      full.insert(full.end(), middle.begin(), middle.end());
      full.insert(full.end(), now.begin() + static_cast<ptrdiff_t>(to), now.end());
      const std::vector<StreamBlock> old_middle(now.begin() + static_cast<ptrdiff_t>(from),
                                                now.begin() + static_cast<ptrdiff_t>(to));
      ranged.SwapBlocks(middle, version, from, to);
      whole.SwapBlocks(full, version);
      const std::string at = absl::StrCat("round ", round, " step ", step);
      ASSERT_EQ(ranged.blocks().size(), whole.blocks().size()) << at;
      for (size_t i = 0; i < ranged.blocks().size(); ++i) {
        const StreamBlock& a = ranged.blocks()[i];
        const StreamBlock& b = whole.blocks()[i];
        ASSERT_EQ(std::make_tuple(a.id, a.start, a.count, a.precision, a.version),
                  std::make_tuple(b.id, b.start, b.count, b.precision, b.version))
            << at << " entry " << i;
      }
      ASSERT_EQ(middle.size(), old_middle.size()) << at;  // the old entries, for an unwind
      for (size_t i = 0; i < middle.size(); ++i) ASSERT_EQ(middle[i].id, old_middle[i].id) << at;
      ASSERT_EQ(ranged.changed_version(), whole.changed_version()) << at;
      ASSERT_EQ(ranged.previous_changed_version(), whole.previous_changed_version()) << at;
      // The untouched run holds what it says: entry i is entry i - shift of the list last
      // published, as it was there (a swap that changed nothing is no change).
      changed_since = changed_since || ranged.changed_version() == version;
      for (const Stream* st : {&ranged, &whole}) {
        if (!changed_since) break;
        ASSERT_EQ(st->untouched_base(), base_version) << at;
        const std::vector<StreamBlock>& before = base;
        const Stream::UntouchedRun& run = st->untouched();
        ASSERT_LE(run.begin, run.end) << at;
        ASSERT_LE(run.end, st->blocks().size()) << at;
        for (size_t i = run.begin; i < run.end; ++i) {
          const ptrdiff_t was = static_cast<ptrdiff_t>(i) - run.shift;
          ASSERT_GE(was, 0) << at;
          ASSERT_LT(static_cast<size_t>(was), before.size()) << at;
          const StreamBlock& a = st->blocks()[i];
          const StreamBlock& b = before[static_cast<size_t>(was)];
          ASSERT_EQ(std::make_tuple(a.id, a.start, a.count, a.precision, a.version),
                    std::make_tuple(b.id, b.start, b.count, b.precision, b.version))
              << at << " entry " << i << (st == &ranged ? " (range swap" : " (whole swap") << " ["
              << from << ", " << to << ") of " << before.size() << " -> " << st->blocks().size()
              << ", run [" << run.begin << ", " << run.end << ") shift " << run.shift << ")";
        }
      }
      ASSERT_EQ(ranged.layout_slots(), whole.layout_slots()) << at;
      ASSERT_EQ(ranged.quantized_slots(), whole.quantized_slots()) << at;
      ASSERT_EQ(ranged.quantized_blocks(), whole.quantized_blocks()) << at;
      for (int which : {0, 1}) {
        if (rng() % 3 == 0) continue;  // left for a later step: changes accumulate
        mark(which);
        for (size_t i = 0; i < ranged.blocks().size(); ++i) {
          ASSERT_EQ(ranged.blocks()[i].published_index[which],
                    whole.blocks()[i].published_index[which])
              << at << " entry " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvmem::engine
