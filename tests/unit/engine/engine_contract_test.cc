// The engine's contract (DESIGN.md): a reader never accepts K/V its table does not name,
// a mutation applies whole or changes nothing (scores included) or poisons its sequence,
// and the pool's accounting stays exact. Each test here failed before the fix it guards.
#include <atomic>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "tests/testing/faulty_backend.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

class ContractTest : public EngineTest {
 protected:
  void MakeFaultyEngine(uint64_t pool_bytes, bool device_step, int64_t reserve_pages = -1) {
    MakeEngine(
        pool_bytes,
        [&](EngineConfig& config) {
          config.device_step = device_step;
          config.failpoints = &failpoints_;
          config.reclaim_reserve_pages = reserve_pages;
        },
        testing::FaultyBackend::Wrapper(&backend_));
  }

  // A reader of the same-host protocol: would it accept `table` now?
  bool ReaderAccepts(const BlockTable& table) {
    return engine_->epoch_board().Load(table.epoch_slot) == 2 * table.epoch;
  }

  // Signals for one step of every stream: random attention rows over the current table.
  StepInput Signals(uint64_t id, uint32_t seed) {
    const BlockTable table = *engine_->GetBlockTable(id);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    rows_.assign(table.streams.size(), {});
    StepInput in;
    in.epoch = table.epoch;
    in.logits = RawLogitStats{1.0f + 0.5f * (seed % 3), 0.5f, 0.2f, {}};
    for (size_t s = 0; s < table.streams.size(); ++s) {
      for (size_t j = 0; j < table.streams[s].positions.size(); ++j) rows_[s].push_back(u(rng));
      in.attention.push_back({table.streams[s].layer, table.streams[s].kv_head, rows_[s]});
    }
    return in;
  }

  Failpoints failpoints_;
  testing::FaultyBackend* backend_ = nullptr;
  std::vector<std::vector<float>> rows_;
};

TEST_F(ContractTest, ForkChildrenNeverReuseAnEpoch) {
  // Beam search: fork, the child writes its own block, dies, its slot is reused by the next
  // fork of the same parent. A reader still holding the dead child's table must fail.
  const uint64_t parent = Create("full");
  ASSERT_TRUE(AppendRange(parent, 0, 20).ok());
  auto child = *engine_->Fork(parent, absl::ZeroDuration());
  ASSERT_TRUE(AppendRange(child.sequence_id, 20, 20).ok());  // private blocks
  const BlockTable dead = *engine_->GetBlockTable(child.sequence_id);
  ASSERT_TRUE(ReaderAccepts(dead));
  ASSERT_TRUE(engine_->Release(child.sequence_id).ok());
  const uint64_t other = Create("full");
  ASSERT_TRUE(AppendRange(other, 0, 40).ok());  // may take the freed blocks
  auto next = *engine_->Fork(parent, absl::ZeroDuration());
  const BlockTable table = *engine_->GetBlockTable(next.sequence_id);
  EXPECT_NE(table.epoch, dead.epoch);
  EXPECT_NE(table.epoch, engine_->GetBlockTable(parent)->epoch);
  EXPECT_FALSE(ReaderAccepts(dead)) << "a dead child's table validates again";
}

TEST_F(ContractTest, CopyOnWriteAppendInvalidatesTablesNamingTheSharedBlock) {
  const uint64_t parent = Create("full");
  ASSERT_TRUE(AppendRange(parent, 0, 20).ok());  // last block shared after the fork
  auto child = *engine_->Fork(parent, absl::ZeroDuration());
  const BlockTable before = *engine_->GetBlockTable(child.sequence_id);
  ASSERT_TRUE(AppendRange(child.sequence_id, 20, 1).ok());  // copies the shared last block
  const BlockTable after = *engine_->GetBlockTable(child.sequence_id);
  ASSERT_NE(after.streams[0].blocks.back().id, before.streams[0].blocks.back().id);
  EXPECT_FALSE(ReaderAccepts(before)) << "the old table names a block the child dropped";
  // The parent then frees that block; no table of the child may still name it.
  ASSERT_TRUE(engine_->Release(parent).ok());
  EXPECT_FALSE(ReaderAccepts(before));
  EXPECT_TRUE(ReaderAccepts(after));
}

