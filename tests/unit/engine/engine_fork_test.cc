#include "gmock/gmock.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

TEST_F(EngineTest, ForkSharesBlocksUntilAChildWrites) {
  const uint64_t parent = Create("window", {{"window", 24}});
  ASSERT_TRUE(AppendRange(parent, 0, 20).ok());  // last block partly filled (20 = 16 + 4)
  const uint64_t blocks_before = engine_->Stats(false).pool.blocks_used;
  auto child = engine_->Fork(parent, absl::ZeroDuration());
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, blocks_before);  // shared, not copied

  // The child appends different data at positions 20..29: copy-on-write of the last block.
  positions_ = testing::Range(20, 10);
  k_ = testing::Payload16(kL * kH, 20, 10, kD, 5);
  v_ = testing::Payload16(kL * kH, 20, 10, kD, 6);
  AppendChunk chunk{positions_, {}, k_, v_, {}, {}};
  ASSERT_TRUE(engine_->Append(child->sequence_id, absl::MakeConstSpan(&chunk, 1)).ok());
  // The parent appends its own continuation and evicts (window 24).
  ASSERT_TRUE(AppendRange(parent, 20, 10).ok());
  ASSERT_TRUE(engine_->Step(parent, {}).ok());

  ExpectContentMatchesPositions(parent);
  // The child still holds positions 0..29, the first 20 from before the fork.
  absl::Status s = engine_->ReadKV(child->sequence_id, 0, 0, 0, [&](StreamKV&& kv) {
    const uint32_t stream = kv.layer * kH + kv.kv_head;
    EXPECT_EQ(kv.positions, testing::Range(0, 30));
    const size_t head = 20 * kD * 2;
    EXPECT_EQ(kv.k.substr(0, head), testing::Expected16(stream, testing::Range(0, 20), kD, 0));
    EXPECT_EQ(kv.k.substr(head), testing::Expected16(stream, testing::Range(20, 10), kD, 5));
    EXPECT_EQ(kv.v.substr(head), testing::Expected16(stream, testing::Range(20, 10), kD, 6));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;

  // Releasing the parent leaves the child whole; releasing the child empties the pool.
  ASSERT_TRUE(engine_->Release(parent).ok());
  EXPECT_EQ(engine_->GetBlockTable(child->sequence_id)->streams[0].positions.size(), 30u);
  ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, 0u);
}

TEST_F(EngineTest, EvictionInAChildNeverTouchesTheParent) {
  const uint64_t parent = Create("window", {{"window", 8}});
  ASSERT_TRUE(AppendRange(parent, 0, 40).ok());
  auto child = *engine_->Fork(parent, absl::ZeroDuration());
  auto step = engine_->Step(child.sequence_id, {});
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(step->evicted_tokens, 32u * kL * kH);
  EXPECT_EQ(engine_->GetBlockTable(parent)->streams[0].positions, testing::Range(0, 40));
  ExpectContentMatchesPositions(parent);
  ExpectContentMatchesPositions(child.sequence_id);
}

