// The request fingerprint of one decode step's batch (RequestFingerprint, which takes a
// StepBatchRequest's from its generated accessors) against the reflection walk that every
// other message gets (ReflectedFingerprint), on SmolLM2's shape: one sequence, 90 streams,
// one token's f32 K/V and, for confkv, an f16 attention row of 257 slots per stream. "cold":
// 64 MiB read before each call (timing paused), about what the model's forward pass reads
// between two steps, so the message is out of the cores' caches as kvmemd finds it.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/service/request_cache.h"

namespace {

constexpr int kStreams = 90, kHeadDim = 64, kRowSlots = 257;

kvmem::v1::StepBatchRequest ConfkvBatch() {
  kvmem::v1::StepBatchRequest batch;
  kvmem::v1::StepBatchEntry* e = batch.add_entries();
  e->set_sequence_id(1);
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
  batch.set_request_id("bench");
  return batch;
}

using Fingerprint = uint64_t (*)(const google::protobuf::Message&);

void BM_Fingerprint(benchmark::State& state, Fingerprint fingerprint) {
  const bool cold = state.range(0) != 0;
  const kvmem::v1::StepBatchRequest batch = ConfkvBatch();
  const std::vector<uint64_t> sweep(cold ? (size_t{64} << 20) / sizeof(uint64_t) : 0, 1);
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      uint64_t sum = 0;
      for (uint64_t word : sweep) sum += word;
      benchmark::DoNotOptimize(sum);
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(fingerprint(batch));
  }
}

// Warm rows by time, cold ones by a fixed count (each cold call reads 64 MiB first).
const bool kRegistered = [] {
  const std::pair<const char*, Fingerprint> walks[] = {
      {"BM_Fingerprint/generated", kvmem::service::RequestFingerprint},
      {"BM_Fingerprint/reflection", kvmem::service::ReflectedFingerprint}};
  for (const auto& [name, fingerprint] : walks) {
    benchmark::RegisterBenchmark(name, BM_Fingerprint, fingerprint)
        ->ArgName("cold")
        ->Arg(0)
        ->Unit(benchmark::kMicrosecond);
  }
  for (const auto& [name, fingerprint] : walks) {
    benchmark::RegisterBenchmark(name, BM_Fingerprint, fingerprint)
        ->ArgName("cold")
        ->Arg(1)
        ->Iterations(200)
        ->Unit(benchmark::kMicrosecond);
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
