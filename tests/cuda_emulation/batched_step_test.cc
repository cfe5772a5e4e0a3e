// StepBatch on the CUDA backend with the device step: the slot-state halves of every
// entry's step run as one batch (store::StepSlotStates), on the emulated runtime, which
// counts the host's waits for the device, the copies between them and the launches.
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_runtime_api.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"
#include "server/store/cpu_backend.h"
#include "server/store/cuda_backend.h"
#include "tests/testing/engine_twins.h"

namespace kvmem::engine {
namespace {

using twins::kB;
using twins::kD;
using twins::kH;
using twins::kL;
using twins::kVocab;

const Layout kLayout{kL, kH, kD, DType::kF16, kB, kVocab};

std::unique_ptr<Engine> CudaEngine(FakeClock* clock, uint64_t pool_bytes,
                                   bool in_place_writes = false) {
  EngineConfig config;
  config.pool_bytes = pool_bytes;
  config.page_bytes = 4096;
  config.in_place_writes = in_place_writes;
  return *Engine::Create(config, *store::CudaBackend::Create(pool_bytes), clock);
}

// The same on the CPU backend, the policies' host code deciding: what the device step must
// match.
std::unique_ptr<Engine> HostEngine(FakeClock* clock, uint64_t pool_bytes) {
  EngineConfig config;
  config.pool_bytes = pool_bytes;
  config.page_bytes = 4096;
  config.device_step = false;
  return *Engine::Create(config, *store::CpuBackend::Create(pool_bytes), clock);
}

// One decode entry's inputs, kept alive for the call that reads them.
struct DecodeInput {
  std::vector<int64_t> positions;
  std::string k, v;
  std::vector<std::vector<float>> rows;
  StepCall call;
};

// An entry stepping `id` over its table as it is, plus `appended` new tokens from
// position `first` (0: no append): rows normalized over the table and the new tokens.
void MakeEntry(Engine& e, uint64_t id, int64_t first, uint32_t appended, std::mt19937& rng,
               DecodeInput* in) {
  const BlockTable table = *e.GetBlockTable(id);
  in->rows = twins::Rows(table, rng);
  for (std::vector<float>& row : in->rows) row.insert(row.end(), appended, 0.01f);
  in->call = StepCall{};
  in->call.sequence_id = id;
  if (appended > 0) {
    in->positions = testing::Range(first, appended);
    in->k = testing::PayloadF16(kL * kH, first, appended, kD, 0);
    in->v = testing::PayloadF16(kL * kH, first, appended, kD, 1);
    in->call.append = AppendChunk{in->positions, {}, in->k, in->v, {}, {}};
  }
  StepInput step;
  step.epoch = table.epoch;
  step.attention = twins::Signals(in->rows);
  const float p1 = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
  step.logits = RawLogitStats{1.5f, p1, p1 / 3, {}};
  in->call.step = std::move(step);
}

// N sequences of `policy`, each with `tokens` appended.
std::vector<uint64_t> Sequences(Engine& e, uint32_t n, const char* policy,
                                const policy::ParamOverrides& params, uint32_t tokens) {
  std::vector<uint64_t> ids;
  for (uint32_t i = 0; i < n; ++i) {
    ids.push_back(e.CreateSequence(kLayout, policy, params, {}, {})->sequence_id);
    EXPECT_TRUE(twins::Append(e, ids.back(), 0, tokens).ok());
  }
  return ids;
}

// One StepBatch with an entry per sequence (MakeEntry's), and what it cost the device.
struct CountedBatch {
  absl::StatusOr<std::vector<StepOutcome>> out;
  size_t waits, transfers, launches;
};
CountedBatch RunCounted(Engine& e, const std::vector<uint64_t>& ids, int64_t first,
                        uint32_t appended, std::mt19937& rng) {
  std::vector<DecodeInput> inputs(ids.size());
  std::vector<StepCall> calls;
  for (size_t i = 0; i < ids.size(); ++i) {
    MakeEntry(e, ids[i], first, appended, rng, &inputs[i]);
    calls.push_back(inputs[i].call);
  }
  const cuda_emulation::Counts start = cuda_emulation::Count();
  absl::StatusOr<std::vector<StepOutcome>> out = e.StepBatch(calls);
  const cuda_emulation::Counts end = cuda_emulation::Count();
  return {std::move(out), end.waits - start.waits, end.transfers - start.transfers,
          end.launches - start.launches};
}

// A batch of N step entries that evict nothing costs one round trip, whatever N: one
// upload of every entry's rows and segments, UpdateScoresSegments, SelectTopSegments and
// CompactSlotsSegments (into each state's other bank, whether or not a slot went: the
// commit swaps the banks only where one did), one download of the keep flags and one wait.
// Counted after a first batch, which may grow the pinned staging (a wait: cudaFreeHost).
TEST(BatchedStepTest, AStepBatchWaitsForTheDeviceOnceWhateverItsSize) {
  for (uint32_t n : {1u, 8u, 64u}) {
    SCOPED_TRACE(::testing::Message() << n << " entries");
    FakeClock clock;
    auto engine = CudaEngine(&clock, 64 << 20);
    const std::vector<uint64_t> ids =
        Sequences(*engine, n, "confkv", {{"c_high", 512}, {"c_low", 512}}, 40);
    std::mt19937 rng(n);
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(::testing::Message() << "round " << round);
      const CountedBatch batch = RunCounted(*engine, ids, 0, 0, rng);
      ASSERT_TRUE(batch.out.ok()) << batch.out.status();
      for (const StepOutcome& o : *batch.out) {
        ASSERT_TRUE(o.status.ok()) << o.status;
        ASSERT_TRUE(o.step.has_value());
        EXPECT_EQ(o.step->evicted_tokens, 0u);
      }
      if (round == 0) continue;
      EXPECT_EQ(batch.waits, 1u);
      EXPECT_EQ(batch.transfers, 2u);
      EXPECT_EQ(batch.launches, 3u);
    }
  }
}

// A decode batch that evicts, each entry appending its token's K/V as bytes: three round
// trips whatever N — the K/V writes (the backend's Write), the steps (the slot states'
// appends queued before them on the slot states' stream, not waited for: AppendAll; the
// metadata compacted into each state's other bank in the same round trip: StepAll), the K/V
// moves (DecisionApplier::ExecuteMany) — and six copies: the K/V and its op list, the
// appends' positions, the steps' rows and segments, the keep flags back, the moves' op
// list. Launches vary with the waves of the moves (two per wave, the sequences' side by
// side: Backend::MoveDisjoint). Exact, so that a change to the batch's round trips shows
// here; the figures are in bench/RESULTS.md.
TEST(BatchedStepTest, AnEvictingDecodeBatchWaitsThreeTimesWhateverItsSize) {
  for (uint32_t n : {1u, 8u, 64u}) {
    SCOPED_TRACE(::testing::Message() << n << " entries");
    FakeClock clock;
    auto engine = CudaEngine(&clock, 64 << 20);
    const std::vector<uint64_t> ids =
        Sequences(*engine, n, "confkv", {{"c_high", 48}, {"c_low", 48}, {"protect", 8}}, 100);
    std::mt19937 rng(n);
    for (int64_t t = 100; t < 106; ++t) {
      const CountedBatch batch = RunCounted(*engine, ids, t, 1, rng);
      ASSERT_TRUE(batch.out.ok()) << batch.out.status();
      for (const StepOutcome& o : *batch.out) {
        ASSERT_TRUE(o.status.ok()) << o.status;
        EXPECT_GT(o.step->evicted_tokens, 0u);
      }
      if (t < 102) continue;  // past the first steps' growth
      EXPECT_EQ(batch.waits, 3u);
      EXPECT_EQ(batch.transfers, 6u);
      // Five launches besides the moves, two per wave of the sequence whose moves take the
      // most (a compaction that shifts rows toward a block's end, as StreamPlanner::Keep
      // plans some, reads rows written earlier in the batch: a new wave); at most five seen.
      EXPECT_LE(batch.launches, 5u + 2 * 5);
      if (t == 105) {
        std::printf("%u entries: %zu waits, %zu transfers, %zu launches per decode batch\n", n,
                    batch.waits, batch.transfers, batch.launches);
      }
    }
  }
}

// The decode loop in place (kvmemd --in-place-writes): each entry commits the token its
// worker wrote where the last answer's plan said, steps, and asks for the next plan. No K/V
// crosses the call, so an evicting batch waits for the device twice whatever N — its steps
// (behind the queued appends) and its K/V moves — with four copies: the appends' positions,
// the steps' rows and segments, the keep flags back, the moves' op list. (What a worker
// writes at the plan is not what this test counts: the K/V stays as the pool has it.)
TEST(BatchedStepTest, AnInPlaceEvictingBatchWaitsTwiceWhateverItsSize) {
  for (uint32_t n : {1u, 8u, 64u}) {
    SCOPED_TRACE(::testing::Message() << n << " entries");
    FakeClock clock;
    auto engine = CudaEngine(&clock, 64 << 20, /*in_place_writes=*/true);
    const std::vector<uint64_t> ids =
        Sequences(*engine, n, "confkv", {{"c_high", 48}, {"c_low", 48}, {"protect", 8}}, 100);
    std::vector<uint64_t> plans(n);
    {
      std::vector<StepCall> ask(n);
      for (uint32_t i = 0; i < n; ++i) {
        ask[i].sequence_id = ids[i];
        ask[i].plan_tokens = 1;
      }
      absl::StatusOr<std::vector<StepOutcome>> out = engine->StepBatch(ask);
      ASSERT_TRUE(out.ok()) << out.status();
      for (uint32_t i = 0; i < n; ++i) {
        ASSERT_TRUE((*out)[i].plan.has_value() && (*out)[i].plan->ok());
        plans[i] = (*out)[i].plan->value().id;
      }
    }
    std::mt19937 rng(n);
    for (int64_t t = 100; t < 106; ++t) {
      std::vector<DecodeInput> inputs(n);
      std::vector<StepCall> calls;
      for (uint32_t i = 0; i < n; ++i) {
        MakeEntry(*engine, ids[i], t, 1, rng, &inputs[i]);
        inputs[i].call.append = AppendChunk{inputs[i].positions, {}, {}, {}, {}, {}};
        inputs[i].call.plan_id = plans[i];
        inputs[i].call.plan_tokens = 1;
        calls.push_back(inputs[i].call);
      }
      const cuda_emulation::Counts start = cuda_emulation::Count();
      absl::StatusOr<std::vector<StepOutcome>> out = engine->StepBatch(calls);
      const cuda_emulation::Counts end = cuda_emulation::Count();
      ASSERT_TRUE(out.ok()) << out.status();
      for (uint32_t i = 0; i < n; ++i) {
        const StepOutcome& o = (*out)[i];
        ASSERT_TRUE(o.status.ok()) << o.status;
        EXPECT_GT(o.step->evicted_tokens, 0u);
        ASSERT_TRUE(o.plan.has_value() && o.plan->ok()) << o.plan->status();
        plans[i] = o.plan->value().id;
      }
      if (t < 102) continue;  // past the first steps' growth
      EXPECT_EQ(end.waits - start.waits, 2u);
      EXPECT_EQ(end.transfers - start.transfers, 4u);
      // Four launches besides the moves' (two per wave; at most five waves seen above).
      EXPECT_LE(end.launches - start.launches, 4u + 2 * 5);
      if (t == 105) {
        std::printf("in place, %u entries: %zu waits, %zu transfers, %zu launches per batch\n", n,
                    end.waits - start.waits, end.transfers - start.transfers,
                    end.launches - start.launches);
      }
    }
  }
}

// Batched steps decide what the host policies decide, entry by entry: one StepBatch per
// decode step over sequences of every policy with a kernel step (quantizing ones too) and
// a fork, against the same batches on the CPU backend running the policies' host code;
// entries that fail (rows of the wrong length, an unknown sequence) fail alone and alike.
TEST(BatchedStepTest, BatchedStepsDecideWhatTheHostPoliciesDecide) {
  FakeClock clock;
  auto gpu = CudaEngine(&clock, 32 << 20);
  auto host = HostEngine(&clock, 32 << 20);
  std::vector<uint64_t> g_ids, h_ids;
  std::vector<std::optional<kernels::QuantType>> quant;
  for (const twins::Case& c : twins::Cases()) {
    g_ids.push_back(gpu->CreateSequence(kLayout, c.policy, c.params, c.quant, {})->sequence_id);
    h_ids.push_back(host->CreateSequence(kLayout, c.policy, c.params, c.quant, {})->sequence_id);
    quant.push_back(c.quant.type);
    ASSERT_TRUE(twins::Append(*gpu, g_ids.back(), 0, 120).ok());
    ASSERT_TRUE(twins::Append(*host, h_ids.back(), 0, 120).ok());
  }
  std::mt19937 g_rng(11), h_rng(11);
  uint64_t evicted = 0, failed = 0;
  for (int64_t t = 120; t < 320; ++t) {
    const std::string at = "step " + std::to_string(t);
    if (t == 200) {
      g_ids.push_back(gpu->Fork(g_ids[0], {})->sequence_id);
      h_ids.push_back(host->Fork(h_ids[0], {})->sequence_id);
      quant.push_back(quant[0]);
    }
    const size_t n = g_ids.size();
    std::vector<DecodeInput> g_in(n), h_in(n);
    std::vector<StepCall> g_calls, h_calls;
    const size_t bad = static_cast<size_t>(t) % (3 * n);  // a bad entry one step in three
    for (size_t i = 0; i < n; ++i) {
      MakeEntry(*gpu, g_ids[i], t, 1, g_rng, &g_in[i]);
      MakeEntry(*host, h_ids[i], t, 1, h_rng, &h_in[i]);
      if (i == bad) {
        g_in[i].rows[1].pop_back();
        h_in[i].rows[1].pop_back();
        g_in[i].call.step->attention = twins::Signals(g_in[i].rows);
        h_in[i].call.step->attention = twins::Signals(h_in[i].rows);
      }
      g_calls.push_back(g_in[i].call);
      h_calls.push_back(h_in[i].call);
    }
    StepCall unknown;
    unknown.sequence_id = 999999;
    unknown.step = StepInput{};
    g_calls.insert(g_calls.begin() + static_cast<ptrdiff_t>(t % 3), unknown);
    h_calls.insert(h_calls.begin() + static_cast<ptrdiff_t>(t % 3), unknown);
    absl::StatusOr<std::vector<StepOutcome>> g_out = gpu->StepBatch(g_calls);
    absl::StatusOr<std::vector<StepOutcome>> h_out = host->StepBatch(h_calls);
    ASSERT_TRUE(g_out.ok()) << at << ": " << g_out.status();
    ASSERT_TRUE(h_out.ok()) << at << ": " << h_out.status();
    ASSERT_EQ(g_out->size(), h_out->size());
    for (size_t e = 0; e < g_out->size(); ++e) {
      const StepOutcome &g = (*g_out)[e], &h = (*h_out)[e];
      SCOPED_TRACE(::testing::Message() << at << " entry " << e);
      ASSERT_EQ(g.status.code(), h.status.code()) << g.status << " vs " << h.status;
      EXPECT_EQ(g.appended.has_value(), h.appended.has_value());
      ASSERT_EQ(g.step.has_value(), h.step.has_value());
      if (!g.status.ok()) {
        ++failed;
        continue;
      }
      EXPECT_EQ(g.step->evicted_tokens, h.step->evicted_tokens);
      EXPECT_EQ(g.step->quantized_tokens, h.step->quantized_tokens);
      EXPECT_EQ(g.step->budget_tokens, h.step->budget_tokens);
      EXPECT_EQ(g.step->kv_bytes_after, h.step->kv_bytes_after);
      evicted += g.step->evicted_tokens;
    }
    for (size_t i = 0; i < n; ++i) {
      twins::ExpectSameTables(*gpu, g_ids[i], *host, h_ids[i], at);
    }
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(evicted, 5000u);
  EXPECT_GT(failed, 250u);  // the unknown sequence every step, and the bad rows
  for (size_t i = 0; i < g_ids.size(); ++i) twins::ExpectContent(*gpu, g_ids[i], quant[i]);
}

// A batch's slot-state appends stay queued behind it when no step of the batch waits for
// them (append-only entries): whatever comes next on those sequences — a batched step, a
// unary Step, a Fork — sees the appended slots (CudaSlotState::Settle), decisions and
// tables as the host policies make them on the CPU backend.
TEST(BatchedStepTest, QueuedAppendsAreThereForWhateverComesNext) {
  FakeClock clock;
  auto gpu = CudaEngine(&clock, 32 << 20);
  auto host = HostEngine(&clock, 32 << 20);
  const policy::ParamOverrides params = {{"c_high", 48}, {"c_low", 48}, {"protect", 8}};
  std::vector<uint64_t> g_ids = Sequences(*gpu, 4, "confkv", params, 100);
  std::vector<uint64_t> h_ids = Sequences(*host, 4, "confkv", params, 100);
  std::mt19937 g_rng(21), h_rng(21);
  uint64_t evicted = 0;
  for (int64_t t = 100; t < 148; ++t) {
    const std::string at = "step " + std::to_string(t);
    SCOPED_TRACE(at);
    // The token's K/V, alone in its batch.
    for (auto [e, ids, rng] :
         {std::tuple{gpu.get(), &g_ids, &g_rng}, std::tuple{host.get(), &h_ids, &h_rng}}) {
      std::vector<DecodeInput> in(ids->size());
      std::vector<StepCall> calls;
      for (size_t i = 0; i < ids->size(); ++i) {
        MakeEntry(*e, (*ids)[i], t, 1, *rng, &in[i]);
        in[i].call.step.reset();
        calls.push_back(in[i].call);
      }
      absl::StatusOr<std::vector<StepOutcome>> out = e->StepBatch(calls);
      ASSERT_TRUE(out.ok()) << out.status();
      for (const StepOutcome& o : *out) ASSERT_TRUE(o.status.ok()) << o.status;
    }
    if (t % 3 == 2) {  // a fork of a sequence whose append is still queued, stepped later
      const uint64_t g = gpu->Fork(g_ids[0], {})->sequence_id;
      const uint64_t h = host->Fork(h_ids[0], {})->sequence_id;
      g_ids.push_back(g);
      h_ids.push_back(h);
    }
    // Then the step: one batch, or each sequence's own Step.
    std::vector<StepResult> g_steps, h_steps;
    for (auto [e, ids, rng, steps] : {std::tuple{gpu.get(), &g_ids, &g_rng, &g_steps},
                                      std::tuple{host.get(), &h_ids, &h_rng, &h_steps}}) {
      std::vector<DecodeInput> in(ids->size());
      std::vector<StepCall> calls;
      for (size_t i = 0; i < ids->size(); ++i) {
        MakeEntry(*e, (*ids)[i], t, 0, *rng, &in[i]);
        calls.push_back(in[i].call);
      }
      if (t % 3 == 0) {
        for (const StepCall& c : calls) {
          absl::StatusOr<StepResult> r = e->Step(c.sequence_id, *c.step);
          ASSERT_TRUE(r.ok()) << r.status();
          steps->push_back(*r);
        }
      } else {
        absl::StatusOr<std::vector<StepOutcome>> out = e->StepBatch(calls);
        ASSERT_TRUE(out.ok()) << out.status();
        for (const StepOutcome& o : *out) {
          ASSERT_TRUE(o.status.ok()) << o.status;
          steps->push_back(*o.step);
        }
      }
    }
    ASSERT_EQ(g_steps.size(), h_steps.size());
    for (size_t i = 0; i < g_steps.size(); ++i) {
      EXPECT_EQ(g_steps[i].evicted_tokens, h_steps[i].evicted_tokens) << "sequence " << i;
      evicted += g_steps[i].evicted_tokens;
    }
    // The same slots kept (a fork's blocks may be laid out otherwise: whether a block it
    // shares is still shared when it plans depends on the order the batch's entries run).
    for (size_t i = 0; i < g_ids.size(); ++i) {
      const BlockTable g = *gpu->GetBlockTable(g_ids[i]), h = *host->GetBlockTable(h_ids[i]);
      ASSERT_EQ(g.streams.size(), h.streams.size());
      for (size_t k = 0; k < g.streams.size(); ++k) {
        ASSERT_EQ(g.streams[k].positions, h.streams[k].positions) << "sequence " << i;
      }
    }
  }
  EXPECT_GT(evicted, 500u);
  for (uint64_t id : g_ids) twins::ExpectContent(*gpu, id, std::nullopt);
}

// Appends that no step follows stay queued, but not without bound: at most eight batches'
// pinned staging is held for them (CudaScratchPool::kMaxDeferred), so that the ninth batch
// of appends alone waits for the device once to give them back. In place, so that no K/V
// write of the backend's waits either: 20 such batches, two waits.
TEST(BatchedStepTest, QueuedAppendsHoldABoundedStaging) {
  FakeClock clock;
  auto engine = CudaEngine(&clock, 32 << 20, /*in_place_writes=*/true);
  const std::vector<uint64_t> ids =
      Sequences(*engine, 4, "confkv", {{"c_high", 512}, {"c_low", 512}}, 40);
  std::vector<uint64_t> plans(ids.size(), 0);
  std::vector<std::vector<int64_t>> positions(ids.size());
  size_t waits = 0;
  for (int64_t t = 40; t < 61; ++t) {
    std::vector<StepCall> calls(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      calls[i].sequence_id = ids[i];
      calls[i].plan_tokens = 1;
      if (plans[i] == 0) continue;  // the first batch only asks for the plans
      positions[i] = testing::Range(t - 1, 1);
      calls[i].append = AppendChunk{positions[i], {}, {}, {}, {}, {}};
      calls[i].plan_id = plans[i];
    }
    const cuda_emulation::Counts start = cuda_emulation::Count();
    absl::StatusOr<std::vector<StepOutcome>> out = engine->StepBatch(calls);
    if (t > 40) waits += cuda_emulation::Count().waits - start.waits;
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << (*out)[i].status;
      ASSERT_TRUE((*out)[i].plan.has_value() && (*out)[i].plan->ok());
      plans[i] = (*out)[i].plan->value().id;
    }
  }
  EXPECT_EQ(waits, 2u);
}

// A queued append whose work faults on the device after its batch answered (the emulated
// kernel traps): the sequences it appended to are lost — their next step fails and poisons
// them (their slot states lack the token their tables have) — while the others that the
// failed wait also failed are unchanged and step again in the next batch.
TEST(BatchedStepTest, AQueuedAppendThatFaultsPoisonsItsSequencesOnly) {
  FakeClock clock;
  auto engine = CudaEngine(&clock, 32 << 20);
  const std::vector<uint64_t> ids =
      Sequences(*engine, 4, "confkv", {{"c_high", 48}, {"c_low", 48}, {"protect", 8}}, 100);
  std::mt19937 rng(9);
  // Sequences 0 and 1 append alone: the K/V write's launch runs, the slot states' scatter
  // (the batch's second launch) faults.
  {
    std::vector<DecodeInput> in(2);
    std::vector<StepCall> calls;
    for (size_t i = 0; i < 2; ++i) {
      MakeEntry(*engine, ids[i], 100, 1, rng, &in[i]);
      in[i].call.step.reset();
      calls.push_back(in[i].call);
    }
    cuda_emulation::FaultLaunchAt(2);
    absl::StatusOr<std::vector<StepOutcome>> out = engine->StepBatch(calls);
    cuda_emulation::FaultLaunchAt(0);
    ASSERT_TRUE(out.ok()) << out.status();
    for (const StepOutcome& o : *out) ASSERT_TRUE(o.status.ok()) << o.status;  // answered
  }
  std::vector<BlockTable> before;
  for (uint64_t id : ids) before.push_back(*engine->GetBlockTable(id));
  auto step_all = [&](const std::vector<uint64_t>& which) {
    std::vector<DecodeInput> in(which.size());
    std::vector<StepCall> calls;
    for (size_t i = 0; i < which.size(); ++i) {
      MakeEntry(*engine, which[i], 0, 0, rng, &in[i]);
      calls.push_back(in[i].call);
    }
    return *engine->StepBatch(calls);
  };
  const std::vector<StepOutcome> stepped = step_all(ids);
  for (size_t i = 0; i < ids.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "sequence " << i);
    EXPECT_FALSE(stepped[i].status.ok());  // the batch's wait failed: every step with it
    absl::StatusOr<BlockTable> now = engine->GetBlockTable(ids[i]);
    if (i < 2) {
      EXPECT_FALSE(now.ok()) << "a sequence whose append was lost still serves";
      continue;
    }
    ASSERT_TRUE(now.ok()) << now.status();
    for (size_t k = 0; k < now->streams.size(); ++k) {
      EXPECT_EQ(now->streams[k].positions, before[i].streams[k].positions);
    }
  }
  const std::vector<StepOutcome> again = step_all({ids[2], ids[3]});
  for (const StepOutcome& o : again) EXPECT_TRUE(o.status.ok()) << o.status;
}

