// Per-step cost of confkv in the engine on the CPU backend (score update + selection +
// compaction, no RPC), at a steady state where every step appends one token per stream and
// evicts one, for the SmolLM2-135M shape and a Llama-3-8B shape; memcpy bandwidth measured
// in the same run puts the bytes each step touches in proportion. `host` rows run the
// policy's own Step on the host; the others the device step (scores in the backend's
// SlotState, the kernels' C++ twins on this backend); `cuda` rows the same on the CUDA
// backend (scores and selection in device memory), `cuda_host` rows the policy's host code on
// the CUDA backend; both skipped without a GPU.
// `BM_ConfKvPolicy` is the policy's part of such a step alone: the host SlotState's one pass
// per stream (EMA update, the pick of the slot to drop, the keep-set) and the compaction of
// its slot records, without the block plan, the K/V moves and the engine around them.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/engine/engine.h"
#include "server/store/backend_factory.h"
#include "server/store/slot_state.h"

namespace kvmem {
namespace {

struct Shape {
  uint32_t layers, heads, dim, budget;
};

void BM_ConfKvStep(benchmark::State& state, Shape shape, bool int8, bool device_step,
                   bool cuda = false) {
  engine::RealClock clock;
  engine::EngineConfig config;
  const uint64_t token_bytes = 2ull * shape.layers * shape.heads * shape.dim * 2;
  config.pool_bytes = (shape.budget + 512) * token_bytes * 2 + (64 << 20);
  config.page_bytes = 256 * 1024;
  config.device_step = device_step;
  absl::StatusOr<std::unique_ptr<store::Backend>> backend =
      store::MakeBackend(cuda ? "cuda" : "cpu", config.pool_bytes);
  if (!backend.ok()) {
    state.SkipWithError(backend.status().ToString().c_str());
    return;
  }
  auto engine = *engine::Engine::Create(config, *std::move(backend), &clock);
  const engine::Layout layout{shape.layers, shape.heads, shape.dim, engine::DType::kF16, 16, 49152};
  engine::QuantConfig quant;
  if (int8) quant.type = kernels::QuantType::kInt8;
  const double budget = shape.budget;
  const uint64_t id =
      engine
          ->CreateSequence(layout, "confkv", {{"c_high", budget / 2}, {"c_low", budget}}, quant,
                           absl::Hours(1))
          ->sequence_id;
  const uint32_t streams = shape.layers * shape.heads;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  auto append = [&](int64_t first, uint32_t n) {
    std::vector<int64_t> positions(n);
    for (uint32_t i = 0; i < n; ++i) positions[i] = first + i;
    std::string k(uint64_t{streams} * n * shape.dim * 2, '\0');
    for (char& c : k) c = static_cast<char>(byte(rng) & 0x3b);  // finite f16 values
    const engine::AppendChunk chunk{positions, {}, k, k, {}, {}};
    (void)engine->Append(id, absl::MakeConstSpan(&chunk, 1));
  };
  for (uint32_t first = 0; first < shape.budget; first += 64) append(first, 64);
  int64_t next = shape.budget;
  // Rows are regenerated outside the timed region; they only need the right lengths.
  std::vector<std::vector<float>> rows(streams);
  std::exponential_distribution<float> e(1.0f);
  uint64_t moved_before = engine->Stats(false).bytes_moved;
  for (auto _ : state) {
    state.PauseTiming();
    append(next++, 1);
    engine::StepInput input;
    input.epoch = engine->GetBlockTable(id)->epoch;
    input.logits = engine::RawLogitStats{9.0f, 0.2f, 0.1f, {}};  // low confidence: C_low
    for (uint32_t s = 0; s < streams; ++s) {
      rows[s].resize(shape.budget + 1);
      float sum = 0;
      for (float& a : rows[s]) sum += (a = e(rng));
      for (float& a : rows[s]) a /= sum;
      input.attention.push_back({s / shape.heads, s % shape.heads, rows[s]});
    }
    state.ResumeTiming();
    auto r = engine->Step(id, input);
    if (!r.ok() || r->evicted_tokens != streams) state.SkipWithError("unexpected step result");
  }
  const uint64_t moved = engine->Stats(false).bytes_moved - moved_before;
  // Bytes a step touches: per slot, the row (4), the score read+write (8), the position (8),
  // the priority (4) and the per-slot metadata compaction (2 x 28); plus K/V bytes moved.
  const double slots = static_cast<double>(streams) * (shape.budget + 1);
  const double touched = slots * (4 + 8 + 8 + 4 + 56) + double(moved) / state.iterations();
  state.counters["bytes_touched"] = touched;
  state.counters["kv_moved_per_step"] = double(moved) / state.iterations();
  state.SetBytesProcessed(static_cast<int64_t>(touched * state.iterations()));
}

BENCHMARK_CAPTURE(BM_ConfKvStep, smollm2_30x3x64_b256, Shape{30, 3, 64, 256}, false, true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, smollm2_30x3x64_b256_host, Shape{30, 3, 64, 256}, false, false)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, smollm2_30x3x64_b256_int8, Shape{30, 3, 64, 256}, true, true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, llama8b_32x8x128_b4096, Shape{32, 8, 128, 4096}, false, true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, llama8b_32x8x128_b4096_host, Shape{32, 8, 128, 4096}, false, false)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, smollm2_30x3x64_b256_cuda, Shape{30, 3, 64, 256}, false, true,
                  true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, llama8b_32x8x128_b4096_cuda, Shape{32, 8, 128, 4096}, false, true,
                  true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
// The CUDA backend with the policy's host code (kvmemd --backend=cuda --device_step=off):
// scores on the host, the K/V moves by the copy kernels.
BENCHMARK_CAPTURE(BM_ConfKvStep, smollm2_30x3x64_b256_cuda_host, Shape{30, 3, 64, 256}, false,
                  false, true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ConfKvStep, llama8b_32x8x128_b4096_cuda_host, Shape{32, 8, 128, 4096}, false,
                  false, true)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);

