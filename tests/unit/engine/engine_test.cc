#include "gmock/gmock.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

// A restarted daemon gives no id its clients held to another sequence: each engine's ids
// start at a random place, so an old id is NOT_FOUND in the new one (before, both began
// at 1, and a client's next call after a restart reached another request's sequence).
TEST_F(EngineTest, IdsOfARestartedDaemonAreNewOnes) {
  const uint64_t before = Create();
  MakeEngine(64 * 4096);  // the daemon again, fresh
  const uint64_t after = Create();
  EXPECT_NE(after, before);
  EXPECT_TRUE(absl::IsNotFound(engine_->GetBlockTable(before).status()));
  EXPECT_EQ(Create(), after + 1);  // within one daemon, in order
}

TEST_F(EngineTest, AppendThenReadIsBitExact) {
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 37).ok());
  ASSERT_TRUE(AppendRange(id, 37, 1).ok());
  auto r = AppendRange(id, 38, 100);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->appended_tokens, 138u);
  EXPECT_EQ(r->kv_bytes, 138u * kL * kH * 2 * kD * 2);
  ExpectContentMatchesPositions(id);
  auto table = *engine_->GetBlockTable(id);
  ASSERT_EQ(table.streams.size(), kL * kH);
  ASSERT_EQ(table.streams[0].blocks.size(), 9u);  // ceil(138 / 16)
  EXPECT_EQ(table.streams[0].blocks.back().count, 138u - 8 * 16);
}

TEST_F(EngineTest, ChunksThatFillTheLastBlocksThenSpillEqualPlainAppends) {
  // A session's first chunks go into the free tails of the streams' last blocks (no plan);
  // a chunk that does not fit starts the plans from the lists with those slots in them.
  const uint64_t a = Create(), b = Create();
  ASSERT_TRUE(AppendRange(a, 0, 5).ok());
  ASSERT_TRUE(AppendRange(b, 0, 5).ok());
  auto session = engine_->BeginAppend(a);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(AddRange(**session, 5, 3).ok());    // slots 5-7: the tail
  ASSERT_TRUE(AddRange(**session, 8, 7).ok());    // 8-14: the tail still
  ASSERT_TRUE(AddRange(**session, 15, 20).ok());  // 15-34: plans
  absl::StatusOr<AppendResult> committed = (*session)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->appended_tokens, 35u);
  ASSERT_TRUE(AppendRange(b, 5, 30).ok());
  ExpectContentMatchesPositions(a);
  EXPECT_EQ(Content(a), Content(b));
  const BlockTable table = *engine_->GetBlockTable(a);
  ASSERT_EQ(table.streams[0].blocks.size(), 3u);  // 16 + 16 + 3
  EXPECT_EQ(table.streams[0].blocks[0].count, 16u);
  EXPECT_EQ(table.streams[0].blocks[2].count, 3u);
}

TEST_F(EngineTest, AChunkThatFitsOnlyWithoutTheSessionsEarlierTailSlotsStartsThePlans) {
  // 5 tokens held, 11 free slots per last block: 8 go into the tails; the next 8 would fit
  // the block as the table has it (5 + 8) but not after the session's own 8.
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 5).ok());
  auto session = engine_->BeginAppend(id);
  ASSERT_TRUE(session.ok());
  for (int64_t first : {5, 13}) ASSERT_TRUE(AddRange(**session, first, 8).ok());
  ASSERT_TRUE((*session)->Commit().ok());
  ExpectContentMatchesPositions(id);
  const BlockTable table = *engine_->GetBlockTable(id);
  ASSERT_EQ(table.streams[0].blocks.size(), 2u);  // 16 + 5
  EXPECT_EQ(table.streams[0].blocks[0].count, 16u);
  EXPECT_EQ(table.streams[0].blocks[1].count, 5u);
}

TEST_F(EngineTest, ASessionThatWroteIntoTheTailsAndEndsUncommittedChangesNothing) {
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 5).ok());
  const std::string before = Content(id);
  const uint64_t version = *engine_->TableVersion(id);
  {
    const std::vector<int64_t> positions = testing::Range(5, 2);
    const std::string junk(kL * kH * 2 * kD * 2, '\x11');  // finite f16s
    const AppendChunk chunk{positions, {}, junk, junk, {}, {}};
    auto session = engine_->BeginAppend(id);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->Add(chunk).ok());
  }  // ends without Commit
  EXPECT_EQ(Content(id), before);
  EXPECT_EQ(*engine_->TableVersion(id), version);
  // The next append writes the same slots: what the sequence holds is the new tokens'.
  ASSERT_TRUE(AppendRange(id, 5, 2).ok());
  ExpectContentMatchesPositions(id);
}