// A Step that fails before its point of no return changes nothing, scores included, so a
// retry gives exactly what one clean step gives (before: the row was applied twice).
class StepRetryTest : public ContractTest, public ::testing::WithParamInterface<bool> {};

TEST_P(StepRetryTest, FailedStepThenRetryEqualsOneStep) {
  MakeFaultyEngine(1 << 20, /*device_step=*/GetParam());
  const policy::ParamOverrides params = {{"budget", 40}, {"recent", 8}};
  const uint64_t a = Create("h2o", params);
  const uint64_t b = Create("h2o", params);
  for (uint64_t id : {a, b}) ASSERT_TRUE(AppendRange(id, 0, 34).ok());
  int failed_steps = 0;
  for (int t = 0; t < 30; ++t) {
    // A fork shares every block, so an eviction must copy first: it needs allocations.
    std::vector<uint64_t> forks;
    for (uint64_t id : {a, b}) {
      ASSERT_TRUE(AppendRange(id, 34 + t, 1).ok());
      forks.push_back(engine_->Fork(id, absl::ZeroDuration())->sequence_id);
    }
    const std::string before = *engine_->Fingerprint(a);
    StepInput in = Signals(a, t);
    failpoints_.FailAt(Failpoints::kAllocate, 1);
    auto failed = engine_->Step(a, in);
    failpoints_.Disarm();
    if (!failed.ok()) {  // the step needed a block: it must have changed nothing
      ++failed_steps;
      ASSERT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
      ASSERT_EQ(*engine_->Fingerprint(a), before) << "step " << t;
      in.epoch = engine_->GetBlockTable(a)->epoch;
      ASSERT_TRUE(engine_->Step(a, in).ok());
    }
    ASSERT_TRUE(engine_->Step(b, Signals(b, t)).ok());
    ASSERT_EQ(Content(a), Content(b)) << "step " << t;
    for (uint64_t f : forks) ASSERT_TRUE(engine_->Release(f).ok());
  }
  EXPECT_GT(failed_steps, 10);
}

INSTANTIATE_TEST_SUITE_P(HostAndDeviceStep, StepRetryTest, ::testing::Bool());