void BM_ConfKvPolicy(benchmark::State& state, Shape shape) {
  const uint32_t streams = shape.layers * shape.heads;
  std::unique_ptr<store::SlotState> slots = store::MakeHostSlotState(streams);
  std::vector<int64_t> positions(shape.budget);
  for (uint32_t i = 0; i < shape.budget; ++i) positions[i] = i;
  if (absl::Status s = slots->Append(positions, std::nanf("")); !s.ok()) {
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  // confkv's plan at low confidence (PlanKernelStep): budget C_low in every stream.
  const kernels::ScoreStep op{kernels::ScoreRule::kEma, 0.9f, 0.65f, true, true};
  const std::vector<uint32_t> budget(streams, shape.budget);
  std::mt19937 rng(1);
  std::exponential_distribution<float> e(1.0f);
  std::vector<std::vector<float>> rows(streams, std::vector<float>(shape.budget + 1));
  std::vector<absl::Span<const float>> views(streams);
  int64_t next = shape.budget;
  for (auto _ : state) {
    state.PauseTiming();
    const int64_t p = next++;
    absl::Status appended = slots->Append(absl::MakeConstSpan(&p, 1), std::nanf(""));
    for (uint32_t s = 0; s < streams; ++s) {
      float sum = 0;
      for (float& a : rows[s]) sum += (a = e(rng));
      for (float& a : rows[s]) a /= sum;
      views[s] = rows[s];
    }
    state.ResumeTiming();
    store::KeepSets keep;
    absl::Status stepped = slots->Step(op, views, budget, 32, &keep);
    if (stepped.ok()) stepped = slots->CommitStep();
    if (!appended.ok() || !stepped.ok() || !keep[0] || keep[0]->size() != shape.budget) {
      state.SkipWithError("unexpected step result");
      break;
    }
  }
}
BENCHMARK_CAPTURE(BM_ConfKvPolicy, smollm2_30x3x64_b256, Shape{30, 3, 64, 256})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0);

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = 64 << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes * 2));  // read + write
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMicrosecond)->MinTime(1.0);

}  // namespace
}  // namespace kvmem

int main(int argc, char** argv) {
  // As kvmemd runs (server/main.cc): without abseil's lock-order graph, which Debian's build
  // keeps on and which costs every lock a graph lookup.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
