// The client's application of table updates: a delta that checks out applies exactly; one
// that does not (another version, a stream named twice, runs out of order or out of
// bounds, counts that disagree) changes nothing, so the client fetches the table instead.
#include "kvmem/table_update.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmem::client::internal {
namespace {

// A held table of sequence 7 at version 10: one stream of blocks 1, 2, 3 (4 slots each),
// positions 0..11.
BlockTable Held() {
  BlockTable t;
  t.sequence_id = 7;
  t.version = 10;
  t.positions = true;
  StreamTable st;
  for (uint32_t id = 1; id <= 3; ++id) {
    st.blocks.push_back({id, id * 1000ull, 0, 4, Precision::kLayout});
  }
  for (int64_t p = 0; p < 12; ++p) st.positions.push_back(p);
  t.streams.push_back(st);
  return t;
}

// One stream's part of a delta as a test writes it; Pack lays the streams out in the
// delta's columns.
struct StreamPart {
  uint32_t stream = 0;
  uint32_t block_count = 0;
  std::vector<uint32_t> kept_at, kept_from, kept_count;
  std::vector<TableBlock> blocks;
  std::vector<int64_t> positions;
  void Run(uint32_t at, uint32_t from, uint32_t count) {
    kept_at.push_back(at);
    kept_from.push_back(from);
    kept_count.push_back(count);
  }
};

struct Delta {
  uint64_t base_version = 10, version = 11, epoch = 3;
  std::vector<StreamPart> streams;
};

v1::TableUpdate Pack(const Delta& delta) {
  v1::TableUpdate u;
  v1::TableDelta* d = u.mutable_delta();
  d->set_base_version(delta.base_version);
  d->set_version(delta.version);
  d->set_epoch(delta.epoch);
  for (const StreamPart& s : delta.streams) {
    d->add_stream(s.stream);
    d->add_block_count(s.block_count);
    d->add_run_count(static_cast<uint32_t>(s.kept_at.size()));
    for (size_t r = 0; r < s.kept_at.size(); ++r) {
      d->add_kept_at(s.kept_at[r]);
      d->add_kept_from(s.kept_from[r]);
      d->add_kept_count(s.kept_count[r]);
    }
    for (const TableBlock& b : s.blocks) {
      d->add_block_ids(b.id);
      d->add_block_offsets(b.offset);
      d->add_block_precisions(static_cast<v1::Precision>(b.precision));
      d->add_block_starts(b.start);
      d->add_block_counts(b.count);
    }
    d->mutable_positions()->Add(s.positions.begin(), s.positions.end());
  }
  return u;
}

// The head block dropped, block 3 grew by one slot (given again), block 2 kept: the list
// becomes 2, 3'.
Delta HeadDropped() {
  StreamPart s;
  s.stream = 0;
  s.block_count = 2;
  s.Run(0, 1, 1);
  s.blocks.push_back({3, 3000, 0, 5, Precision::kLayout});
  s.positions = {8, 9, 10, 11, 12};
  return Delta{10, 11, 3, {s}};
}

std::vector<uint32_t> Ids(const BlockTable& t) {
  std::vector<uint32_t> ids;
  for (const TableBlock& b : t.streams[0].blocks) ids.push_back(b.id);
  return ids;
}

TEST(TableUpdateTest, ADeltaThatChecksOutApplies) {
  BlockTable t = Held();
  ASSERT_TRUE(ApplyTableUpdate(7, Pack(HeadDropped()), &t));
  EXPECT_THAT(Ids(t), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(t.streams[0].blocks[1].count, 5u);
  EXPECT_THAT(t.streams[0].positions, ::testing::ElementsAre(4, 5, 6, 7, 8, 9, 10, 11, 12));
  EXPECT_EQ(t.version, 11u);
  EXPECT_EQ(t.epoch, 3u);
}

TEST(TableUpdateTest, ADeltaThatDoesNotCheckOutChangesNothing) {
  // Spoiled as a test writes a delta (stream by stream), or in its packed columns.
  struct Case {
    const char* what;
    void (*spoil)(Delta&, BlockTable&);
    void (*spoil_columns)(v1::TableDelta&);
  };
  const auto none = [](v1::TableDelta&) {};
  const Case cases[] = {
      {"another base version", [](Delta& d, BlockTable&) { d.base_version = 9; }, none},
      {"another sequence's table", [](Delta&, BlockTable& t) { t.sequence_id = 8; }, none},
      {"a stream named twice", [](Delta& d, BlockTable&) { d.streams.push_back(d.streams[0]); },
       none},
      {"a stream the table lacks", [](Delta& d, BlockTable&) { d.streams[0].stream = 1; }, none},
      {"a run past the held list", [](Delta& d, BlockTable&) { d.streams[0].kept_from[0] = 3; },
       none},
      {"runs taking held entries twice",
       [](Delta& d, BlockTable&) {
         d.streams[0].block_count = 3;
         d.streams[0].Run(2, 1, 1);
       },
       none},
      {"runs overlapping in the new list",
       [](Delta& d, BlockTable&) {
         d.streams[0].kept_count[0] = 2;
         d.streams[0].block_count = 3;
         d.streams[0].Run(1, 2, 1);
       },
       none},
      {"runs out of order in the new list only",
       [](Delta& d, BlockTable&) {
         // {at 0, from 0, 2} and {at 1, from 2, 1}: in order in the held list, 3 kept for a
         // list of 3 with nothing given, but the second run starts inside the first.
         StreamPart& s = d.streams[0];
         s.block_count = 3;
         s.kept_from[0] = 0;
         s.kept_count[0] = 2;
         s.Run(1, 2, 1);
         s.blocks.clear();
         s.positions.clear();
       },
       none},
      {"entries that do not fill the list",
       [](Delta& d, BlockTable&) { d.streams[0].block_count = 3; }, none},
      {"more kept than the list holds",
       [](Delta& d, BlockTable&) {
         d.streams[0].block_count = 1;
         d.streams[0].blocks.clear();
         d.streams[0].positions.clear();
         d.streams[0].kept_count[0] = 2;
       },
       none},
      {"positions that disagree with the given blocks",
       [](Delta& d, BlockTable&) { d.streams[0].positions.push_back(13); }, none},
      {"held positions that disagree with the held blocks",
       [](Delta&, BlockTable& t) { t.streams[0].positions.pop_back(); }, none},
      {"block columns of different lengths", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) { d.add_block_starts(0); }},
      {"run columns of different lengths", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) { d.add_kept_at(0); }},
      {"stream columns of different lengths", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) { d.add_run_count(0); }},
      {"a run count past the runs", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) { d.set_run_count(0, 2); }},
      {"runs no stream counts", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) {
         d.add_kept_at(2);
         d.add_kept_from(2);
         d.add_kept_count(0);
       }},
      {"given entries no stream takes", [](Delta&, BlockTable&) {},
       [](v1::TableDelta& d) {
         d.add_block_ids(9);
         d.add_block_offsets(9000);
         d.add_block_precisions(v1::PRECISION_LAYOUT);
         d.add_block_starts(0);
         d.add_block_counts(1);
       }},
  };
  for (const Case& c : cases) {
    Delta delta = HeadDropped();
    BlockTable t = Held();
    c.spoil(delta, t);
    v1::TableUpdate u = Pack(delta);
    c.spoil_columns(*u.mutable_delta());
    const BlockTable before = t;
    EXPECT_FALSE(ApplyTableUpdate(7, u, &t)) << c.what;
    EXPECT_EQ(Ids(t), Ids(before)) << c.what;
    EXPECT_EQ(t.streams[0].positions, before.streams[0].positions) << c.what;
    EXPECT_EQ(t.version, before.version) << c.what;
  }
}

