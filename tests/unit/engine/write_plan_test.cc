// In-place writes (WritePlans): a client writes K/V where a plan says and commits it by
// plan id; what it commits reads back exactly as the same tokens sent as bytes, and a stale,
// foreign or oversized commit changes nothing.
#include <random>

#include "gmock/gmock.h"
#include "kernels/block_layout.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

class WritePlanTest : public EngineTest {
 protected:
  void SetUp() override { MakePlanEngine(1 << 20); }

  void MakePlanEngine(uint64_t pool_bytes, bool in_place = true) {
    MakeEngine(
        pool_bytes, [in_place](EngineConfig& c) { c.in_place_writes = in_place; },
        [this](std::unique_ptr<store::Backend> b) {
          backend_ = b.get();
          return b;
        });
  }

  StepOutcome Run(StepCall call) {
    absl::StatusOr<std::vector<StepOutcome>> out =
        engine_->StepBatch(absl::MakeConstSpan(&call, 1));
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? std::move((*out)[0]) : StepOutcome{out.status()};
  }

  absl::StatusOr<PlanView> Plan(uint64_t id, uint32_t tokens) {
    StepCall call;
    call.sequence_id = id;
    call.plan_tokens = tokens;
    StepOutcome out = Run(call);
    if (!out.status.ok()) return out.status;
    if (!out.plan) return absl::InternalError("no plan in the outcome");
    return *out.plan;
  }

  // What a same-host client does: tokens first..first+n-1 (K salt 0, V salt 1) written
  // straight into the pool where the plan says.
  void WriteAt(const PlanView& plan, int64_t first, uint32_t n) {
    const std::string k = testing::Payload16(kL * kH, first, n, kD, 0);
    const std::string v = testing::Payload16(kL * kH, first, n, kD, 1);
    const uint64_t row = kD * 2;
    const kernels::LayoutBlock block{kB, row};
    std::vector<store::WriteOp> ops;
    for (uint32_t s = 0; s < kL * kH; ++s) {
      for (uint32_t i = 0; i < n; ++i) {
        const uint64_t src = (uint64_t{s} * n + i) * row;
        const uint64_t slot = plan.first_slots[s] + i;
        ops.push_back({k.data() + src, plan.block_offsets[s] + block.k_offset(slot), row});
        ops.push_back({v.data() + src, plan.block_offsets[s] + block.v_offset(slot), row});
      }
    }
    ASSERT_TRUE(backend_->Write(ops).ok());
  }

  // The entry that commits n tokens from `first` written at `plan`; a step when `step`;
  // a new plan for `next_tokens` when set.
  StepOutcome Commit(uint64_t id, uint64_t plan, int64_t first, uint32_t n, bool step,
                     uint32_t next_tokens) {
    positions_ = testing::Range(first, n);
    StepCall call;
    call.sequence_id = id;
    call.append = AppendChunk{positions_, {}, {}, {}, {}, {}};
    call.plan_id = plan;
    if (step) call.step = StepInput{};
    call.plan_tokens = next_tokens;
    return Run(call);
  }

  StepOutcome AppendAndStep(uint64_t id, int64_t first, uint32_t n) {
    const RangeChunk range(first, n);
    StepCall call;
    call.sequence_id = id;
    call.append = range.chunk();
    call.step = StepInput{};
    return Run(call);
  }

  uint64_t BlocksUsed() { return engine_->Stats(false).pool.blocks_used; }

  store::Backend* backend_ = nullptr;
};