// A device step's slot states live in device memory: they count against
// --device-metadata-bytes, not --host-metadata-bytes (issue 39: eight sequences of 2,100
// tokens of a 32x8x4 layout were refused for host metadata on the CUDA backend while the
// CPU backend admitted them). Past the device budget an Append or a Fork is refused naming
// it and changes nothing; released, the sequences give both back.
TEST(BatchedStepTest, SlotStatesInDeviceMemoryCountAgainstTheirOwnBudget) {
  const Layout layout{32, 8, 4, DType::kF16, 16, kVocab};
  auto append = [&](Engine& e, uint64_t id, uint32_t n) {
    const std::vector<int64_t> positions = testing::Range(0, n);
    const std::string k = testing::PayloadF16(32 * 8, 0, n, 4, 0);
    const std::string v = testing::PayloadF16(32 * 8, 0, n, 4, 1);
    AppendChunk chunk{positions, {}, k, v, {}, {}};
    return e.Append(id, absl::MakeConstSpan(&chunk, 1)).status();
  };
  for (const uint64_t device_budget : {uint64_t{0}, uint64_t{48} << 20, uint64_t{16} << 20}) {
    SCOPED_TRACE(::testing::Message() << "device budget " << device_budget);
    FakeClock clock;
    EngineConfig config;
    config.pool_bytes = 64 << 20;
    config.page_bytes = 4096;
    config.host_metadata_bytes = 24 << 20;
    config.device_metadata_bytes = device_budget;  // 0: pool / 2 + 64 MiB
    auto engine = *Engine::Create(config, *store::CudaBackend::Create(config.pool_bytes), &clock);
    const uint64_t id =
        engine->CreateSequence(layout, "confkv", {{"c_high", 2048}, {"c_low", 2048}}, {}, {})
            ->sequence_id;
    const absl::Status s = append(*engine, id, 2100);
    const EngineStats stats = engine->Stats(false);
    if (device_budget != uint64_t{16} << 20) {
      ASSERT_TRUE(s.ok()) << s;
      // 256 streams of 4,096 slots in device memory: more than the whole host budget.
      EXPECT_GT(stats.device_slot_state_bytes, uint64_t{24} << 20);
      EXPECT_LE(stats.host_metadata_bytes, uint64_t{24} << 20);
      // A fork copies it: within the default device budget, past 48 MiB.
      absl::StatusOr<CreateResult> fork = engine->Fork(id, {});
      if (device_budget == 0) {
        ASSERT_TRUE(fork.ok()) << fork.status();
        EXPECT_EQ(engine->Stats(false).device_slot_state_bytes, 2 * stats.device_slot_state_bytes);
        ASSERT_TRUE(engine->Release(fork->sequence_id).ok());
      } else {
        EXPECT_EQ(fork.status().code(), absl::StatusCode::kResourceExhausted) << fork.status();
        EXPECT_THAT(std::string(fork.status().message()),
                    ::testing::HasSubstr("--device-metadata-bytes"));
        EXPECT_EQ(engine->Stats(false).device_slot_state_bytes, stats.device_slot_state_bytes);
      }
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("--device-metadata-bytes"));
      EXPECT_EQ(engine->GetBlockTable(id)->streams[0].positions.size(), 0u);
      EXPECT_LE(stats.device_slot_state_bytes, device_budget);
      // The refusal kept nothing reserved: what fits still goes in.
      EXPECT_TRUE(append(*engine, id, 100).ok());
    }
    ASSERT_TRUE(engine->Release(id).ok());
    const EngineStats after = engine->Stats(false);
    EXPECT_EQ(after.device_slot_state_bytes, 0u);
    EXPECT_EQ(after.slot_state_bytes, 0u);
    // Nothing stays promised: a sequence as large as the first fits again.
    const uint64_t again =
        engine->CreateSequence(layout, "confkv", {{"c_high", 2048}, {"c_low", 2048}}, {}, {})
            ->sequence_id;
    EXPECT_EQ(append(*engine, again, 2100).ok(), device_budget != uint64_t{16} << 20);
  }
}