TEST(TableUpdateTest, StreamsOutOfOrderChangeNothing) {
  // Two streams, each losing its head block; listed 1 then 0, the delta is refused.
  BlockTable t = Held();
  t.positions = false;
  t.streams.push_back(t.streams[0]);
  for (StreamTable& st : t.streams) st.positions.clear();
  Delta delta;
  for (uint32_t s : {1u, 0u}) {
    StreamPart p;
    p.stream = s;
    p.block_count = 2;
    p.Run(0, 1, 2);
    delta.streams.push_back(p);
  }
  const BlockTable before = t;
  EXPECT_FALSE(ApplyTableUpdate(7, Pack(delta), &t));
  EXPECT_EQ(Ids(t), Ids(before));
  std::swap(delta.streams[0], delta.streams[1]);
  ASSERT_TRUE(ApplyTableUpdate(7, Pack(delta), &t));
  EXPECT_THAT(Ids(t), ::testing::ElementsAre(2, 3));
  ASSERT_EQ(t.streams[1].blocks.size(), 2u);
  EXPECT_EQ(t.streams[1].blocks[0].id, 2u);
}

TEST(TableUpdateTest, ADeltaOfAnOldFormatIsNoUpdate) {
  // Fields 1 and 3 of TableUpdate carried earlier formats: a daemon from before a change
  // sends one, this client sees no update (and fetches the table) instead of misreading it.
  const v1::TableUpdate current = Pack(HeadDropped());
  const std::string delta = current.delta().SerializeAsString();
  ASSERT_LT(delta.size(), 128u);  // one varint byte of length
  for (int field : {1, 3}) {
    std::string old_bytes;
    old_bytes.push_back(static_cast<char>((field << 3) | 2));  // length-delimited
    old_bytes.push_back(static_cast<char>(delta.size()));
    old_bytes += delta;
    v1::TableUpdate parsed;
    ASSERT_TRUE(parsed.ParseFromString(old_bytes)) << field;
    BlockTable t = Held();
    EXPECT_FALSE(ApplyTableUpdate(7, parsed, &t)) << field;
    EXPECT_EQ(t.version, 10u) << field;
  }
}

