// A model-checking stress test of the engine's first promise (DESIGN.md): a same-host
// reader never accepts K/V that is not what its table says. Mutator threads run random
// forks, appends, steps with eviction and int8 quantization, compressions, releases and
// lease expiries; reader threads take block tables, read the blocks in place from the
// shared pool under the epoch protocol (sometimes long after fetching the table), and
// check every slot they accepted by its content tag (stream, position, writer). Counts:
// wrong accepts must be 0; stale refusals must happen (the readers did race the writers).
//
// KVMEM_STRESS_SECONDS sets the duration (default 60; CI runs it whole, and under TSan).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "server/common/mutex.h"
#include "server/engine/block_format.h"
#include "server/engine/engine.h"
#include "server/store/cpu_backend.h"
#include "spdlog/spdlog.h"
#include "tests/testing/payload.h"

namespace kvmem::engine {
namespace {

constexpr uint32_t kL = 2, kH = 2, kD = 8, kB = 8;
constexpr uint32_t kStreams = kL * kH;

Layout StressLayout() { return Layout{kL, kH, kD, DType::kF16, kB, 1000}; }

// Tags: who wrote a position. A sequence's positions keep the tag of the sequence that
// appended them (a fork inherits its parent's); K = ElementValue(stream, position, d, 2 tag),
// V the same with 2 tag + 1.
struct Model {
  absl::Mutex mu;
  // id -> tag per position (index = position; positions are 0..n-1, some evicted).
  std::map<uint64_t, std::shared_ptr<const std::vector<uint16_t>>> tags ABSL_GUARDED_BY(mu);
};

// Copies bytes that writers may be changing; the seqlock decides afterwards whether the
// copy counts. Relaxed atomic loads keep it a benign, documented race (tests/tsan.supp).
void RacyCopy(void* dst, const uint8_t* src, size_t bytes) {
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < bytes; ++i) out[i] = __atomic_load_n(src + i, __ATOMIC_RELAXED);
}

struct Counters {
  std::atomic<uint64_t> accepted{0}, refused{0}, wrong{0}, slots_checked{0};
  std::atomic<uint64_t> appends{0}, steps{0}, forks{0}, releases{0}, compresses{0}, expired{0},
      quantized{0};
};

class Reader {
 public:
  Reader(Engine* engine, Model* model, const uint8_t* pool, Counters* counters, uint32_t seed)
      : engine_(engine), model_(model), pool_(pool), c_(counters), rng_(seed) {}