TEST_F(EngineTest, WindowKeepsExactlyTheLastWAndEpochChangesOnEveryEviction) {
  const uint64_t id = Create("window", {{"window", 20}});
  ASSERT_TRUE(AppendRange(id, 0, 50).ok());
  uint64_t epoch = engine_->GetBlockTable(id)->epoch;
  auto step = engine_->Step(id, {});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->evicted_tokens, 30u * kL * kH);
  EXPECT_NE(step->epoch, epoch);
  epoch = step->epoch;
  for (int t = 50; t < 90; ++t) {
    ASSERT_TRUE(AppendRange(id, t, 1).ok());
    auto s = engine_->Step(id, {});
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->evicted_tokens, kL * kH);
    EXPECT_NE(s->epoch, epoch) << "step " << t;
    epoch = s->epoch;
  }
  auto table = *engine_->GetBlockTable(id);
  for (const StreamTable& st : table.streams) {
    EXPECT_EQ(st.positions, testing::Range(70, 20));
    EXPECT_LE(st.blocks.size(), 3u);  // emptied blocks went back
  }
  ExpectContentMatchesPositions(id);
  // A step that evicts nothing leaves the epoch alone.
  auto idle = engine_->Step(id, {});
  EXPECT_EQ(idle->evicted_tokens, 0u);
  EXPECT_EQ(idle->epoch, epoch);
  EXPECT_LE(engine_->Stats(false).pool.blocks_used, 3u * kL * kH);
}

TEST_F(EngineTest, StaleEpochIsFailedPreconditionAndChangesNothing) {
  const uint64_t id = Create("window", {{"window", 4}});
  ASSERT_TRUE(AppendRange(id, 0, 8).ok());
  const uint64_t epoch = engine_->GetBlockTable(id)->epoch;
  std::vector<float> row(8, 1.0f / 8);
  StepInput input;
  input.epoch = epoch + 1000;
  for (uint32_t s = 0; s < kL * kH; ++s) input.attention.push_back({s / kH, s % kH, row});
  auto s = engine_->Step(id, input);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("epoch"));
  EXPECT_EQ(engine_->GetBlockTable(id)->streams[0].positions.size(), 8u);
  input.epoch = epoch;
  EXPECT_TRUE(engine_->Step(id, input).ok());
}

TEST_F(EngineTest, FullPoolIsResourceExhaustedAndChangesNothing) {
  MakeEngine(16 * 4096);  // 16 pages of 4 KiB; one block = 16*8*2*2 = 512 bytes
  const uint64_t a = Create();
  ASSERT_TRUE(AppendRange(a, 0, 16 * 15).ok());  // 15 blocks x 8 streams = 120 of 128 slots
  const EngineStats before = engine_->Stats(true);
  auto r = AppendRange(a, 240, 32);  // needs 16 more blocks
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("pool"));
  const EngineStats after = engine_->Stats(true);
  EXPECT_EQ(after.pool.blocks_used, before.pool.blocks_used);
  EXPECT_EQ(after.sequences[0].appended_tokens, before.sequences[0].appended_tokens);
  EXPECT_EQ(after.tokens_appended, before.tokens_appended);
  ExpectContentMatchesPositions(a);
  // What fits still fits.
  EXPECT_TRUE(AppendRange(a, 240, 16).ok());
}

TEST_F(EngineTest, LapsedLeaseFreesEveryBlock) {
  const uint64_t a = Create("full", {}, absl::Seconds(5));
  const uint64_t b = Create("full", {}, absl::Seconds(30));
  ASSERT_TRUE(AppendRange(a, 0, 100).ok());
  ASSERT_TRUE(AppendRange(b, 0, 10).ok());
  const uint64_t b_blocks = engine_->Stats(false).pool.blocks_used - 7 * kL * kH;
  clock_.Advance(absl::Seconds(4));
  EXPECT_EQ(engine_->ExpireLeases(), 0u);
  ASSERT_TRUE(engine_->KeepAlive({a})[0].ok());  // renews a for another 5 s
  clock_.Advance(absl::Seconds(4));
  EXPECT_EQ(engine_->ExpireLeases(), 0u);
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(engine_->ExpireLeases(), 1u);
  EXPECT_EQ(engine_->GetBlockTable(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, b_blocks);
  EXPECT_EQ(engine_->Stats(false).leases_expired, 1u);
  clock_.Advance(absl::Seconds(30));
  EXPECT_EQ(engine_->ExpireLeases(), 1u);
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(engine_->Stats(false).pool.pages_used, 0u);
}

TEST_F(EngineTest, MaxSequencesIsResourceExhaustedAndSlotsReturn) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(Create());
  auto r = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("max-sequences"));
  ASSERT_TRUE(engine_->Release(ids[3]).ok());
  EXPECT_TRUE(engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration()).ok());
}

TEST_F(EngineTest, CompressReportsPerLayerKeptTokens) {
  const uint64_t id = Create("window", {{"window", 40}});
  ASSERT_TRUE(AppendRange(id, 0, 50).ok());
  CompressInput input;
  input.target_tokens = 10;
  auto r = engine_->Compress(id, input);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->layers.size(), kL);
  for (const LayerKept& l : r->layers) {
    EXPECT_EQ(l.before_tokens, 50u * kH);
    EXPECT_EQ(l.kept_tokens, 10u * kH);
  }
  EXPECT_EQ(r->evicted_tokens, 40u * kL * kH);
  EXPECT_EQ(r->kv_bytes_after, 10u * kL * kH * 2 * kD * 2);
  ExpectContentMatchesPositions(id);
}

}  // namespace
}  // namespace kvmem::engine