TEST_F(ContractTest, BackendFailureMidStepPoisonsAndReleaseStillFrees) {
  MakeFaultyEngine(1 << 20, false);
  const uint64_t id = Create("window", {{"window", 8}});
  ASSERT_TRUE(AppendRange(id, 0, 40).ok());
  const BlockTable table = *engine_->GetBlockTable(id);
  backend_->FailAt(1);  // the batch's Move breaks halfway
  auto step = engine_->Step(id, {});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(step.status().message(), HasSubstr(absl::StrCat("sequence ", id)));
  EXPECT_FALSE(ReaderAccepts(table));
  for (auto code : {engine_->GetBlockTable(id).status().code(),
                    AppendRange(id, 40, 1).status().code(), engine_->Step(id, {}).status().code(),
                    engine_->Fork(id, absl::ZeroDuration()).status().code()}) {
    EXPECT_EQ(code, absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(engine_->KeepAlive({id})[0].code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(engine_->Release(id).ok());
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, 0u);
  EXPECT_EQ(engine_->Stats(false).sequences_poisoned, 1u);
}

TEST_F(ContractTest, AFullPoolCanStillQuantize) {
  // 24 pages of 4 KiB; one layout block of this layout is 512 bytes (16 x 8 x 2 x 2).
  MakeFaultyEngine(24 * 4096, false, /*reserve_pages=*/1);
  QuantConfig quant{kernels::QuantType::kInt8, 16};
  const uint64_t id = Create("full", {}, absl::ZeroDuration(), quant);
  // Fill every page but the reserve with layout blocks (8 blocks a page, 8 streams).
  uint32_t appended = 0;
  while (AppendRange(id, appended, 16).ok()) appended += 16;
  ASSERT_GT(appended, 64u);
  EXPECT_EQ(engine_->Stats(false).pool_free_bytes, 4096u);  // only the reserve is left
  auto step = engine_->Step(id, {});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_GT(step->quantized_tokens, 0u);
  EXPECT_LT(step->kv_bytes_after, step->kv_bytes_before);
}

TEST_F(ContractTest, ForkedInfokvChildDoesNotCompressItsPromptAgain) {
  const policy::ParamOverrides params = {
      {"decode_interval", 4}, {"window", 4}, {"history", 3}, {"prefill_ratio", 0.5}};
  const uint64_t parent = Create("infokv", params);
  positions_ = testing::Range(0, 40);
  k_ = testing::Payload16(kL * kH, 0, 40, kD, 0);
  v_ = testing::Payload16(kL * kH, 0, 40, kD, 1);
  std::vector<float> entropy(40), distance(40);
  for (int i = 0; i < 40; ++i) {
    entropy[i] = 0.1f * (i % 7);
    distance[i] = 0.05f * (i % 5);
  }
  AppendChunk chunk{positions_, {}, k_, v_, entropy, distance};
  ASSERT_TRUE(engine_->Append(parent, absl::MakeConstSpan(&chunk, 1)).ok());
  CompressInput prefill;
  prefill.epoch = engine_->GetBlockTable(parent)->epoch;
  std::vector<std::vector<float>> window(kL * kH, std::vector<float>(40));
  for (uint32_t s = 0; s < kL * kH; ++s) {
    for (int j = 0; j < 40; ++j) window[s][j] = static_cast<float>((j * 7 + s) % 11);
    prefill.window_scores.push_back({s / kH, s % kH, window[s]});
  }
  ASSERT_TRUE(engine_->Compress(parent, prefill).ok());
  auto child = *engine_->Fork(parent, absl::ZeroDuration());
  // Both decode the same tokens with the same signals: they must stay identical.
  for (int t = 0; t < 8; ++t) {
    for (uint64_t id : {parent, child.sequence_id}) {
      positions_ = {40 + t};
      k_ = testing::Payload16(kL * kH, 40 + t, 1, kD, 0);
      v_ = testing::Payload16(kL * kH, 40 + t, 1, kD, 1);
      const float e = 0.3f, d = 0.1f;
      AppendChunk one{
          positions_, {}, k_, v_, absl::MakeConstSpan(&e, 1), absl::MakeConstSpan(&d, 1)};
      ASSERT_TRUE(engine_->Append(id, absl::MakeConstSpan(&one, 1)).ok());
      ASSERT_TRUE(engine_->Step(id, Signals(id, t)).ok());
    }
    EXPECT_EQ(engine_->GetBlockTable(parent)->streams[0].positions,
              engine_->GetBlockTable(child.sequence_id)->streams[0].positions)
        << "step " << t;
  }
  EXPECT_EQ(Content(parent), Content(child.sequence_id));
}

TEST_F(ContractTest, KeepAliveAnswersPerIdAndAReadRenewsTheLeaseAtEachPiece) {
  const uint64_t a = Create("full", {}, absl::Seconds(5));
  const uint64_t b = Create("full", {}, absl::Seconds(5));
  ASSERT_TRUE(AppendRange(a, 0, 4).ok());
  clock_.Advance(absl::Seconds(4));
  const std::vector<absl::Status> r = engine_->KeepAlive({a, 999, b});
  ASSERT_EQ(r.size(), 3u);
  EXPECT_TRUE(r[0].ok());
  EXPECT_EQ(r[1].code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r[1].message(), HasSubstr("sequence_ids[1]"));
  EXPECT_TRUE(r[2].ok()) << "one unknown id renewed nothing";
  clock_.Advance(absl::Seconds(4));
  EXPECT_EQ(engine_->ExpireLeases(), 0u);
  // A read renews the lease at each piece: a client that keeps reading keeps its sequence
  // for longer than the lease (here 4 s between pieces, 8 s in all, a 5 s lease); one that
  // stops reading holds nothing (AStalledReadDoesNotKeepALapsedSequence).
  bool reaped_during_read = false;
  ASSERT_TRUE(engine_
                  ->ReadKV(a, 0, 0, 1,
                           [&](StreamKV&&) {
                             clock_.Advance(absl::Seconds(4));
                             reaped_during_read = reaped_during_read || engine_->ExpireLeases() > 0;
                             return absl::OkStatus();
                           })
                  .ok());
  EXPECT_FALSE(engine_->GetBlockTable(a).status().code() == absl::StatusCode::kNotFound);
  EXPECT_TRUE(reaped_during_read) << "b, with nothing in flight, lapsed meanwhile";
}

TEST_F(ContractTest, DoubleUnrefIsLoudAndNeverWraps) {
  auto pool = *store::BlockPool::Create(4 * 4096, 4096);
  std::vector<store::BlockId> ids;
  ASSERT_TRUE(pool->AllocateMany(1024, 1, &ids).ok());
  EXPECT_EQ(pool->Unref(ids), 1u);
  EXPECT_EQ(pool->Unref(ids), 0u);
  EXPECT_EQ(pool->usage().bad_unrefs, 1u);
  EXPECT_EQ(pool->usage().blocks_used, 0u);
  ids.clear();
  ASSERT_TRUE(pool->AllocateMany(1024, 2, &ids).ok());
  EXPECT_EQ(pool->refs(ids[0]), 1u);  // a fresh block, not a wrapped count
  // Pools whose block ids could pass 2^32 are refused up front.
  EXPECT_EQ(store::BlockPool::Create(uint64_t{1} << 39, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ContractTest, HostMetadataIsBoundedAndAccounted) {
  // 1024 layers x 1024 heads x head_dim 1: each factor in range, ~1M streams of metadata.
  auto huge = engine_->CreateSequence(Layout{1024, 1024, 1, DType::kF16, 16, 1000}, "full", {}, {},
                                      absl::ZeroDuration());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("streams"));
  // A layout whose single token cannot fit one message could never be filled.
  EngineConfig config;
  config.pool_bytes = 1 << 20;
  config.page_bytes = 1 << 16;
  config.max_append_bytes = 4096;
  config.host_metadata_bytes = 64 << 10;
  FakeClock clock;
  auto small = *Engine::Create(config, *store::CpuBackend::Create(1 << 20), &clock);
  auto wide = small->CreateSequence(Layout{32, 8, 128, DType::kF16, 16, 1000}, "full", {}, {},
                                    absl::ZeroDuration());
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wide.status().message(), HasSubstr("--max-message-bytes"));
  // Appends stop at the host budget with a clear error, and release gives it all back.
  const uint64_t id =
      small->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration())->sequence_id;
  EXPECT_GT(small->Stats(false).host_metadata_bytes, 0u);
  absl::Status refused;
  int64_t next = 0;
  for (int i = 0; i < 1000 && refused.ok(); ++i) {
    const std::vector<int64_t> positions = testing::Range(next, 8);
    const std::string k = testing::Payload16(kL * kH, next, 8, kD, 0);
    AppendChunk chunk{positions, {}, k, k, {}, {}};
    refused = small->Append(id, absl::MakeConstSpan(&chunk, 1)).status();
    if (refused.ok()) next += 8;
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--host-metadata-bytes"));
  EXPECT_LE(small->Stats(false).host_metadata_bytes, uint64_t{64} << 10);
  EXPECT_EQ(small->GetBlockTable(id)->streams[0].positions.size(), static_cast<size_t>(next));
  ASSERT_TRUE(small->Release(id).ok());
  EXPECT_EQ(small->Stats(false).host_metadata_bytes, 0u);
}

TEST_F(ContractTest, AppendsNeverTakeHostMemoryPastTheBudget) {
  // A per-slot vector that must grow doubles: one token can take as much as the stream
  // holds, and so can the slot state. Before the fix an Append reserved twice its own
  // tokens' bytes, so the append that doubled the vectors near the budget passed it (by up
  // to 1.6x); the slot state's doubling was not reserved at all.
  struct Case {
    const char* policy;
    bool device_step;  // h2o and confkv keep their scores in a slot state, else in the streams
  };
  for (const Case& c :
       {Case{"full", true}, Case{"h2o", false}, Case{"h2o", true}, Case{"confkv", true}}) {
    for (uint64_t budget = 40 << 10; budget <= (160u << 10); budget += 6 << 10) {
      EngineConfig config;
      config.pool_bytes = 1 << 20;
      config.page_bytes = 1 << 16;
      config.host_metadata_bytes = budget;
      config.device_step = c.device_step;
      FakeClock clock;
      auto engine = *Engine::Create(config, *store::CpuBackend::Create(1 << 20), &clock);
      const uint64_t id =
          engine->CreateSequence(TestLayout(), c.policy, {}, {}, absl::ZeroDuration())->sequence_id;
      absl::Status refused;
      std::mt19937 rng(static_cast<uint32_t>(budget));
      for (int64_t next = 0; next < 4000 && refused.ok();) {
        // Mostly a few tokens; now and then a prompt-sized chunk (a first one of many blocks).
        const int64_t n = rng() % 8 == 0 ? 17 + rng() % 60 : 1 + rng() % 4;
        const std::vector<int64_t> positions = testing::Range(next, n);
        const std::string k = testing::Payload16(kL * kH, next, n, kD, 0);
        AppendChunk chunk{positions, {}, k, k, {}, {}};
        refused = engine->Append(id, absl::MakeConstSpan(&chunk, 1)).status();
        const EngineStats stats = engine->Stats(false);
        ASSERT_LE(stats.host_metadata_bytes + stats.slot_state_bytes, budget)
            << c.policy << (c.device_step ? " (slot state)" : "") << ", budget " << budget
            << ", after token " << next;
        if (refused.ok()) next += n;
      }
      EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << c.policy;
      ASSERT_TRUE(engine->Release(id).ok());
    }
  }
}

TEST_F(ContractTest, OpenAppendStreamsCountAgainstTheHostBudget) {
  // Two AppendStreams on two sequences each stage ~60 % of what the budget has left. Each
  // alone fits; before the fix both were checked against what the sequences held, not what
  // open sessions had staged, so N streams could stage N budgets.
  constexpr uint64_t kBudget = 64 << 10;
  MakeEngine(1 << 20, [](EngineConfig& config) { config.host_metadata_bytes = kBudget; });
  const uint64_t a = Create("full");
  const uint64_t b = Create("full");
  const uint64_t used = engine_->Stats(false).host_metadata_bytes;
  // A chunk of n tokens stages 2 x 20 bytes per token (engine: position, id, two signals).
  const uint32_t n = static_cast<uint32_t>((kBudget - used) * 6 / 10 / 40);
  const std::vector<int64_t> positions = testing::Range(0, n);
  const std::string k = testing::Payload16(kL * kH, 0, n, kD, 0);
  const AppendChunk chunk{positions, {}, k, k, {}, {}};
  auto first = engine_->BeginAppend(a);
  auto second = engine_->BeginAppend(b);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE((*first)->Add(chunk).ok());
  const absl::Status refused = (*second)->Add(chunk);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("--host-metadata-bytes"));
  // Once the first session ends, its bytes are free again.
  first->reset();
  second->reset();
  auto third = engine_->BeginAppend(b);
  ASSERT_TRUE(third.ok());
  EXPECT_TRUE((*third)->Add(chunk).ok());
}

TEST_F(ContractTest, ConcurrentAppendsAndStepsOnOneSequenceWaitForEachOther) {
  // A unary Append holds the sequence for its whole call: a Step arriving meanwhile waits
  // (before the fix it found an "AppendStream open" and failed).
  const uint64_t id = Create("window", {{"window", 64}});
  std::atomic<int> refused{0};
  std::thread stepper([&] {
    for (int i = 0; i < 300; ++i) {
      absl::StatusOr<StepResult> r = engine_->Step(id, {});
      if (!r.ok()) ++refused;
    }
  });
  for (int64_t t = 0; t < 300; ++t) ASSERT_TRUE(AppendRange(id, t, 1).ok()) << t;
  stepper.join();
  EXPECT_EQ(refused.load(), 0);
}

}  // namespace
}  // namespace kvmem::engine
