// Failpoint sweeps (DESIGN.md's contract, promise 2): every mutation is failed at each of
// its allocations, backend calls and commit steps in turn. After each failure the sequence
// is byte-for-byte what it was (state fingerprint, scores included) or poisoned (DATA_LOSS),
// never in between; and once everything is released the pool is empty with no bad drop.
#include <functional>
#include <random>
#include <utility>

#include "gmock/gmock.h"
#include "tests/testing/faulty_backend.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

// kHostAlloc: a host allocation that throws (std::bad_alloc) after the mutation took pool
// blocks or loaded state: what it took must go back.
enum class Site { kAllocate, kCommit, kBackend, kHostAlloc };

struct SweepCase {
  const char* name;
  const char* policy;
  bool device_step;
  // Runs the mutation on the prepared sequence; returns its status.
  std::function<absl::Status(Engine&, uint64_t id, uint64_t other)> op;
  // Whether some failure at an allocation can fail the call: Compress here only evicts
  // whole or contiguous runs (no copy) and quantizes, which waits instead of failing.
  bool allocation_can_fail = true;
  // Whether the call has a point that can fail at all (Fork and Release take no block,
  // call no backend and commit nothing that can throw: the sweep then shows they run).
  bool can_fail = true;
  // The prepared sequence: tokens per stream, and whether its format quantizes. Unquantized
  // and one over an h2o budget, a step drops one slot out of the middle of a list of seven
  // blocks: it plans and swaps only the entries around it (Engine::EvictedEntries).
  int64_t tokens = 44;
  bool quantized = true;
  // Whether the prepared sequence is forked (every block shared: copy-on-write). Without
  // the fork, a token that fits goes into the last blocks' free tails (no plan).
  bool fork = true;
};

class FailureSweepTest : public EngineTest,
                         public ::testing::WithParamInterface<std::tuple<SweepCase, Site>> {
 protected:
  void Prepare(const SweepCase& c) {
    MakeEngine(
        1 << 20,
        [&](EngineConfig& config) {
          config.device_step = c.device_step;
          config.failpoints = &failpoints_;
        },
        testing::FaultyBackend::Wrapper(&backend_));
    QuantConfig quant{kernels::QuantType::kInt8, 16};
    if (!c.quantized) quant = QuantConfig{};
    const policy::ParamOverrides params =
        std::string(c.policy) == "h2o"
            ? policy::ParamOverrides{{"budget", c.tokens == 44 ? 40 : c.tokens - 1}, {"recent", 8}}
            : policy::ParamOverrides{{"c_high", 30}, {"c_low", 40}, {"protect", 8}};
    id_ = Create(c.policy, params, absl::ZeroDuration(), quant);
    ASSERT_TRUE(AppendRange(id_, 0, static_cast<uint32_t>(c.tokens)).ok());
    // A fork shares every block: the mutation meets copy-on-write too.
    other_ = c.fork ? engine_->Fork(id_, absl::ZeroDuration())->sequence_id : 0;
  }

  void Arm(Site site, uint64_t n) {
    switch (site) {
      case Site::kAllocate:
        failpoints_.FailAt(Failpoints::kAllocate, n);
        return;
      case Site::kCommit:
        failpoints_.FailAt(Failpoints::kCommit, n);
        return;
      case Site::kBackend:
        backend_->FailAt(n);
        return;
      case Site::kHostAlloc:
        failpoints_.FailAt(Failpoints::kHostAlloc, n);
        return;
    }
  }
  bool Reached(Site site, uint64_t n) const {
    switch (site) {
      case Site::kAllocate:
        return failpoints_.hits(Failpoints::kAllocate) >= n;
      case Site::kCommit:
        return failpoints_.hits(Failpoints::kCommit) >= n;
      case Site::kBackend:
        return backend_->calls() >= n;
      case Site::kHostAlloc:
        return failpoints_.hits(Failpoints::kHostAlloc) >= n;
    }
    return false;
  }

  Failpoints failpoints_;
  testing::FaultyBackend* backend_ = nullptr;
  uint64_t id_ = 0, other_ = 0;
};

StepInput RandomSignals(Engine& engine, uint64_t id, std::vector<std::vector<float>>* rows) {
  const BlockTable table = *engine.GetBlockTable(id);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  rows->assign(table.streams.size(), {});
  StepInput in;
  in.epoch = table.epoch;
  in.logits = RawLogitStats{2.0f, 0.5f, 0.2f, {}};
  for (size_t s = 0; s < table.streams.size(); ++s) {
    for (size_t j = 0; j < table.streams[s].positions.size(); ++j) (*rows)[s].push_back(u(rng));
    in.attention.push_back({table.streams[s].layer, table.streams[s].kv_head, (*rows)[s]});
  }
  return in;
}

