// A sequence moved between two engines (sequence_move.h): the receiver's copy holds what the
// holder's did and steps exactly as it would have; the holder's sequence is frozen during
// the move and gone after it; a receiver refuses a malformed export and keeps nothing of it.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "server/store/cpu_backend.h"
#include "tests/testing/engine_twins.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;
using twins::kD;
using twins::kH;
using twins::kL;

std::unique_ptr<Engine> MakeEngine(FakeClock* clock, bool device_step,
                                   uint64_t pool_bytes = 8 << 20) {
  EngineConfig config;
  config.pool_bytes = pool_bytes;
  config.page_bytes = 4096;
  config.device_step = device_step;
  config.reclaim_reserve_pages = 0;
  return *Engine::Create(config, *store::CpuBackend::Create(config.pool_bytes), clock);
}

Layout MoveLayout() { return Layout{kL, kH, kD, DType::kF16, twins::kB, twins::kVocab}; }

// The state without block ids and offsets (which differ between engines).
std::string Content(Engine& e, uint64_t id) {
  absl::StatusOr<std::string> fp = e.Fingerprint(id);
  if (!fp.ok()) return fp.status().ToString();
  std::string out;
  for (absl::string_view line : absl::StrSplit(*fp, '\n')) {
    if (!absl::StartsWith(line, "blocks")) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

struct Exported {
  MovedHeader header;
  std::vector<MovedPiece> pieces;
};

absl::StatusOr<Exported> Export(Engine& from, uint64_t id, absl::Duration hold = absl::Minutes(1)) {
  Exported out;
  std::vector<std::vector<float>> scores;
  absl::StatusOr<MovedHeader> header = from.BeginExport(id, hold, &scores);
  if (!header.ok()) return header.status();
  out.header = *header;
  ExportCursor cursor;
  for (;;) {
    MovedPiece piece;
    absl::StatusOr<bool> more =
        from.ExportPiece(id, header->export_id, scores, false, &cursor, &piece);
    if (!more.ok()) return more.status();
    if (!*more) break;
    out.pieces.push_back(std::move(piece));
  }
  return out;
}

// A piece's bytes landed in place as the UCX gets land them (SequenceImport::Reserve): the
// piece without its bytes reserved, then each block's bytes copied where Reserve says.
absl::Status LandInPlace(SequenceImport& import, const MovedPiece& piece) {
  MovedPiece by_offsets = piece;
  by_offsets.data.clear();
  absl::StatusOr<std::vector<uint8_t*>> at = import.Reserve(by_offsets);
  if (!at.ok()) return at.status();
  uint64_t from = 0;
  for (size_t i = 0; i < piece.blocks.size(); ++i) {
    const uint64_t n = import.format().block_bytes(piece.blocks[i].precision);
    std::memcpy((*at)[i], piece.data.data() + from, n);
    from += n;
  }
  import.Landed(1);
  return absl::OkStatus();
}

absl::StatusOr<CreateResult> Import(Engine& to, const Exported& exported,
                                    const std::string& owner = "", bool landing = false) {
  absl::StatusOr<std::unique_ptr<SequenceImport>> import = to.BeginImport(exported.header, owner);
  if (!import.ok()) return import.status();
  for (const MovedPiece& piece : exported.pieces) {
    if (absl::Status s = landing ? LandInPlace(**import, piece) : (*import)->Add(piece); !s.ok()) {
      return s;
    }
  }
  return to.CommitImport(**import, absl::ZeroDuration());
}

absl::StatusOr<CreateResult> Move(Engine& from, uint64_t id, Engine& to, bool landing = false) {
  absl::StatusOr<Exported> exported = Export(from, id);
  if (!exported.ok()) return exported.status();
  absl::StatusOr<CreateResult> moved = Import(to, *exported, "", landing);
  if (!moved.ok()) {
    from.FinishExport(id, exported->header.export_id, false).IgnoreError();
    return moved.status();
  }
  if (absl::StatusOr<uint64_t> f = from.FinishExport(id, exported->header.export_id, true);
      !f.ok()) {
    return f.status();
  }
  return moved;
}

// One token appended (with the per-token signals a policy needs) and one step.
class Workload {
 public:
  Workload(const policy::PolicyDescriptor& d, uint32_t seed) : d_(d), rng_(seed) {}

  absl::Status Append(Engine& e, uint64_t id, int64_t first, uint32_t n) {
    const std::vector<int64_t> positions = testing::Range(first, n);
    const std::string k = testing::PayloadF16(kL * kH, first, n, kD, 0);
    const std::string v = testing::PayloadF16(kL * kH, first, n, kD, 1);
    std::vector<int32_t> tokens(n);
    for (uint32_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((first + i) % 97);
    std::vector<float> entropy, distance;
    if (d_.append_signals != 0) {
      for (uint32_t i = 0; i < n; ++i) {
        entropy.push_back(static_cast<float>((first + i) % 7) * 0.3f);
        distance.push_back(static_cast<float>((first + i) % 5) * 0.2f);
      }
    }
    AppendChunk chunk{positions, tokens, k, v, entropy, distance};
    return e.Append(id, absl::MakeConstSpan(&chunk, 1)).status();
  }

  // The next step's input for a sequence whose table is `table` (valid until the next).
  StepInput Next(const BlockTable& table) {
    StepInput in;
    rows_ = twins::Rows(table, rng_);
    in.attention = twins::Signals(rows_);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    const float p1 = 0.05f + 0.9f * unit(rng_);
    in.logits = RawLogitStats{unit(rng_) * std::log(float(twins::kVocab)), p1, p1 * unit(rng_), {}};
    return in;
  }

 private:
  const policy::PolicyDescriptor& d_;
  std::mt19937 rng_;
  std::vector<std::vector<float>> rows_;
};

struct MoveCase {
  const char* policy;
  policy::ParamOverrides params;
  QuantConfig quant;
};

std::vector<MoveCase> MoveCases() {
  std::vector<MoveCase> cases;
  for (const twins::Case& c : twins::Cases()) cases.push_back({c.policy, c.params, c.quant});
  cases.push_back({"full", {}, {}});
  cases.push_back({"window", {{"window", 40}}, {kernels::QuantType::kNF4, 24}});
  cases.push_back({"refreekv", {}, {}});
  cases.push_back({"infokv", {{"history", 4}}, {}});
  return cases;
}

// The cases, with the engines' device step or not, and the blocks' bytes in the pieces or
// landed in place.
class SequenceMoveTest : public ::testing::TestWithParam<std::tuple<MoveCase, bool, bool>> {};

TEST_P(SequenceMoveTest, TheMovedSequenceStepsAsTheHoldersWouldHave) {
  const auto& [c, device_step, landing] = GetParam();
  FakeClock clock;
  std::unique_ptr<Engine> a = MakeEngine(&clock, device_step), b = MakeEngine(&clock, device_step);
  const uint64_t id = a->CreateSequence(MoveLayout(), c.policy, c.params, c.quant, {})->sequence_id;
  auto policy = *policy::CreatePolicy(c.policy, c.params);
  Workload work(policy->descriptor(), 11);
  ASSERT_TRUE(work.Append(*a, id, 0, 120).ok());
  for (int64_t t = 120; t < 220; ++t) {
    ASSERT_TRUE(work.Append(*a, id, t, 1).ok());
    const BlockTable table = *a->GetBlockTable(id);
    StepInput in = work.Next(table);
    in.epoch = table.epoch;
    absl::StatusOr<StepResult> stepped = a->Step(id, in);
    ASSERT_TRUE(stepped.ok()) << t << ": " << stepped.status();
  }
  // The twin stays with the holder: what the moved sequence must go on doing.
  const uint64_t twin = a->Fork(id, {})->sequence_id;
  const std::string before = Content(*a, id);
  const uint64_t blocks_before = a->Stats(false).pool.blocks_used;
  absl::StatusOr<CreateResult> moved = Move(*a, id, *b, landing);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(Content(*b, moved->sequence_id), before);
  EXPECT_EQ(a->GetBlockTable(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a->Stats(false).pool.blocks_used, blocks_before);  // the twin shares them all
  twins::ExpectContent(*b, moved->sequence_id, c.quant.type);

  for (int64_t t = 220; t < 300; ++t) {
    const std::string at = "step " + std::to_string(t);
    ASSERT_TRUE(work.Append(*a, twin, t, 1).ok()) << at;
    ASSERT_TRUE(work.Append(*b, moved->sequence_id, t, 1).ok()) << at;
    const BlockTable table = *a->GetBlockTable(twin);
    StepInput in = work.Next(table);
    in.epoch = table.epoch;
    absl::StatusOr<StepResult> ra = a->Step(twin, in);
    in.epoch = b->GetBlockTable(moved->sequence_id)->epoch;
    absl::StatusOr<StepResult> rb = b->Step(moved->sequence_id, in);
    ASSERT_TRUE(ra.ok()) << at << ": " << ra.status();
    ASSERT_TRUE(rb.ok()) << at << ": " << rb.status();
    EXPECT_EQ(ra->evicted_tokens, rb->evicted_tokens) << at;
    EXPECT_EQ(ra->kv_bytes_after, rb->kv_bytes_after) << at;
    if (t % 20 == 0) ASSERT_EQ(Content(*a, twin), Content(*b, moved->sequence_id)) << at;
  }
  ASSERT_EQ(Content(*a, twin), Content(*b, moved->sequence_id));
  twins::ExpectContent(*b, moved->sequence_id, c.quant.type);
  ASSERT_TRUE(b->Release(moved->sequence_id).ok());
  ASSERT_TRUE(a->Release(twin).ok());
  EXPECT_EQ(a->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(b->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(b->Stats(false).host_metadata_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, SequenceMoveTest,
    ::testing::Combine(::testing::ValuesIn(MoveCases()), ::testing::Bool(), ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<MoveCase, bool, bool>>& info) {
      return std::string(std::get<0>(info.param).policy) + "_" + std::to_string(info.index) +
             (std::get<1>(info.param) ? "_device" : "_host") +
             (std::get<2>(info.param) ? "_landed" : "_bytes");
    });

class MoveFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeEngine(&clock_, false);
    b_ = MakeEngine(&clock_, false);
    id_ = a_->CreateSequence(MoveLayout(), "confkv", {{"c_high", 40}, {"c_low", 72}},
                             {kernels::QuantType::kInt8, 32}, {})
              ->sequence_id;
    auto confkv = *policy::CreatePolicy("confkv", {});
    Workload work(confkv->descriptor(), 3);
    ASSERT_TRUE(work.Append(*a_, id_, 0, 150).ok());
    const BlockTable table = *a_->GetBlockTable(id_);
    StepInput in = work.Next(table);
    in.epoch = table.epoch;
    ASSERT_TRUE(a_->Step(id_, in).ok());
  }
  absl::Status AppendOne(int64_t position) { return twins::Append(*a_, id_, position, 1); }

  FakeClock clock_;
  std::unique_ptr<Engine> a_, b_;
  uint64_t id_ = 0;
};

TEST_F(MoveFixture, AFrozenSequenceRefusesChangesUntilTheMoveEnds) {
  std::vector<std::vector<float>> scores;
  absl::StatusOr<MovedHeader> h = a_->BeginExport(id_, absl::Seconds(30), &scores);
  ASSERT_TRUE(h.ok()) << h.status();
  const std::string frozen = Content(*a_, id_);
  absl::Status refused = AppendOne(150);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("being moved"));
  EXPECT_EQ(a_->Step(id_, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a_->Fork(id_, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  // A second export waits too; reads go on.
  EXPECT_EQ(a_->BeginExport(id_, absl::Seconds(30), &scores).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(a_->GetBlockTable(id_).ok());
  EXPECT_EQ(Content(*a_, id_), frozen);
  // Abandoned: changes work again, and the old export is no more.
  ASSERT_TRUE(a_->FinishExport(id_, h->export_id, false).ok());
  EXPECT_TRUE(AppendOne(150).ok());
  EXPECT_EQ(a_->FinishExport(id_, h->export_id, true).status().code(), absl::StatusCode::kAborted);

  // A hold that lapses unfreezes it, and a late commit is refused: the holder keeps it.
  h = a_->BeginExport(id_, absl::Seconds(30), &scores);
  ASSERT_TRUE(h.ok());
  clock_.Advance(absl::Seconds(31));
  EXPECT_EQ(a_->FinishExport(id_, h->export_id, true).status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(AppendOne(151).ok());
  EXPECT_TRUE(a_->GetBlockTable(id_).ok());
  // A change after a lapse ends the export: a commit then finds none.
  h = a_->BeginExport(id_, absl::Seconds(30), &scores);
  ASSERT_TRUE(h.ok());
  clock_.Advance(absl::Seconds(31));
  EXPECT_TRUE(AppendOne(152).ok());
  EXPECT_EQ(a_->FinishExport(id_, h->export_id, true).status().code(), absl::StatusCode::kAborted);
  // A piece asked for after the lapse is refused as well.
  h = a_->BeginExport(id_, absl::Seconds(5), &scores);
  ASSERT_TRUE(h.ok());
  clock_.Advance(absl::Seconds(6));
  ExportCursor cursor;
  MovedPiece piece;
  EXPECT_EQ(a_->ExportPiece(id_, h->export_id, scores, false, &cursor, &piece).status().code(),
            absl::StatusCode::kAborted);
}

// An export by offsets holds every block it named until it ends, whichever way it ends.
TEST_F(MoveFixture, AnExportByOffsetsHoldsItsBlocksUntilItEnds) {
  const uint64_t blocks = a_->Stats(false).pool.blocks_used;
  for (int end = 0; end < 4; ++end) {
    std::vector<std::vector<float>> scores;
    absl::StatusOr<MovedHeader> h = a_->BeginExport(id_, absl::Seconds(30), &scores);
    ASSERT_TRUE(h.ok()) << h.status();
    ExportCursor cursor;
    MovedPiece piece;
    size_t named = 0;
    for (;;) {
      absl::StatusOr<bool> more = a_->ExportPiece(id_, h->export_id, scores, true, &cursor, &piece);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      EXPECT_TRUE(piece.data.empty());
      EXPECT_EQ(piece.offsets.size(), piece.blocks.size());
      named += piece.blocks.size();
    }
    EXPECT_GT(named, 0u);
    const uint64_t pages = a_->Stats(false).pool.pages_used;
    if (end == 0) {  // abandoned: the references go, the blocks stay the sequence's
      ASSERT_TRUE(a_->FinishExport(id_, h->export_id, false).ok());
      EXPECT_EQ(a_->Stats(false).pool.blocks_used, blocks);
    } else if (end == 1) {  // lapsed, then changed: the change ends it (and its references)
      clock_.Advance(absl::Seconds(31));
      ASSERT_TRUE(AppendOne(150).ok());
      EXPECT_EQ(a_->FinishExport(id_, h->export_id, false).status().code(),
                absl::StatusCode::kAborted);
    } else if (end == 2) {  // lapsed, then exported again: the lapsed one's references go
      clock_.Advance(absl::Seconds(31));
      absl::StatusOr<MovedHeader> again = a_->BeginExport(id_, absl::Seconds(30), &scores);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(a_->Stats(false).pool.pages_used, pages);
      ASSERT_TRUE(a_->FinishExport(id_, again->export_id, false).ok());
    } else {  // moved: everything goes
      ASSERT_TRUE(a_->FinishExport(id_, h->export_id, true).ok());
      EXPECT_EQ(a_->Stats(false).pool.blocks_used, 0u);
    }
    EXPECT_EQ(a_->Stats(false).pool.bad_unrefs, 0u);
  }
}

// The holder remembers a move it finished (a receiver asking again after a lost answer
// hears that it moved), for its owner only; its lease does not lapse while it is frozen.
TEST_F(MoveFixture, AFinishedMoveIsRememberedAndAFrozenSequenceDoesNotLapse) {
  absl::StatusOr<Exported> exported = Export(*a_, id_, absl::Minutes(5));
  ASSERT_TRUE(exported.ok());
  clock_.Advance(absl::Seconds(60));  // past its 10 s lease, within the hold
  EXPECT_EQ(a_->ExpireLeases(), 0u);
  const uint64_t export_id = exported->header.export_id;
  EXPECT_FALSE(a_->ExportMoved(id_, export_id, nullptr));
  ASSERT_TRUE(a_->FinishExport(id_, export_id, true).ok());
  const std::string none, other = "mallory";
  EXPECT_TRUE(a_->ExportMoved(id_, export_id, nullptr));
  EXPECT_TRUE(a_->ExportMoved(id_, export_id, &none));
  EXPECT_FALSE(a_->ExportMoved(id_, export_id, &other));
  EXPECT_FALSE(a_->ExportMoved(id_ + 1, export_id, nullptr));
  EXPECT_FALSE(a_->ExportMoved(id_, export_id + 1, nullptr));
}

TEST_F(MoveFixture, AReleaseDuringTheMoveEndsIt) {
  absl::StatusOr<Exported> exported = Export(*a_, id_);
  ASSERT_TRUE(exported.ok());
  ASSERT_TRUE(a_->Release(id_).ok());
  EXPECT_EQ(a_->FinishExport(id_, exported->header.export_id, true).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(a_->Stats(false).pool.blocks_used, 0u);
}

TEST_F(MoveFixture, AReleaseGivesBackTheBlocksAnExportByOffsetsHeldOnceItsHoldLapses) {
  std::vector<std::vector<float>> scores;
  absl::StatusOr<MovedHeader> h = a_->BeginExport(id_, absl::Seconds(30), &scores);
  ASSERT_TRUE(h.ok());
  ExportCursor cursor;
  MovedPiece piece;
  while (*a_->ExportPiece(id_, h->export_id, scores, true, &cursor, &piece)) {
  }
  // Released, its blocks stay out of circulation while a receiver may still get them: until
  // the export's hold lapses.
  ASSERT_TRUE(a_->Release(id_).ok());
  EXPECT_GT(a_->Stats(false).pool.blocks_used, 0u);
  clock_.Advance(absl::Seconds(29));
  a_->ExpireLeases();
  EXPECT_GT(a_->Stats(false).pool.blocks_used, 0u);
  clock_.Advance(absl::Seconds(2));
  a_->ExpireLeases();
  EXPECT_EQ(a_->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(a_->Stats(false).pool.bad_unrefs, 0u);
}

// Blocks kept for a released sequence's export count as its tenant's sequence until they
// go: an owner cannot pin more than --tenant-max-sequences exports' blocks by exporting and
// releasing.
TEST_F(MoveFixture, AReleasedSequencesExportCountsAgainstItsTenantUntilItsHoldLapses) {
  EngineConfig config;
  config.pool_bytes = 8 << 20;
  config.page_bytes = 4096;
  config.reclaim_reserve_pages = 0;
  config.tenant_max_sequences = 1;
  std::unique_ptr<Engine> e =
      *Engine::Create(config, *store::CpuBackend::Create(config.pool_bytes), &clock_);
  PromptPrefix alice;
  alice.owner = "alice";
  const uint64_t id = e->CreateSequence(MoveLayout(), "full", {}, {}, {}, alice)->sequence_id;
  ASSERT_TRUE(twins::Append(*e, id, 0, 40).ok());
  std::vector<std::vector<float>> scores;
  absl::StatusOr<MovedHeader> h = e->BeginExport(id, absl::Seconds(30), &scores);
  ASSERT_TRUE(h.ok()) << h.status();
  ExportCursor cursor;
  MovedPiece piece;
  while (*e->ExportPiece(id, h->export_id, scores, true, &cursor, &piece)) {
  }
  ASSERT_TRUE(e->Release(id).ok());
  EXPECT_EQ(e->CreateSequence(MoveLayout(), "full", {}, {}, {}, alice).status().code(),
            absl::StatusCode::kResourceExhausted);
  clock_.Advance(absl::Seconds(31));
  e->ExpireLeases();
  EXPECT_TRUE(e->CreateSequence(MoveLayout(), "full", {}, {}, {}, alice).ok());
  EXPECT_EQ(e->Stats(false).pool.bad_unrefs, 0u);
}

// Every way an export can lie: refused at the header, at a piece or at the commit, and the
// receiver keeps nothing (pool, host memory, tenants).
TEST_F(MoveFixture, AMalformedExportIsRefusedAndLeavesNothing) {
  absl::StatusOr<Exported> good = Export(*a_, id_);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_GE(good->pieces.size(), 8u);
  using Mutation = std::function<void(Exported&)>;
  const std::vector<std::pair<const char*, Mutation>> lies = {
      {"streams", [](Exported& e) { e.header.stream_slots.pop_back(); }},
      {"history rows", [](Exported& e) { e.header.history_rows += 1; }},
      {"scores", [](Exported& e) { e.header.scores = false; }},
      {"policy", [](Exported& e) { e.header.policy = "nonesuch"; }},
      {"token id", [](Exported& e) { e.header.token_ids[3] = twins::kVocab; }},
      {"appended", [](Exported& e) { e.header.appended += 1; }},
      {"too many slots", [](Exported& e) { e.header.stream_slots[0] = 1u << 30; }},
      {"stream order", [](Exported& e) { std::swap(e.pieces[0], e.pieces[1]); }},
      {"run past the block", [](Exported& e) { e.pieces[2].blocks[0].start = twins::kB - 1; }},
      {"empty run", [](Exported& e) { e.pieces[2].blocks[0].count = 0; }},
      {"precision", [](Exported& e) { e.pieces[2].blocks[0].precision = Precision::kNF4; }},
      {"positions",
       [](Exported& e) { std::swap(e.pieces[3].positions[0], e.pieces[3].positions[1]); }},
      {"position past the last",
       [](Exported& e) { e.pieces[3].positions.back() = e.header.last_position + 1; }},
      {"short data", [](Exported& e) { e.pieces[4].data.pop_back(); }},
      {"no scores", [](Exported& e) { e.pieces[4].scores.clear(); }},
      {"history", [](Exported& e) { e.pieces[4].history.push_back(0); }},
      {"a piece missing", [](Exported& e) { e.pieces.pop_back(); }},
      {"a piece twice", [](Exported& e) { e.pieces.push_back(e.pieces.back()); }},
      {"block bytes", [](Exported& e) { e.header.block_bytes += 1; }},
      {"fewer block bytes", [](Exported& e) { e.header.block_bytes -= 1; }},
      {"an infinite score",
       [](Exported& e) { e.pieces[5].scores[0] = std::numeric_limits<float>::infinity(); }},
      {"a long salt", [](Exported& e) { e.header.salt.assign(kMaxSaltBytes + 1, 's'); }},
  };
  for (const bool landing : {false, true}) {
    for (const auto& [name, lie] : lies) {
      // Landed in place, a piece's bytes are the gets' (the offsets are the mover's to check).
      if (landing && absl::string_view(name) == "short data") continue;
      const std::string what = absl::StrCat(name, landing ? " (landed)" : "");
      Exported bad = *good;
      lie(bad);
      absl::StatusOr<CreateResult> r = Import(*b_, bad, "", landing);
      EXPECT_FALSE(r.ok()) << what;
      EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u) << what;
      EXPECT_EQ(b_->Stats(false).host_metadata_bytes, 0u) << what;
      EXPECT_EQ(b_->tenants_registered(), 0u) << what;
      EXPECT_EQ(b_->Stats(true).sequences.size(), 0u) << what;
    }
  }
  // An import dropped before its commit keeps nothing either; the good one imports.
  {
    absl::StatusOr<std::unique_ptr<SequenceImport>> import = b_->BeginImport(good->header, "");
    ASSERT_TRUE(import.ok());
    for (size_t i = 0; i + 1 < good->pieces.size(); ++i)
      ASSERT_TRUE((*import)->Add(good->pieces[i]).ok());
    EXPECT_GT(b_->Stats(false).pool.blocks_used, 0u);
  }
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u);
  absl::StatusOr<CreateResult> r = Import(*b_, *good);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Content(*b_, r->sequence_id), Content(*a_, id_));
}

// Pieces landed in place where every block is at the layout's precision: the first piece's
// Reserve allocates every block of the sequence, an import dropped part way gives every one
// back, a commit before the last piece landed is refused, and a piece's bytes after pieces
// by offsets are refused.
TEST_F(MoveFixture, PiecesLandedInPlaceCommitOnlyOnceEveryPieceLanded) {
  const uint64_t id = a_->CreateSequence(MoveLayout(), "full", {}, {}, {})->sequence_id;
  ASSERT_TRUE(twins::Append(*a_, id, 0, 100).ok());
  absl::StatusOr<Exported> good = Export(*a_, id);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_GE(good->pieces.size(), 4u);
  uint64_t blocks = 0;
  for (uint32_t n : good->header.stream_blocks) blocks += n;
  {
    absl::StatusOr<std::unique_ptr<SequenceImport>> import = b_->BeginImport(good->header, "");
    ASSERT_TRUE(import.ok());
    ASSERT_TRUE((*import)->lands_in_place());
    ASSERT_TRUE(LandInPlace(**import, good->pieces[0]).ok());
    EXPECT_EQ(b_->Stats(false).pool.blocks_used, blocks);  // every block, at once
    EXPECT_EQ((*import)->Add(good->pieces[1]).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u);
  absl::StatusOr<std::unique_ptr<SequenceImport>> import = b_->BeginImport(good->header, "");
  ASSERT_TRUE(import.ok());
  for (const MovedPiece& piece : good->pieces) ASSERT_TRUE(LandInPlace(**import, piece).ok());
  MovedPiece none;  // a Reserve refused changes nothing: the import still commits
  EXPECT_FALSE((*import)->Reserve(none).ok());
  {  // one piece reserved and not landed: refused
    absl::StatusOr<std::unique_ptr<SequenceImport>> partial = b_->BeginImport(good->header, "");
    ASSERT_TRUE(partial.ok());
    for (const MovedPiece& piece : good->pieces) {
      MovedPiece by_offsets = piece;
      by_offsets.data.clear();
      ASSERT_TRUE((*partial)->Reserve(by_offsets).ok());
    }
    (*partial)->Landed(good->pieces.size() - 1);
    EXPECT_EQ(b_->CommitImport(**partial, absl::ZeroDuration()).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  absl::StatusOr<CreateResult> r = b_->CommitImport(**import, absl::ZeroDuration());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Content(*b_, r->sequence_id), Content(*a_, id));
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, blocks);
  ASSERT_TRUE(b_->Release(r->sequence_id).ok());
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u);
}

// A sequence that may quantize but holds every block at the layout's precision: its blocks
// are allocated at once for pieces landing in place, and a piece naming a quantized block
// (which the header's bytes leave no room for) is refused, nothing kept.
TEST_F(MoveFixture, AQuantizedBlockWhereTheHeaderSaysNoneIsRefused) {
  const uint64_t id =
      a_->CreateSequence(MoveLayout(), "full", {}, {kernels::QuantType::kInt8, 1000}, {})
          ->sequence_id;
  ASSERT_TRUE(twins::Append(*a_, id, 0, 100).ok());
  absl::StatusOr<Exported> good = Export(*a_, id);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_GE(good->pieces.size(), 2u);
  Exported bad = *good;
  bad.pieces[1].blocks[0].precision = Precision::kInt8;
  absl::StatusOr<CreateResult> r = Import(*b_, bad, "", /*landing=*/true);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("precision"));
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(b_->Stats(false).host_metadata_bytes, 0u);
  r = Import(*b_, *good, "", /*landing=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Content(*b_, r->sequence_id), Content(*a_, id));
}

// A reader that may still write into an import's blocks (a get abandoned in flight): they
// stay allocated for good, counted, and the import cannot commit.
TEST_F(MoveFixture, AForsakenImportKeepsItsBlocksOutOfCirculation) {
  const uint64_t id = a_->CreateSequence(MoveLayout(), "full", {}, {}, {})->sequence_id;
  ASSERT_TRUE(twins::Append(*a_, id, 0, 100).ok());
  absl::StatusOr<Exported> good = Export(*a_, id);
  ASSERT_TRUE(good.ok()) << good.status();
  uint64_t blocks = 0;
  for (uint32_t n : good->header.stream_blocks) blocks += n;
  {
    absl::StatusOr<std::unique_ptr<SequenceImport>> import = b_->BeginImport(good->header, "");
    ASSERT_TRUE(import.ok());
    for (const MovedPiece& piece : good->pieces) ASSERT_TRUE(LandInPlace(**import, piece).ok());
    (*import)->Forsake();
    EXPECT_EQ(b_->CommitImport(**import, absl::ZeroDuration()).status().code(),
              absl::StatusCode::kAborted);
  }
  EXPECT_EQ(b_->Stats(false).pool.blocks_used, blocks);
  EXPECT_EQ(b_->Stats(false).host_metadata_bytes, 0u);
  EXPECT_EQ(b_->Stats(true).sequences.size(), 0u);
  // Counted (Stats, /metrics), as the pool counts them.
  EXPECT_EQ(b_->Stats(false).blocks_forsaken, blocks);
  EXPECT_EQ(b_->Stats(false).bytes_forsaken, b_->Stats(false).pool.block_bytes_used);
}

// Attention history out of range (a policy that keeps it: infokv).
TEST_F(MoveFixture, AttentionHistoryOutOfRangeIsRefused) {
  const uint64_t id =
      a_->CreateSequence(MoveLayout(), "infokv", {{"history", 4}}, {}, {})->sequence_id;
  auto infokv = *policy::CreatePolicy("infokv", {{"history", 4}});
  Workload work(infokv->descriptor(), 9);
  ASSERT_TRUE(work.Append(*a_, id, 0, 40).ok());
  for (int64_t t = 40; t < 44; ++t) {
    ASSERT_TRUE(work.Append(*a_, id, t, 1).ok());
    const BlockTable table = *a_->GetBlockTable(id);
    StepInput in = work.Next(table);
    in.epoch = table.epoch;
    ASSERT_TRUE(a_->Step(id, in).ok());
  }
  absl::StatusOr<Exported> good = Export(*a_, id);
  ASSERT_TRUE(good.ok());
  ASSERT_FALSE(good->pieces[0].history.empty());
  for (const float bad : {2.0f, -0.5f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    Exported e = *good;
    e.pieces[0].history[0] = bad;
    EXPECT_FALSE(Import(*b_, e).ok()) << bad;
    EXPECT_EQ(b_->Stats(false).pool.blocks_used, 0u) << bad;
  }
  EXPECT_TRUE(Import(*b_, *good).ok());
}

TEST_F(MoveFixture, AReceiverWithoutRoomRefusesTheMoveAndTheHolderKeepsIt) {
  FakeClock clock;
  std::unique_ptr<Engine> small = MakeEngine(&clock, false, 8 << 10);
  absl::StatusOr<CreateResult> r = Move(*a_, id_, *small);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(small->Stats(false).pool.blocks_used, 0u);
  EXPECT_TRUE(AppendOne(150).ok());  // unfrozen, whole
  twins::ExpectContent(*a_, id_, kernels::QuantType::kInt8);
}

}  // namespace
}  // namespace kvmem::engine
