// Append throughput (1 MiB of K+V per call) and the Step round trip through kvmemd over
// gRPC on loopback, side by side with a raw gRPC service carrying the same payloads in the
// same process: the limit this path can reach. bench/grpc_path.py turns the run into ratios.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include "echo.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/client.h"
#include "server/service/server.h"

namespace {

// 4 layers x 2 KV heads x head_dim 64, f16: 2 KiB of K+V per token; 512 tokens = 1 MiB.
constexpr uint32_t kL = 4, kH = 2, kD = 64;
constexpr uint32_t kTokensPerMiB = (1u << 20) / (kL * kH * kD * 2 * 2);

class EchoService final : public kvmem::bench::Echo::Service {
  grpc::Status Sink(grpc::ServerContext*, const kvmem::bench::Payload* request,
                    kvmem::bench::Ack* reply) override {
    reply->set_bytes(request->data().size());
    return grpc::Status::OK;
  }
};

struct Fixture {
  Fixture() {
    kvmem::service::ServerConfig config;
    config.listen = "127.0.0.1:0";
    config.engine.pool_bytes = 512ull << 20;
    server = *kvmem::service::Server::Start(config);
    client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(server->port()));

    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&echo_service);
    builder.SetMaxReceiveMessageSize(64 << 20);
    echo_server = builder.BuildAndStart();
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    echo = kvmem::bench::Echo::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
  }
  std::unique_ptr<kvmem::service::Server> server;
  std::unique_ptr<kvmem::client::Client> client;
  EchoService echo_service;
  std::unique_ptr<grpc::Server> echo_server;
  std::unique_ptr<kvmem::bench::Echo::Stub> echo;
};

Fixture& Shared() {
  static Fixture* f = new Fixture();
  return *f;
}

const kvmem::client::Layout kLayout{kL, kH, kD, kvmem::client::DType::kF16, 16, 32000};

void BM_Append1MiB(benchmark::State& state) {
  Fixture& f = Shared();
  const std::string k(kTokensPerMiB * kL * kH * kD * 2, '\x11');
  const std::string v = k;
  std::vector<int64_t> positions(kTokensPerMiB);
  uint64_t id = f.client->CreateSequence(kLayout, {"full", {}})->id;
  int64_t next = 0;
  for (auto _ : state) {
    for (auto& p : positions) p = next++;
    auto r = f.client->Append(id, {positions, {}, k, v, {}, {}});
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
    if (next >= 64 * kTokensPerMiB) {  // keep the pool from filling: start a new sequence
      state.PauseTiming();
      (void)f.client->Release(id);
      id = f.client->CreateSequence(kLayout, {"full", {}})->id;
      next = 0;
      state.ResumeTiming();
    }
  }
  (void)f.client->Release(id);
  state.SetBytesProcessed(state.iterations() * int64_t{2} * static_cast<int64_t>(k.size()));
}
BENCHMARK(BM_Append1MiB)->UseRealTime()->MinTime(2.0);

void BM_RawGrpc1MiB(benchmark::State& state) {
  Fixture& f = Shared();
  kvmem::bench::Payload payload;
  payload.set_data(std::string(1u << 20, '\x11'));
  for (auto _ : state) {
    grpc::ClientContext context;
    kvmem::bench::Ack ack;
    grpc::Status s = f.echo->Sink(&context, payload, &ack);
    if (!s.ok()) state.SkipWithError(s.error_message().c_str());
  }
  state.SetBytesProcessed(state.iterations() * int64_t{1} << 20);
}
BENCHMARK(BM_RawGrpc1MiB)->UseRealTime()->MinTime(2.0);

// One decode step of a `window` sequence at its steady state: one token appended and one
// evicted per stream, so the daemon compacts every step.
void BM_StepRoundTrip(benchmark::State& state) {
  Fixture& f = Shared();
  uint64_t id = f.client->CreateSequence(kLayout, {"window", {{"window", 512}}})->id;
  const std::string kv(kL * kH * kD * 2, '\x22');
  std::vector<int64_t> prefill(512);
  for (int i = 0; i < 512; ++i) prefill[i] = i;
  const std::string big(512 * kv.size(), '\x22');
  (void)f.client->Append(id, {prefill, {}, big, big, {}, {}});
  int64_t next = 512;
  for (auto _ : state) {
    state.PauseTiming();
    const int64_t pos = next++;
    (void)f.client->Append(id, {absl::MakeConstSpan(&pos, 1), {}, kv, kv, {}, {}});
    state.ResumeTiming();
    auto r = f.client->Step(id, {});
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
  }
  (void)f.client->Release(id);
}
BENCHMARK(BM_StepRoundTrip)->UseRealTime()->MinTime(2.0);

void BM_RawGrpcEmpty(benchmark::State& state) {
  Fixture& f = Shared();
  kvmem::bench::Payload payload;
  for (auto _ : state) {
    grpc::ClientContext context;
    kvmem::bench::Ack ack;
    grpc::Status s = f.echo->Sink(&context, payload, &ack);
    if (!s.ok()) state.SkipWithError(s.error_message().c_str());
  }
}
BENCHMARK(BM_RawGrpcEmpty)->UseRealTime()->MinTime(2.0);

}  // namespace

BENCHMARK_MAIN();