TEST_P(FailureSweepTest, EveryFailureLeavesTheSequenceUnchangedOrPoisoned) {
  const auto& [c, site] = GetParam();
  int failures = 0;
  for (uint64_t n = 1; n <= 64; ++n) {
    Prepare(c);
    const std::string before = *engine_->Fingerprint(id_);
    const std::string other_before = c.fork ? *engine_->Fingerprint(other_) : "";
    Arm(site, n);
    const absl::Status status = c.op(*engine_, id_, other_);
    const bool reached = Reached(site, n);
    failpoints_.Disarm();
    backend_->FailAt(0);
    if (!reached) {
      ASSERT_TRUE(status.ok()) << status;  // ran past every failure point
    }
    if (!status.ok()) {
      ++failures;
      absl::StatusOr<std::string> after = engine_->Fingerprint(id_);
      if (after.ok()) {
        EXPECT_EQ(*after, before) << c.name << ": failure " << n << " (" << status
                                  << ") changed the sequence without poisoning it";
      } else {
        EXPECT_EQ(after.status().code(), absl::StatusCode::kDataLoss) << after.status();
      }
    }
    // The fork is another sequence: whatever happened, it is untouched (unless the call
    // was its Release).
    absl::StatusOr<std::string> other_after =
        c.fork ? engine_->Fingerprint(other_) : absl::StatusOr<std::string>("");
    if (other_after.ok()) {
      EXPECT_EQ(*other_after, other_before) << c.name << ": failure " << n;
    } else {
      EXPECT_EQ(std::string(c.name), "release") << other_after.status();
    }
    ASSERT_TRUE(engine_->Release(id_).ok());
    (void)engine_->Release(other_);
    const EngineStats stats = engine_->Stats(false);
    EXPECT_EQ(stats.pool.blocks_used, 0u) << c.name << ": failure " << n << " leaked blocks";
    EXPECT_EQ(stats.pool.bad_unrefs, 0u) << c.name << ": failure " << n;
    EXPECT_EQ(stats.host_metadata_bytes, 0u) << c.name << ": failure " << n;
    if (!reached) break;  // the sweep is complete
  }
  const bool allocates = site == Site::kAllocate || site == Site::kHostAlloc;
  if (c.can_fail && (!allocates || c.allocation_can_fail)) {
    EXPECT_GT(failures, 0) << "the sweep never failed the mutation";
  }
}

std::vector<std::vector<float>> g_rows;

const SweepCase kCases[] = {
    {"append", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) { return AppendTokens(e, id, 44, 20); }},
    {"append_stream", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       // Three chunks through one session, as AppendStream sends them.
       absl::StatusOr<std::unique_ptr<AppendSession>> session = e.BeginAppend(id);
       if (!session.ok()) return session.status();
       for (int64_t first : {44, 51, 58}) {
         if (absl::Status s = AddRange(**session, first, 7); !s.ok()) return s;
       }
       return (*session)->Commit().status();
     }},
    {"append_tails", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       // 2 tokens into the 4 free slots of each stream's last block: no allocation.
       return AppendTokens(e, id, 44, 2);
     },
     false, true, 44, true, /*fork=*/false},
    {"append_stream_tails", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       // 1 and 1 token into the free tails, then 7 that do not fit: the plans start.
       absl::StatusOr<std::unique_ptr<AppendSession>> session = e.BeginAppend(id);
       if (!session.ok()) return session.status();
       for (const auto& [first, n] : {std::pair<int64_t, uint32_t>{44, 1}, {45, 1}, {46, 7}}) {
         if (absl::Status s = AddRange(**session, first, n); !s.ok()) return s;
       }
       return (*session)->Commit().status();
     },
     true, true, 44, true, /*fork=*/false},
    {"fork", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       absl::StatusOr<CreateResult> child = e.Fork(id, absl::ZeroDuration());
       if (!child.ok()) return child.status();
       return e.Release(child->sequence_id).status();
     },
     true, false},
    {"release", "h2o", false,
     [](Engine& e, uint64_t, uint64_t other) { return e.Release(other).status(); }, true, false},
    {"step_host", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       return e.Step(id, RandomSignals(e, id, &g_rows)).status();
     }},
    {"step_host_ranged", "h2o", false,
     [](Engine& e, uint64_t id, uint64_t) {
       return e.Step(id, RandomSignals(e, id, &g_rows)).status();
     },
     true, true, /*tokens=*/100, /*quantized=*/false},
    {"step_device", "confkv", true,
     [](Engine& e, uint64_t id, uint64_t) {
       return e.Step(id, RandomSignals(e, id, &g_rows)).status();
     }},
    {"compress", "confkv", true,
     [](Engine& e, uint64_t id, uint64_t) {
       CompressInput in;
       in.epoch = e.GetBlockTable(id)->epoch;
       in.target_tokens = 20;
       return e.Compress(id, in).status();
     },
     false},
};

std::string SweepName(const ::testing::TestParamInfo<std::tuple<SweepCase, Site>>& info) {
  const char* sites[] = {"allocation", "commit", "backend", "host_allocation"};
  return std::string(std::get<0>(info.param).name) + "_" +
         sites[static_cast<int>(std::get<1>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(Mutations, FailureSweepTest,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(Site::kAllocate, Site::kCommit,
                                                              Site::kBackend, Site::kHostAlloc)),
                         SweepName);

}  // namespace
}  // namespace kvmem::engine