// ReadKV in pieces: the pieces of each stream, put end to end, are the whole stream's read
// (slots mid-block after evictions, quantized and layout blocks alike), each piece within
// its byte bound, and a stream without slots comes as one empty piece.
TEST_F(EngineTest, ReadInPiecesIsTheWholeReadCutAtSlots) {
  const uint64_t id = Create("window", {{"window", 45}}, absl::ZeroDuration(),
                             QuantConfig{kernels::QuantType::kInt8, 16});
  ASSERT_TRUE(AppendRange(id, 0, 70).ok());
  ASSERT_TRUE(engine_->Step(id, {}).ok());  // keeps 25..69: the first block starts mid-way
  const uint64_t empty = Create();
  std::vector<StreamKV> whole;
  ASSERT_TRUE(engine_
                  ->ReadKV(id, 0, 0, 0,
                           [&](StreamKV&& kv) {
                             whole.push_back(std::move(kv));
                             return absl::OkStatus();
                           })
                  .ok());
  ASSERT_EQ(whole.size(), kL * kH);
  const uint64_t slot_bytes = kD * 2 * 2 + 10;  // K and V rows and a position's most
  for (const uint64_t piece_slots : {1, 3, 16, 44, 45, 100}) {
    std::vector<StreamKV> joined;
    absl::Status s = engine_->ReadKV(
        id, 0, 0, 0,
        [&](StreamKV&& kv) {
          EXPECT_LE(kv.positions.size(), piece_slots);
          if (kv.first_slot == 0) {
            joined.push_back(std::move(kv));
          } else {
            EXPECT_EQ(kv.first_slot, joined.back().positions.size());
            joined.back().positions.insert(joined.back().positions.end(), kv.positions.begin(),
                                           kv.positions.end());
            joined.back().k += kv.k;
            joined.back().v += kv.v;
          }
          return absl::OkStatus();
        },
        piece_slots * slot_bytes);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(joined.size(), whole.size()) << piece_slots;
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_EQ(joined[i].positions, testing::Range(25, 45)) << piece_slots;
      EXPECT_EQ(joined[i].positions, whole[i].positions) << piece_slots;
      EXPECT_EQ(joined[i].k, whole[i].k) << piece_slots << " stream " << i;
      EXPECT_EQ(joined[i].v, whole[i].v) << piece_slots << " stream " << i;
    }
    // And against the bytes appended, for a sequence without quantized blocks.
    const uint64_t plain = Create("window", {{"window", 45}});
    ASSERT_TRUE(AppendRange(plain, 0, 70).ok());
    ASSERT_TRUE(engine_->Step(plain, {}).ok());
    std::vector<StreamKV> plain_pieces;
    ASSERT_TRUE(engine_
                    ->ReadKV(
                        plain, 0, 0, 0,
                        [&](StreamKV&& kv) {
                          plain_pieces.push_back(std::move(kv));
                          return absl::OkStatus();
                        },
                        piece_slots * slot_bytes)
                    .ok());
    for (const StreamKV& kv : plain_pieces) {
      const uint32_t stream = kv.layer * kH + kv.kv_head;
      EXPECT_EQ(kv.positions, testing::Range(25 + static_cast<int64_t>(kv.first_slot),
                                             static_cast<uint32_t>(kv.positions.size())));
      EXPECT_EQ(kv.k, testing::Expected16(stream, kv.positions, kD, 0)) << piece_slots;
      EXPECT_EQ(kv.v, testing::Expected16(stream, kv.positions, kD, 1)) << piece_slots;
    }
    ASSERT_TRUE(engine_->Release(plain).ok());
    size_t pieces = 0;
    ASSERT_TRUE(engine_
                    ->ReadKV(
                        empty, 0, 0, 0,
                        [&](StreamKV&& kv) {
                          ++pieces;
                          EXPECT_TRUE(kv.positions.empty());
                          return absl::OkStatus();
                        },
                        piece_slots * slot_bytes)
                    .ok());
    EXPECT_EQ(pieces, kL * kH);
  }
}

// A read is one state of the table: an append between its pieces (streams grow within an
// epoch) ends it with ABORTED instead of giving some streams the new tokens and not others.
TEST_F(EngineTest, AnAppendDuringAReadAbortsIt) {
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 20).ok());
  for (const uint64_t piece_bytes : {uint64_t{0}, uint64_t{7 * (kD * 2 * 2 + 10)}}) {
    const int64_t next =
        static_cast<int64_t>(engine_->GetBlockTable(id)->streams[0].positions.size());
    bool appended = false;
    std::vector<size_t> lengths;
    absl::Status s = engine_->ReadKV(
        id, 0, 0, 0,
        [&](StreamKV&& kv) {
          lengths.push_back(kv.positions.size());
          if (!appended) {
            appended = true;
            return AppendRange(id, next, 1).status();  // another client, between pieces
          }
          return absl::OkStatus();
        },
        piece_bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s << " after pieces of " << lengths.size();
    EXPECT_THAT(s.message(), ::testing::HasSubstr("changed from version"));
  }
}

// A reader that stops taking pieces (its client no longer reads) holds no call on the
// sequence between them: the lease lapses as it would without the read, and the read then
// ends with NOT_FOUND.
TEST_F(EngineTest, AStalledReadDoesNotKeepALapsedSequence) {
  const uint64_t id = Create("full", {}, absl::Seconds(10));
  ASSERT_TRUE(AppendRange(id, 0, 20).ok());
  uint32_t expired = 0;
  size_t pieces = 0;
  absl::Status s = engine_->ReadKV(
      id, 0, 0, 0,
      [&](StreamKV&&) {
        if (++pieces == 1) {
          clock_.Advance(absl::Seconds(11));  // the client sat on the first piece
          expired = engine_->ExpireLeases();
        }
        return absl::OkStatus();
      },
      7 * (kD * 2 * 2 + 10));
  EXPECT_EQ(expired, 1u);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(pieces, 1u);
}

}  // namespace
}  // namespace kvmem::engine
