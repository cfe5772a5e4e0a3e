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

// The head block dropped, block 3 grew by one slot (given again), block 2 kept: the list
// becomes 2, 3'.
v1::TableUpdate HeadDropped() {
  v1::TableUpdate u;
  v1::TableDelta* d = u.mutable_delta();
  d->set_base_version(10);
  d->set_version(11);
  d->set_epoch(3);
  v1::StreamDelta* s = d->add_streams();
  s->set_stream(0);
  s->set_block_count(2);
  s->add_kept_at(0);
  s->add_kept_from(1);
  s->add_kept_count(1);
  s->add_block_ids(3);
  s->add_block_offsets(3000);
  s->add_block_precisions(v1::PRECISION_LAYOUT);
  s->add_block_starts(0);
  s->add_block_counts(5);
  for (int64_t p : {8, 9, 10, 11, 12}) s->add_positions(p);
  return u;
}

std::vector<uint32_t> Ids(const BlockTable& t) {
  std::vector<uint32_t> ids;
  for (const TableBlock& b : t.streams[0].blocks) ids.push_back(b.id);
  return ids;
}

TEST(TableUpdateTest, ADeltaThatChecksOutApplies) {
  BlockTable t = Held();
  ASSERT_TRUE(ApplyTableUpdate(7, HeadDropped(), &t));
  EXPECT_THAT(Ids(t), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(t.streams[0].blocks[1].count, 5u);
  EXPECT_THAT(t.streams[0].positions, ::testing::ElementsAre(4, 5, 6, 7, 8, 9, 10, 11, 12));
  EXPECT_EQ(t.version, 11u);
  EXPECT_EQ(t.epoch, 3u);
}

TEST(TableUpdateTest, ADeltaThatDoesNotCheckOutChangesNothing) {
  struct Case {
    const char* what;
    void (*spoil)(v1::TableUpdate&, BlockTable&);
  };
  const Case cases[] = {
      {"another base version",
       [](v1::TableUpdate& u, BlockTable&) { u.mutable_delta()->set_base_version(9); }},
      {"another sequence's table", [](v1::TableUpdate&, BlockTable& t) { t.sequence_id = 8; }},
      {"a stream named twice",
       [](v1::TableUpdate& u, BlockTable&) {
         *u.mutable_delta()->add_streams() = u.delta().streams(0);
       }},
      {"a stream the table lacks",
       [](v1::TableUpdate& u, BlockTable&) {
         u.mutable_delta()->mutable_streams(0)->set_stream(1);
       }},
      {"a run past the held list",
       [](v1::TableUpdate& u, BlockTable&) {
         u.mutable_delta()->mutable_streams(0)->set_kept_from(0, 3);
       }},
      {"runs taking held entries twice",
       [](v1::TableUpdate& u, BlockTable&) {
         v1::StreamDelta* s = u.mutable_delta()->mutable_streams(0);
         s->set_block_count(3);
         s->add_kept_at(2);
         s->add_kept_from(1);
         s->add_kept_count(1);
       }},
      {"runs overlapping in the new list",
       [](v1::TableUpdate& u, BlockTable&) {
         v1::StreamDelta* s = u.mutable_delta()->mutable_streams(0);
         s->set_kept_count(0, 2);
         s->set_block_count(3);
         s->add_kept_at(1);
         s->add_kept_from(2);
         s->add_kept_count(1);
       }},
      {"runs out of order in the new list only",
       [](v1::TableUpdate& u, BlockTable&) {
         // {at 0, from 0, 2} and {at 1, from 2, 1}: in order in the held list, 3 kept for a
         // list of 3 with nothing given, but the second run starts inside the first.
         v1::StreamDelta* s = u.mutable_delta()->mutable_streams(0);
         s->set_block_count(3);
         s->set_kept_from(0, 0);
         s->set_kept_count(0, 2);
         s->add_kept_at(1);
         s->add_kept_from(2);
         s->add_kept_count(1);
         s->clear_block_ids();
         s->clear_block_offsets();
         s->clear_block_precisions();
         s->clear_block_starts();
         s->clear_block_counts();
         s->clear_positions();
       }},
      {"entries that do not fill the list",
       [](v1::TableUpdate& u, BlockTable&) {
         u.mutable_delta()->mutable_streams(0)->set_block_count(3);
       }},
      {"positions that disagree with the given blocks",
       [](v1::TableUpdate& u, BlockTable&) {
         u.mutable_delta()->mutable_streams(0)->add_positions(13);
       }},
      {"columns of different lengths",
       [](v1::TableUpdate& u, BlockTable&) {
         u.mutable_delta()->mutable_streams(0)->add_block_starts(0);
       }},
      {"held positions that disagree with the held blocks",
       [](v1::TableUpdate&, BlockTable& t) { t.streams[0].positions.pop_back(); }},
  };
  for (const Case& c : cases) {
    v1::TableUpdate u = HeadDropped();
    BlockTable t = Held();
    c.spoil(u, t);
    const BlockTable before = t;
    EXPECT_FALSE(ApplyTableUpdate(7, u, &t)) << c.what;
    EXPECT_EQ(Ids(t), Ids(before)) << c.what;
    EXPECT_EQ(t.streams[0].positions, before.streams[0].positions) << c.what;
    EXPECT_EQ(t.version, before.version) << c.what;
  }
}

TEST(TableUpdateTest, ADeltaOfTheOldFormatIsNoUpdate) {
  // Field 1 of TableUpdate carried the old format: a daemon from before the change sends
  // it, this client sees no update (and fetches the table) instead of misreading it.
  v1::TableUpdate current = HeadDropped();
  std::string old_bytes;
  {
    std::string delta = current.delta().SerializeAsString();
    old_bytes.push_back(static_cast<char>((1 << 3) | 2));  // field 1, length-delimited
    old_bytes.push_back(static_cast<char>(delta.size()));  // < 128 bytes: one varint byte
    old_bytes += delta;
  }
  ASSERT_LT(current.delta().ByteSizeLong(), 128u);
  v1::TableUpdate parsed;
  ASSERT_TRUE(parsed.ParseFromString(old_bytes));
  BlockTable t = Held();
  EXPECT_FALSE(ApplyTableUpdate(7, parsed, &t));
  EXPECT_EQ(t.version, 10u);
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
    v1::TableUpdate u;
    v1::TableDelta* d = u.mutable_delta();
    d->set_base_version(10);
    d->set_version(11);
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
      v1::StreamDelta* sd = d->add_streams();
      sd->set_stream(s);
      const bool shifts = rng() % 2 == 0;
      size_t from = shifts ? rng() % (st.blocks.size() + 1) : 0;  // shifted: a dropped front
      const size_t m = rng() % (st.blocks.size() + 4);
      for (size_t at = 0; at <= m; ++at) {
        if (from <= st.blocks.size() && rng() % 10 == 0) {  // an empty run, anywhere
          sd->add_kept_at(static_cast<uint32_t>(at));
          sd->add_kept_from(static_cast<uint32_t>(from));
          sd->add_kept_count(0);
        }
        if (at == m) break;
        const bool keep = from < st.blocks.size() && rng() % 4 != 0;
        if (keep) {
          const int last = sd->kept_at_size() - 1;
          const bool continues = last >= 0 && sd->kept_count(last) > 0 &&
                                 sd->kept_at(last) + sd->kept_count(last) == at &&
                                 sd->kept_from(last) + sd->kept_count(last) == from;
          if (continues) {
            sd->set_kept_count(last, sd->kept_count(last) + 1);
          } else {
            sd->add_kept_at(static_cast<uint32_t>(at));
            sd->add_kept_from(static_cast<uint32_t>(from));
            sd->add_kept_count(1);
          }
          want[s].push_back(st.blocks[from]);
          want_positions[s].insert(want_positions[s].end(), st.positions.begin() + first_slot[from],
                                   st.positions.begin() + first_slot[from + 1]);
        } else {
          const TableBlock b = block();
          want[s].push_back(b);
          sd->add_block_ids(b.id);
          sd->add_block_offsets(b.offset);
          sd->add_block_starts(b.start);
          sd->add_block_counts(b.count);
          sd->add_block_precisions(static_cast<v1::Precision>(b.precision));
          for (uint32_t j = 0; j < b.count; ++j) {
            sd->add_positions(900000 + b.id * 16 + j);
            want_positions[s].push_back(900000 + b.id * 16 + j);
          }
        }
        // In place, kept entries stay at their index; shifted, dropped ones may sit between.
        from = keep || !shifts ? from + 1 : from + rng() % 2;
      }
      sd->set_block_count(static_cast<uint32_t>(m));
      if (!positions) sd->clear_positions();
      if (!positions && !shifts && m <= t.streams[s].blocks.capacity()) {
        kept_buffer[s] = t.streams[s].blocks.data();
      }
    }
    if (round % 5 == 4 && d->streams_size() > 0) {
      const BlockTable before = t;
      v1::StreamDelta* last = d->mutable_streams(d->streams_size() - 1);
      switch (rng() % 5) {
        case 0:
          last->set_block_count(last->block_count() + 1);
          break;
        case 1:
          last->add_block_starts(0);  // one column longer than the others
          break;
        case 2:
          last->add_kept_at(last->block_count());  // a run past the held list
          last->add_kept_from(static_cast<uint32_t>(t.streams[last->stream()].blocks.size()));
          last->add_kept_count(1);
          break;
        case 3:
          *d->add_streams() = d->streams(0);  // a stream named twice
          break;
        case 4:
          if (last->kept_at_size() == 0 || last->kept_count(0) == 0) {
            last->set_block_count(last->block_count() + 1);
            break;
          }
          last->add_kept_at(last->kept_at(0));  // a run out of order
          last->add_kept_from(last->kept_from(0));
          last->add_kept_count(last->kept_count(0));
          last->set_block_count(last->block_count() + last->kept_count(0));
          break;
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