// Random deltas over four streams, against the lists they describe: kept runs that stay at
// their index (an append's tail, a window's first block: applied in place when the table
// keeps no positions), runs that shift (built anew) and empty runs, mixed in one delta; with
// and without positions. Every block's fields, and the positions, must come out as the new
// list has them; a list changed in place keeps its buffer. One delta in five is spoiled
// after its streams (a count, a column, a run, a stream named twice): it must change nothing.
TEST(TableUpdateTest, RandomDeltasApplyInPlaceAndRebuiltAlike) {
  std::mt19937 rng(5);
  uint32_t next_id = 1;
  auto block = [&] {
    const uint32_t id = next_id++;
    return TableBlock{id, id * 64ull, static_cast<uint32_t>(rng() % 4),
                      1 + static_cast<uint32_t>(rng() % 12),
                      rng() % 5 == 0 ? Precision::kInt8 : Precision::kLayout};
  };
  auto same = [](const TableBlock& x, const TableBlock& y) {
    return x.id == y.id && x.offset == y.offset && x.start == y.start && x.count == y.count &&
           x.precision == y.precision;
  };
  for (int round = 0; round < 4000; ++round) {
    const bool positions = round % 3 == 0;
    BlockTable t;
    t.sequence_id = 7;
    t.version = 10;
    t.positions = positions;
    std::vector<std::vector<TableBlock>> want(4);
    std::vector<std::vector<int64_t>> want_positions(4);
    std::vector<const TableBlock*> kept_buffer(4, nullptr);  // in place: the buffer stays
    Delta d;
    for (uint32_t s = 0; s < 4; ++s) {
      StreamTable st;
      for (size_t n = rng() % 40; n > 0; --n) st.blocks.push_back(block());
      std::vector<size_t> first_slot = {0};
      for (const TableBlock& b : st.blocks) {
        for (uint32_t j = 0; j < b.count; ++j) st.positions.push_back(100000 * s + b.id * 16 + j);
        first_slot.push_back(first_slot.back() + b.count);
      }
      t.streams.push_back(st);
      if (rng() % 4 == 0) {
        want[s] = st.blocks;  // unchanged: not in the delta
        want_positions[s] = st.positions;
        continue;
      }
      d.streams.emplace_back();
      StreamPart* sd = &d.streams.back();
      sd->stream = s;
      const bool shifts = rng() % 2 == 0;
      size_t from = shifts ? rng() % (st.blocks.size() + 1) : 0;  // shifted: a dropped front
      const size_t m = rng() % (st.blocks.size() + 4);
      for (size_t at = 0; at <= m; ++at) {
        if (from <= st.blocks.size() && rng() % 10 == 0) {  // an empty run, anywhere
          sd->Run(static_cast<uint32_t>(at), static_cast<uint32_t>(from), 0);
        }
        if (at == m) break;
        const bool keep = from < st.blocks.size() && rng() % 4 != 0;
        if (keep) {
          const size_t runs = sd->kept_at.size();
          const bool continues = runs > 0 && sd->kept_count.back() > 0 &&
                                 sd->kept_at.back() + sd->kept_count.back() == at &&
                                 sd->kept_from.back() + sd->kept_count.back() == from;
          if (continues) {
            ++sd->kept_count.back();
          } else {
            sd->Run(static_cast<uint32_t>(at), static_cast<uint32_t>(from), 1);
          }
          want[s].push_back(st.blocks[from]);
          want_positions[s].insert(want_positions[s].end(), st.positions.begin() + first_slot[from],
                                   st.positions.begin() + first_slot[from + 1]);
        } else {
          const TableBlock b = block();
          want[s].push_back(b);
          sd->blocks.push_back(b);
          for (uint32_t j = 0; j < b.count; ++j) {
            sd->positions.push_back(900000 + b.id * 16 + j);
            want_positions[s].push_back(900000 + b.id * 16 + j);
          }
        }
        // In place, kept entries stay at their index; shifted, dropped ones may sit between.
        from = keep || !shifts ? from + 1 : from + rng() % 2;
      }
      sd->block_count = static_cast<uint32_t>(m);
      if (!positions) sd->positions.clear();
      if (!positions && !shifts && m <= t.streams[s].blocks.capacity()) {
        kept_buffer[s] = t.streams[s].blocks.data();
      }
    }
    if (round % 5 == 4 && !d.streams.empty()) {
      const BlockTable before = t;
      StreamPart* last = &d.streams.back();
      enum { kNone, kLongerColumn, kRunCountTooMany } in_columns = kNone;
      switch (rng() % 7) {
        case 0:
          ++last->block_count;
          break;
        case 1:
          in_columns = kLongerColumn;  // one column longer than the others, below
          break;
        case 2:
          last->Run(last->block_count,  // a run past the held list
                    static_cast<uint32_t>(t.streams[last->stream].blocks.size()), 1);
          break;
        case 3:
          d.streams.push_back(d.streams[0]);  // a stream named twice
          break;
        case 4:
          if (last->kept_at.empty() || last->kept_count[0] == 0) {
            ++last->block_count;
            break;
          }
          last->Run(last->kept_at[0], last->kept_from[0], last->kept_count[0]);  // out of order
          last->block_count += last->kept_count[0];
          break;
        case 5:
          if (d.streams.size() < 2) {
            ++last->block_count;
            break;
          }
          std::swap(d.streams.front(), d.streams.back());  // streams out of order
          break;
        case 6:
          in_columns = kRunCountTooMany;  // the last stream counts a run the columns lack
          break;
      }
      v1::TableUpdate u = Pack(d);
      v1::TableDelta* columns = u.mutable_delta();
      if (in_columns == kLongerColumn) columns->add_block_starts(0);
      if (in_columns == kRunCountTooMany) {
        const int i = columns->run_count_size() - 1;
        columns->set_run_count(i, columns->run_count(i) + 1);
      }
      ASSERT_FALSE(ApplyTableUpdate(7, u, &t)) << "round " << round << "\n" << u.DebugString();
      ASSERT_EQ(t.version, 10u);
      for (uint32_t s = 0; s < 4; ++s) {
        ASSERT_EQ(t.streams[s].blocks.size(), before.streams[s].blocks.size()) << "round " << round;
        for (size_t i = 0; i < t.streams[s].blocks.size(); ++i) {
          ASSERT_TRUE(same(t.streams[s].blocks[i], before.streams[s].blocks[i]))
              << "round " << round << " stream " << s << " entry " << i;
        }
        ASSERT_EQ(t.streams[s].positions, before.streams[s].positions) << "round " << round;
      }
      continue;
    }
    const v1::TableUpdate u = Pack(d);
    ASSERT_TRUE(ApplyTableUpdate(7, u, &t)) << "round " << round << "\n" << u.DebugString();
    for (uint32_t s = 0; s < 4; ++s) {
      ASSERT_EQ(t.streams[s].blocks.size(), want[s].size()) << "round " << round;
      for (size_t i = 0; i < want[s].size(); ++i) {
        ASSERT_TRUE(same(t.streams[s].blocks[i], want[s][i]))
            << "round " << round << " stream " << s << " entry " << i;
      }
      if (positions) {
        ASSERT_EQ(t.streams[s].positions, want_positions[s]) << "round " << round;
      }
      if (kept_buffer[s] != nullptr) {
        ASSERT_EQ(t.streams[s].blocks.data(), kept_buffer[s])
            << "round " << round << " stream " << s;
      }
    }
    EXPECT_EQ(t.version, 11u);
  }
}

}  // namespace
}  // namespace kvmem::client::internal