  void Run(const std::atomic<bool>& stop) {
    while (!stop.load()) {
      ReadOnce();
      // Leave the cores to the writers now and then: a stale table is only interesting
      // once the sequence has moved on.
      if (rng_() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  struct Held {
    uint64_t id;
    BlockTable table;
    std::shared_ptr<const std::vector<uint16_t>> tags;
  };

  void ReadOnce() {
    // Half the reads use a table taken earlier (a slow worker): by now its sequence may
    // have been stepped, forked, released, reaped, and its blocks reused by others.
    if (!held_.empty() && rng_() % 2 == 0) {
      const size_t i = rng_() % held_.size();
      Read(held_[i].id, held_[i].table, held_[i].tags);
      if (rng_() % 8 == 0) held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
    uint64_t id = 0;
    std::shared_ptr<const std::vector<uint16_t>> tags;
    {
      kvmem::MutexLock lock(&model_->mu);
      if (model_->tags.empty()) return;
      auto it = model_->tags.begin();
      std::advance(it, rng_() % model_->tags.size());
      id = it->first;
    }
    absl::StatusOr<BlockTable> table = engine_->GetBlockTable(id);
    if (absl::IsNotFound(table.status())) {  // released or expired: ids are never reused
      kvmem::MutexLock lock(&model_->mu);
      model_->tags.erase(id);
      return;
    }
    if (!table.ok()) return;  // poisoned
    {
      kvmem::MutexLock lock(&model_->mu);
      auto it = model_->tags.find(id);
      if (it == model_->tags.end()) return;
      tags = it->second;  // a superset of the table's positions: tags never change
    }
    if (held_.size() < 16) held_.push_back({id, *table, tags});
    Read(id, *table, tags);
  }

  void Read(uint64_t id, const BlockTable& t,
            const std::shared_ptr<const std::vector<uint16_t>>& tags) {
    const BlockTable* table = &t;
    const uint32_t s = rng_() % kStreams;
    const StreamTable& st = table->streams[s];
    const BlockFormat format(table->layout, table->quantization == Precision::kLayout
                                                ? std::nullopt
                                                : std::optional(kernels::QuantType::kInt8));
    const uint64_t row = uint64_t{kD} * 2;
    std::vector<std::string> copies;
    const uint64_t w1 = engine_->epoch_board().Load(table->epoch_slot);
    if (w1 != 2 * table->epoch) {
      ++c_->refused;
      return;
    }
    for (const TableBlock& b : st.blocks) {
      std::string bytes(format.block_bytes(b.precision), '\0');
      RacyCopy(bytes.data(), pool_ + b.offset, bytes.size());
      copies.push_back(std::move(bytes));
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t w2 = engine_->epoch_board().Load(table->epoch_slot);
    if (w2 != w1) {
      ++c_->refused;
      return;
    }
    ++c_->accepted;
    // Accepted: every slot must be what the table says.
    size_t slot = 0;
    for (size_t i = 0; i < st.blocks.size(); ++i) {
      const TableBlock& b = st.blocks[i];
      std::string k(b.count * row, '\0'), v(b.count * row, '\0');
      if (b.precision == Precision::kLayout) {
        k.assign(copies[i].data() + b.start * row, b.count * row);
        v.assign(copies[i].data() + (uint64_t{kB} + b.start) * row, b.count * row);
      } else {
        kernels::DequantizeBlockRef(reinterpret_cast<const uint8_t*>(copies[i].data()),
                                    format.quant_geometry(), b.start, b.count,
                                    kernels::ElemType::kF16, k.data(), v.data());
      }
      for (uint32_t j = 0; j < b.count; ++j, ++slot) {
        const int64_t p = st.positions[slot];
        const uint16_t tag = (*tags)[p];
        for (uint32_t d = 0; d < kD; ++d) {
          for (int plane = 0; plane < 2; ++plane) {
            uint16_t h;
            std::memcpy(&h, (plane == 0 ? k : v).data() + (j * kD + d) * 2, 2);
            const float got = kernels::HalfToFloat(h);
            const float want =
                testing::ElementValue(s, p, d, static_cast<uint16_t>(2 * tag + plane));
            // int8: |x - x_hat| <= absmax / 254 plus f16 rounding (payload.h's range).
            const float bound = b.precision == Precision::kLayout ? 0.0f : 15.7f / 254 + 0.01f;
            if (!(std::fabs(got - want) <= bound)) {
              ++c_->wrong;
              ADD_FAILURE() << "sequence " << id << " stream " << s << " position " << p
                            << ": accepted " << got << ", the table says " << want;
              return;
            }
          }
        }
        ++c_->slots_checked;
      }
    }
  }

  Engine* engine_;
  Model* model_;
  const uint8_t* pool_;
  Counters* c_;
  std::mt19937 rng_;
  std::vector<Held> held_;
};

class Mutator {
 public:
  Mutator(Engine* engine, Model* model, FakeClock* clock, Counters* counters, uint32_t seed)
      : engine_(engine), model_(model), clock_(clock), c_(counters), rng_(seed) {}

  void Run(const std::atomic<bool>& stop) {
    while (!stop.load()) {
      if (owned_.size() < 3) Create();
      if (owned_.empty()) {  // every sequence slot is taken: wait for releases and expiries
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      const size_t pick = rng_() % owned_.size();
      const uint64_t id = owned_[pick];
      const uint32_t op = rng_() % 100;
      absl::Status s;
      if (op < 35) {
        s = Append(id, 1 + rng_() % 12);
      } else if (op < 65) {
        s = Step(id);
      } else if (op < 70) {
        s = Compress(id);
      } else if (op < 83) {
        s = Fork(id);  // beam search: forks that write, die, and fork again
      } else if (op < 96) {
        s = Release(pick);
      } else {
        Abandon(pick);  // stop renewing: the reaper takes it once the lease lapses
      }
      // NOT_FOUND: the reaper took it. RESOURCE_EXHAUSTED: the pool or the sequence
      // slots are full right now. Anything else is a bug.
      if (!s.ok() && !absl::IsNotFound(s) && !absl::IsResourceExhausted(s)) {
        ADD_FAILURE() << s;
      }
      if (absl::IsNotFound(s)) Forget(id);
    }
    for (uint64_t id : owned_) (void)engine_->Release(id);
  }

 private:
  void Create() {
    const bool quantize = rng_() % 2 == 0;
    QuantConfig quant;
    if (quantize) quant = {kernels::QuantType::kInt8, 8};
    const bool h2o = rng_() % 2 == 0;
    auto created =
        engine_->CreateSequence(StressLayout(), h2o ? "h2o" : "window",
                                h2o ? policy::ParamOverrides{{"budget", 24}, {"recent", 6}}
                                    : policy::ParamOverrides{{"window", 20}},
                                quant, absl::Seconds(2));
    if (!created.ok()) {
      if (!absl::IsResourceExhausted(created.status())) ADD_FAILURE() << created.status();
      return;
    }
    owned_.push_back(created->sequence_id);
    next_[created->sequence_id] = 0;
    Publish(created->sequence_id, std::make_shared<std::vector<uint16_t>>());
  }

  void Publish(uint64_t id, std::shared_ptr<const std::vector<uint16_t>> tags) {
    kvmem::MutexLock lock(&model_->mu);
    model_->tags[id] = std::move(tags);
  }
  void Forget(uint64_t id) {
    kvmem::MutexLock lock(&model_->mu);
    model_->tags.erase(id);
    owned_.erase(std::remove(owned_.begin(), owned_.end(), id), owned_.end());
    next_.erase(id);
  }
  std::shared_ptr<const std::vector<uint16_t>> Tags(uint64_t id) {
    kvmem::MutexLock lock(&model_->mu);
    auto it = model_->tags.find(id);
    return it == model_->tags.end() ? nullptr : it->second;
  }

  absl::Status Append(uint64_t id, uint32_t n) {
    const int64_t first = next_[id];
    const uint16_t tag = static_cast<uint16_t>(id % 97);
    const std::vector<int64_t> positions = testing::Range(first, n);
    const std::string k = testing::PayloadF16(kStreams, first, n, kD, 2 * tag);
    const std::string v = testing::PayloadF16(kStreams, first, n, kD, 2 * tag + 1);
    // Tags first (a superset is harmless), then the data.
    std::shared_ptr<const std::vector<uint16_t>> known = Tags(id);
    if (known == nullptr) return absl::NotFoundError("reaped (a reader saw it gone)");
    auto tags = std::make_shared<std::vector<uint16_t>>(*known);
    tags->resize(first + n, tag);
    Publish(id, tags);
    AppendChunk chunk{positions, {}, k, v, {}, {}};
    absl::StatusOr<AppendResult> r = engine_->Append(id, absl::MakeConstSpan(&chunk, 1));
    if (r.ok()) {
      next_[id] = first + n;
      ++c_->appends;
    }
    return r.status();
  }

  absl::Status Step(uint64_t id) {
    absl::StatusOr<BlockTable> table = engine_->GetBlockTable(id);
    if (!table.ok()) return table.status();
    std::vector<std::vector<float>> rows;
    StepInput in;
    in.epoch = table->epoch;
    for (const StreamTable& st : table->streams) {
      std::vector<float> row(st.positions.size());
      for (float& a : row) a = static_cast<float>(rng_() % 1000) / 1000.0f;
      rows.push_back(std::move(row));
    }
    for (size_t s = 0; s < rows.size(); ++s) {
      in.attention.push_back(
          {static_cast<uint32_t>(s / kH), static_cast<uint32_t>(s % kH), rows[s]});
    }
    absl::StatusOr<StepResult> r = engine_->Step(id, in);
    if (r.ok()) {
      ++c_->steps;
      c_->quantized += r->quantized_tokens;
    }
    if (absl::IsFailedPrecondition(r.status())) return absl::OkStatus();  // raced: fine
    return r.status();
  }

  absl::Status Compress(uint64_t id) {
    CompressInput in;
    absl::StatusOr<BlockTable> table = engine_->GetBlockTable(id);
    if (!table.ok()) return table.status();
    in.epoch = table->epoch;
    in.target_tokens = 4 + rng_() % 16;
    absl::StatusOr<CompressResult> r = engine_->Compress(id, in);
    if (r.ok()) ++c_->compresses;
    return r.status();
  }

  absl::Status Fork(uint64_t id) {
    std::shared_ptr<const std::vector<uint16_t>> tags = Tags(id);
    if (tags == nullptr) return absl::NotFoundError("reaped (a reader saw it gone)");
    absl::StatusOr<CreateResult> child = engine_->Fork(id, absl::Seconds(2));
    if (!child.ok()) return child.status();
    ++c_->forks;
    owned_.push_back(child->sequence_id);
    next_[child->sequence_id] = next_[id];
    Publish(child->sequence_id, tags);
    return absl::OkStatus();
  }

  absl::Status Release(size_t pick) {
    const uint64_t id = owned_[pick];
    absl::StatusOr<uint64_t> r = engine_->Release(id);
    Forget(id);
    if (r.ok()) ++c_->releases;
    return r.ok() || absl::IsNotFound(r.status()) ? absl::OkStatus() : r.status();
  }

  void Abandon(size_t pick) {
    // Nobody calls on it any more (fresh reads would renew its lease); readers that hold
    // its tables keep their tags and go on reading them as stale tables.
    const uint64_t id = owned_[pick];
    Forget(id);
    abandoned_.push_back(id);
    clock_->Advance(absl::Milliseconds(300));
  }

  Engine* engine_;
  Model* model_;
  FakeClock* clock_;
  Counters* c_;
  std::mt19937 rng_;
  std::vector<uint64_t> owned_, abandoned_;
  std::map<uint64_t, int64_t> next_;
};

TEST(EngineStressTest, ReadersNeverAcceptWrongKv) {
  const char* env = std::getenv("KVMEM_STRESS_SECONDS");
  const double seconds = env != nullptr ? std::atof(env) : 60.0;
  spdlog::set_level(spdlog::level::warn);  // a lease lapses thousands of times a second here
  FakeClock clock;
  EngineConfig config;
  config.pool_bytes = 4 << 20;
  config.page_bytes = 4096;
  config.max_sequences = 64;
  config.default_lease = absl::Seconds(2);
  auto backend = *store::CpuBackend::Create(config.pool_bytes);
  const auto exported = std::get<store::SharedMemoryExport>(*backend->pool_export());
  std::unique_ptr<Engine> engine = *Engine::Create(config, std::move(backend), &clock);
  // A mapping of its own, as a same-host reader's (the descriptor it would receive).
  void* mapped =
      mmap(nullptr, exported.bytes, PROT_READ, MAP_SHARED, exported.segment.lock()->fd(), 0);
  ASSERT_NE(mapped, MAP_FAILED);

  Model model;
  Counters counters;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < 2; ++i) {
    threads.emplace_back(
        [&, i] { Mutator(engine.get(), &model, &clock, &counters, 100 + i).Run(stop); });
  }
  for (uint32_t i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Reader(engine.get(), &model, static_cast<const uint8_t*>(mapped), &counters, 200 + i)
          .Run(stop);
    });
  }
  threads.emplace_back([&] {  // the lease reaper; time passes (abandoned leases lapse)
    while (!stop.load()) {
      clock.Advance(absl::Milliseconds(20));
      const uint32_t n = engine->ExpireLeases();
      counters.expired += n;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  stop = true;
  for (std::thread& t : threads) t.join();
  munmap(mapped, exported.bytes);

  std::printf(
      "stress: %.0f s: %lu accepted reads (%lu slots checked), %lu stale refusals, %lu wrong "
      "accepts; %lu appends, %lu steps (%lu tokens quantized), %lu compressions, %lu forks, "
      "%lu releases, %lu leases expired\n",
      seconds, counters.accepted.load(), counters.slots_checked.load(), counters.refused.load(),
      counters.wrong.load(), counters.appends.load(), counters.steps.load(),
      counters.quantized.load(), counters.compresses.load(), counters.forks.load(),
      counters.releases.load(), counters.expired.load());
  EXPECT_EQ(counters.wrong.load(), 0u);
  EXPECT_GT(counters.refused.load(), 0u) << "the readers never raced a writer";
  EXPECT_GT(counters.accepted.load(), 100u);
  EXPECT_GT(counters.forks.load(), 0u);
  EXPECT_GT(counters.quantized.load(), 0u);
  EXPECT_GT(counters.expired.load(), 0u);
  const EngineStats stats = engine->Stats(false);
  EXPECT_EQ(stats.pool.bad_unrefs, 0u);
  EXPECT_EQ(stats.sequences_poisoned, 0u);
  engine->ExpireLeases();
  clock.Advance(absl::Seconds(10));
  engine->ExpireLeases();
  EXPECT_EQ(engine->Stats(false).pool.blocks_used, 0u) << "blocks leaked";
}

}  // namespace
}  // namespace kvmem::engine