// Device memory running out anywhere in a batch (every allocation in turn fails once): each
// entry either applied whole or failed, and a failed one changed nothing or poisoned its
// sequence (past its point of no return); the survivors' K/V reads back exact, the next
// batch runs, and once every sequence is released the device holds nothing of theirs.
TEST(BatchedStepTest, AnAllocationFailingAnywhereInABatchHalfAppliesNothing) {
  const size_t baseline = cuda_emulation::LiveAllocations();
  size_t k = 1;
  for (;; ++k) {
    SCOPED_TRACE(::testing::Message() << "allocation " << k);
    FakeClock clock;
    auto engine = CudaEngine(&clock, 16 << 20);
    std::vector<uint64_t> ids;
    for (uint32_t i = 0; i < 8; ++i) {
      ids.push_back(
          engine
              ->CreateSequence(kLayout, i % 2 ? "h2o" : "confkv",
                               i % 2 ? policy::ParamOverrides{{"budget", 64}}
                                     : policy::ParamOverrides{{"c_high", 48}, {"c_low", 48}},
                               {}, {})
              ->sequence_id);
      ASSERT_TRUE(twins::Append(*engine, ids.back(), 0, 90).ok());
    }
    std::mt19937 rng(5);
    std::vector<BlockTable> before;
    for (uint64_t id : ids) before.push_back(*engine->GetBlockTable(id));
    std::vector<DecodeInput> inputs(ids.size());
    std::vector<StepCall> calls;
    for (size_t i = 0; i < ids.size(); ++i) {
      MakeEntry(*engine, ids[i], 90, 1, rng, &inputs[i]);
      calls.push_back(inputs[i].call);
    }
    const size_t injected = cuda_emulation::InjectedFailures();
    cuda_emulation::FailAllocationAt(k);
    absl::StatusOr<std::vector<StepOutcome>> out = engine->StepBatch(calls);
    const bool reached = cuda_emulation::InjectedFailures() > injected;
    cuda_emulation::FailAllocationAt(0);
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<bool> alive(ids.size(), true);
    for (size_t i = 0; i < ids.size(); ++i) {
      const StepOutcome& o = (*out)[i];
      absl::StatusOr<BlockTable> now = engine->GetBlockTable(ids[i]);
      if (!now.ok()) {  // poisoned past its point of no return
        EXPECT_FALSE(o.status.ok()) << "entry " << i;
        alive[i] = false;
        continue;
      }
      if (o.status.ok()) {
        EXPECT_TRUE(o.appended.has_value() && o.step.has_value()) << "entry " << i;
      } else if (!o.appended) {  // failed before its append applied: nothing changed
        EXPECT_EQ(now->epoch, before[i].epoch) << "entry " << i << ": " << o.status;
        for (size_t s = 0; s < now->streams.size(); ++s) {
          EXPECT_EQ(now->streams[s].positions, before[i].streams[s].positions) << "entry " << i;
        }
      }
      twins::ExpectContent(*engine, ids[i], std::nullopt);
    }
    // The next batch runs (appending where the failed entries did not).
    std::vector<DecodeInput> again(ids.size());
    std::vector<StepCall> next;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!alive[i]) continue;
      MakeEntry(*engine, ids[i], 91, 1, rng, &again[i]);
      next.push_back(again[i].call);
    }
    absl::StatusOr<std::vector<StepOutcome>> after = engine->StepBatch(next);
    ASSERT_TRUE(after.ok()) << after.status();
    for (const StepOutcome& o : *after) EXPECT_TRUE(o.status.ok()) << o.status;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (alive[i]) twins::ExpectContent(*engine, ids[i], std::nullopt);
      EXPECT_TRUE(engine->Release(ids[i]).ok());
    }
    const EngineStats stats = engine->Stats(false);
    EXPECT_EQ(stats.pool.blocks_used, 0u);
    EXPECT_EQ(stats.pool.bad_unrefs, 0u);
    engine.reset();
    EXPECT_EQ(cuda_emulation::LiveAllocations(), baseline);
    if (!reached) break;  // past the batch's last allocation
    if (HasFatalFailure()) return;
  }
  std::printf("the batch made %zu allocations\n", k - 1);
  EXPECT_GT(k, 4u);  // the sweep went through the batch's allocations
}

}  // namespace
}  // namespace kvmem::engine
