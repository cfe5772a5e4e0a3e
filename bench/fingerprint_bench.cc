// The request fingerprint (a hash of the whole deterministic serialization) of a decode
// step's batch on SmolLM2's shape: per sequence 90 streams, one token's f32 K/V and, for
// confkv, an f16 attention row of 257 slots per stream; 1 and 64 sequences. "cold":
// 64 MiB read before each call (timing paused), about what the model's forward pass reads
// between two steps, so the message is out of the cores' caches as kvmemd finds it. Also the
// parse's count before it is parsed (ParseCost) next to the parse.
#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/service/request_cache.h"
#include "server/transport/parse_cost.h"

namespace {

constexpr int kStreams = 90, kHeadDim = 64, kRowSlots = 257;

void AddEntry(kvmem::v1::StepBatchRequest* batch, uint64_t sequence_id) {
  kvmem::v1::StepBatchEntry* e = batch->add_entries();
  e->set_sequence_id(sequence_id);
  kvmem::v1::NewTokens* t = e->mutable_append();
  t->add_positions(8000);
  t->add_token_ids(42);
  t->set_k(std::string(kStreams * kHeadDim * sizeof(float), '\x11'));
  t->set_v(std::string(kStreams * kHeadDim * sizeof(float), '\x22'));
  kvmem::v1::StepSignals* s = e->mutable_step();
  s->set_epoch(3);
  s->mutable_logit_stats()->set_entropy(1.5f);
  s->mutable_logit_stats()->set_p1(0.5f);
  s->mutable_logit_stats()->set_p2(0.25f);
  for (int i = 0; i < kStreams; ++i) {
    kvmem::v1::AttentionRow* row = s->add_attention();
    row->set_layer(i / 3);
    row->set_kv_head(i % 3);
    row->set_weights_f16(std::string(kRowSlots * 2, '\x33'));
  }
  e->mutable_client_table()->set_version(77);
}

kvmem::v1::StepBatchRequest ConfkvBatch(int sequences) {
  kvmem::v1::StepBatchRequest batch;
  for (int i = 0; i < sequences; ++i) AddEntry(&batch, i + 1);
  batch.set_request_id("bench");
  return batch;
}

void BM_Fingerprint(benchmark::State& state) {
  const kvmem::v1::StepBatchRequest batch = ConfkvBatch(static_cast<int>(state.range(0)));
  const bool cold = state.range(1) != 0;
  const std::vector<uint64_t> sweep(cold ? (size_t{64} << 20) / sizeof(uint64_t) : 0, 1);
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      uint64_t sum = 0;
      for (uint64_t word : sweep) sum += word;
      benchmark::DoNotOptimize(sum);
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(kvmem::service::RequestFingerprint(batch));
  }
}

// Warm rows by time, cold ones by a fixed count (each cold call reads 64 MiB first).
BENCHMARK(BM_Fingerprint)
    ->ArgNames({"sequences", "cold"})
    ->Args({1, 0})
    ->Args({64, 0})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Fingerprint)
    ->ArgNames({"sequences", "cold"})
    ->Args({1, 1})
    ->Args({64, 1})
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);

// What counting a request's parse before it is parsed costs (transport::ParseCost over its
// wire form) next to the parse itself, on the same batch.
void BM_ParseCost(benchmark::State& state) {
  const std::string wire = ConfkvBatch(static_cast<int>(state.range(0))).SerializeAsString();
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        kvmem::transport::ParseCost(kvmem::v1::StepBatchRequest::descriptor(), wire));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * wire.size()));
}
BENCHMARK(BM_ParseCost)->ArgName("sequences")->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond);

void BM_Parse(benchmark::State& state) {
  const std::string wire = ConfkvBatch(static_cast<int>(state.range(0))).SerializeAsString();
  for (auto _ : state) {
    kvmem::v1::StepBatchRequest parsed;
    benchmark::DoNotOptimize(parsed.ParseFromString(wire));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * wire.size()));
}
BENCHMARK(BM_Parse)->ArgName("sequences")->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