TEST_F(WritePlanTest, AnInPlaceDecodeReadsExactlyAsTheSameTokensSentAsBytes) {
  const policy::ParamOverrides params = {{"window", 40}};
  const uint64_t bytes = Create("window", params);
  const uint64_t placed = Create("window", params);
  for (uint64_t id : {bytes, placed}) ASSERT_TRUE(AppendRange(id, 0, 21).ok());
  absl::StatusOr<PlanView> plan = Plan(placed, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int64_t next = 21;
  int fresh_blocks = 0;
  for (int t = 0; t < 150; ++t) {
    // Mostly one token; now and then a few, committed in part (room for 3, 2 written).
    const uint32_t n = t % 11 == 5 ? 2 : 1;
    const uint32_t planned = plan->tokens;
    ASSERT_GE(planned, n);
    ASSERT_TRUE(AppendAndStep(bytes, next, n).status.ok());
    for (uint32_t s = 0; s < kL * kH; ++s) fresh_blocks += plan->first_slots[s] == 0;
    WriteAt(*plan, next, n);
    const uint32_t next_n = (t + 1) % 11 == 5 ? 3 : 1;
    StepOutcome out = Commit(placed, plan->id, next, n, /*step=*/true, next_n);
    ASSERT_TRUE(out.status.ok()) << "step " << t << ": " << out.status;
    ASSERT_TRUE(out.appended && out.step);
    ASSERT_TRUE(out.plan.has_value() && out.plan->ok()) << "step " << t;
    plan = *out.plan;
    next += n;
    ASSERT_EQ(Content(bytes), Content(placed)) << "step " << t;
    ExpectContentMatchesPositions(placed);
    if (HasFailure()) return;
  }
  EXPECT_GT(fresh_blocks, 40) << "the plans took fresh blocks when the tails were full";
  const uint64_t with_plan = BlocksUsed();
  ASSERT_TRUE(engine_->Release(placed).ok());
  ASSERT_TRUE(engine_->Release(bytes).ok());
  EXPECT_GT(with_plan, 0u);
  EXPECT_EQ(BlocksUsed(), 0u) << "the plan's blocks went back with the sequence";
  EXPECT_EQ(engine_->Stats(false).pool.bad_unrefs, 0u);
}

TEST_F(WritePlanTest, StaleForeignAndOversizedCommitsAreRefusedAndChangeNothing) {
  const uint64_t a = Create("full");
  const uint64_t b = Create("full");
  for (uint64_t id : {a, b}) ASSERT_TRUE(AppendRange(id, 0, 5).ok());
  absl::StatusOr<PlanView> pa = Plan(a, 2);
  absl::StatusOr<PlanView> pb = Plan(b, 2);
  ASSERT_TRUE(pa.ok() && pb.ok());
  WriteAt(*pa, 5, 2);
  const std::string before = *engine_->Fingerprint(a);

  StepOutcome foreign = Commit(a, pb->id, 5, 1, false, 0);
  EXPECT_EQ(foreign.status.code(), absl::StatusCode::kFailedPrecondition) << foreign.status;
  EXPECT_THAT(std::string(foreign.status.message()), ::testing::HasSubstr("append.plan_id"));
  StepOutcome oversized = Commit(a, pa->id, 5, 3, false, 0);
  EXPECT_EQ(oversized.status.code(), absl::StatusCode::kInvalidArgument) << oversized.status;
  positions_ = testing::Range(5, 1);
  StepCall with_bytes;
  with_bytes.sequence_id = a;
  const RangeChunk range(5, 1);
  with_bytes.append = range.chunk();
  with_bytes.plan_id = pa->id;
  EXPECT_EQ(Run(with_bytes).status.code(), absl::StatusCode::kInvalidArgument);
  StepCall plan_only;
  plan_only.sequence_id = a;
  plan_only.plan_id = pa->id;
  EXPECT_EQ(Run(plan_only).status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*engine_->Fingerprint(a), before);

  // The plan is still current: its commit goes through once.
  StepOutcome ok = Commit(a, pa->id, 5, 2, false, 0);
  ASSERT_TRUE(ok.status.ok()) << ok.status;
  ExpectContentMatchesPositions(a);
  StepOutcome again = Commit(a, pa->id, 7, 1, false, 0);
  EXPECT_EQ(again.status.code(), absl::StatusCode::kFailedPrecondition) << "a plan commits once";

  // A plan made stale by an append of bytes: refused, nothing changes.
  absl::StatusOr<PlanView> stale = Plan(a, 1);
  ASSERT_TRUE(stale.ok());
  ASSERT_TRUE(AppendRange(a, 7, 1).ok());
  WriteAt(*stale, 99, 1);  // lands where no table looks
  const std::string appended = *engine_->Fingerprint(a);
  StepOutcome late = Commit(a, stale->id, 8, 1, false, 0);
  EXPECT_EQ(late.status.code(), absl::StatusCode::kFailedPrecondition) << late.status;
  EXPECT_THAT(std::string(late.status.message()), ::testing::HasSubstr("stale"));
  EXPECT_EQ(*engine_->Fingerprint(a), appended);
  ExpectContentMatchesPositions(a);

  // A fork shares the tail the plan writes into: the parent's commit is refused.
  absl::StatusOr<PlanView> forked = Plan(a, 1);
  ASSERT_TRUE(forked.ok());
  absl::StatusOr<CreateResult> child = engine_->Fork(a, absl::ZeroDuration());
  ASSERT_TRUE(child.ok());
  WriteAt(*forked, 8, 1);
  EXPECT_EQ(Commit(a, forked->id, 8, 1, false, 0).status.code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectContentMatchesPositions(a);
  ExpectContentMatchesPositions(child->sequence_id);

  for (uint64_t id : {a, b, child->sequence_id}) ASSERT_TRUE(engine_->Release(id).ok());
  EXPECT_EQ(BlocksUsed(), 0u);
  EXPECT_EQ(engine_->Stats(false).pool.bad_unrefs, 0u);
}

TEST_F(WritePlanTest, PlansNeedTheFlagAndAValidTokenCount) {
  MakePlanEngine(1 << 20, /*in_place=*/false);
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 3).ok());
  absl::StatusOr<PlanView> off = Plan(id, 1);
  EXPECT_EQ(off.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(off.status().message()), ::testing::HasSubstr("--in_place_writes"));
  EXPECT_EQ(Commit(id, 1, 3, 1, false, 0).status.code(), absl::StatusCode::kFailedPrecondition);

  MakePlanEngine(1 << 20);
  const uint64_t on = Create("full");
  for (uint32_t bad : {0u, kB + 1}) {
    StepCall call;
    call.sequence_id = on;
    call.plan_tokens = bad;
    call.step = StepInput{};
    StepOutcome out = Run(call);
    if (bad == 0) continue;  // no plan asked for
    ASSERT_TRUE(out.plan.has_value());
    EXPECT_EQ(out.plan->status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.plan->status().message()), ::testing::HasSubstr("plan_tokens"));
  }
}

TEST_F(WritePlanTest, APlanThePoolCannotServeLeavesNoPlanAndNoBlocks) {
  MakePlanEngine(64 << 10);  // 16 pages of 4 KiB
  const uint64_t id = Create("full");
  // Fill the pool with whole blocks, then ask for a plan that needs fresh ones.
  absl::Status filled = absl::OkStatus();
  int64_t next = 0;
  while (filled.ok()) {
    filled = AppendRange(id, next, kB).status();
    if (filled.ok()) next += kB;
  }
  const uint64_t used = BlocksUsed();
  absl::StatusOr<PlanView> plan = Plan(id, 1);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << plan.status();
  EXPECT_EQ(BlocksUsed(), used);
  EXPECT_EQ(Commit(id, 1, next, 1, false, 0).status.code(), absl::StatusCode::kFailedPrecondition);
}

// Random interleavings of plans, writes, commits (current and stale), appends of bytes,
// evicting steps, forks and sequences dropped with a plan outstanding (a client that died
// between writing and committing): every read matches the positions the table names, and
// once every sequence is gone the pool holds nothing.
TEST_F(WritePlanTest, RandomInterleavingsKeepReadsExactAndThePoolAccounted) {
  MakePlanEngine(4 << 20);
  std::mt19937 rng(7);
  struct Live {
    uint64_t id;
    int64_t next;
    std::optional<PlanView> plan;
    bool written = false;
  };
  std::vector<Live> live;
  int commits = 0, refused = 0;
  for (int op = 0; op < 3000; ++op) {
    if (live.size() < 3) {
      const uint64_t id = Create("window", {{"window", 24}});
      ASSERT_TRUE(AppendRange(id, 0, 1 + rng() % 20).ok());
      live.push_back({id, static_cast<int64_t>(positions_.back() + 1), std::nullopt});
      continue;
    }
    Live& s = live[rng() % live.size()];
    switch (rng() % 8) {
      case 0:
      case 1: {
        absl::StatusOr<PlanView> plan = Plan(s.id, 1 + rng() % 4);
        ASSERT_TRUE(plan.ok()) << plan.status();
        s.plan = *plan;
        s.written = false;
        break;
      }
      case 2:
      case 3:
        if (s.plan) {
          WriteAt(*s.plan, s.next, s.plan->tokens);
          s.written = true;
        }
        break;
      case 4:
      case 5: {
        if (!s.plan || !s.written) break;  // a client commits only what it wrote
        const uint32_t n = 1 + rng() % s.plan->tokens;
        const std::string before = *engine_->Fingerprint(s.id);
        StepOutcome out = Commit(s.id, s.plan->id, s.next, n, rng() % 2 == 0, 0);
        if (out.status.ok() || out.appended) {
          s.next += n;
          ++commits;
          s.plan.reset();
        } else {
          ASSERT_EQ(out.status.code(), absl::StatusCode::kFailedPrecondition) << out.status;
          ASSERT_EQ(*engine_->Fingerprint(s.id), before) << "op " << op;
          ++refused;
        }
        break;
      }
      case 6:
        ASSERT_TRUE(AppendAndStep(s.id, s.next, 1).status.ok());
        ++s.next;  // a plan made before is stale now
        break;
      case 7:
        if (rng() % 3 == 0) {  // the client dies: the sequence goes with its plan
          ASSERT_TRUE(engine_->Release(s.id).ok());
          s = live.back();
          live.pop_back();
        } else {
          absl::StatusOr<CreateResult> child = engine_->Fork(s.id, absl::ZeroDuration());
          ASSERT_TRUE(child.ok());
          ExpectContentMatchesPositions(child->sequence_id);
          ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
        }
        break;
    }
    for (const Live& l : live) ExpectContentMatchesPositions(l.id);
    if (HasFailure()) return;
  }
  EXPECT_GT(commits, 60);
  EXPECT_GT(refused, 40);
  for (const Live& l : live) ASSERT_TRUE(engine_->Release(l.id).ok());
  EXPECT_EQ(BlocksUsed(), 0u);
  EXPECT_EQ(engine_->Stats(false).pool.bad_unrefs, 0u);
}

}  // namespace
}  // namespace kvmem::engine
