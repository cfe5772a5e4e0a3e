// kvmemd's gRPC path next to a raw gRPC service carrying the same bytes, in one process and
// one run, so that the ratios compare figures taken under the same load:
// - Append of 1 MiB of K+V per call (4 layers x 2 KV heads x 64, f16);
// - the decode loop at SmolLM2-135M's shape: one StepBatch of 1 and of 64 sequences (one new
//   token each, append folded in) under `window` and `confkv` at their steady state (every
//   step evicts one token per stream), block tables kept current from the daemon's deltas;
//   the 64-sequence batch against kvmemd with parallel batches off and on;
// - the single-sequence Step round trip over TCP and over a unix socket;
// - one sequence's decode step at 8k context under `full`, `window` and `confkv` through the
//   step channel (the eval speed study's daemon share, without the model).
// Each kvmemd call has a raw twin (BM_Raw*) whose request and response serialize to the
// bytes the kvmemd call sent and received, as a client interceptor measured them.
// bench/grpc_path.py runs this once and prints the ratios.
//
// kvmemd runs in this process, but every call crosses a real socket (a gRPC channel to
// "127.0.0.1:port" or "unix:path" takes no in-process shortcut): the transports differ as
// they would between processes, and client and daemon share the machine's cores either way.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "echo.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_interceptor.h"
#include "kvmem/client.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/service/server.h"

namespace {

using kvmem::client::BatchEntry;
using kvmem::client::BlockTable;
using kvmem::client::Client;

// --- The bytes a call carries -------------------------------------------------------------

struct WireBytes {
  int64_t request = 0, response = 0;  // serialized message sizes
};

// Measures the serialized request and response of Step and StepBatch calls while
// `recording`. Registered for the whole process (gRPC has no per-channel hook into a
// channel the kvmem client builds), so kvmemd's calls and the raw ones both pay for it.
class WireProbe final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  std::atomic<bool> recording{false};
  std::atomic<int64_t> request{0}, response{0};

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new Interceptor(this, info->method());
  }

 private:
  class Interceptor final : public grpc::experimental::Interceptor {
   public:
    Interceptor(WireProbe* probe, std::string_view method) : probe_(probe), method_(method) {}
    void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
      if (probe_->recording.load(std::memory_order_relaxed)) {
        if (method_ == "/kvmem.v1.KvCache/StepBatch") {
          Record<kvmem::v1::StepBatchRequest, kvmem::v1::StepBatchResponse>(m);
        } else if (method_ == "/kvmem.v1.KvCache/Step") {
          Record<kvmem::v1::StepRequest, kvmem::v1::StepResponse>(m);
        }
      }
      m->Proceed();
    }

   private:
    // gRPC hands the messages over untyped; the method name says what they are.
    template <typename Request, typename Response>
    void Record(grpc::experimental::InterceptorBatchMethods* m) {
      using grpc::experimental::InterceptionHookPoints;
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        const auto* q = static_cast<const Request*>(m->GetSendMessage());
        probe_->request = static_cast<int64_t>(q->ByteSizeLong());
      }
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
        const auto* r = static_cast<const Response*>(m->GetRecvMessage());
        probe_->response = static_cast<int64_t>(r->ByteSizeLong());
      }
    }
    WireProbe* probe_;
    std::string_view method_;  // gRPC's string, alive for the call
  };
};

WireProbe& Probe() {
  static WireProbe* probe = new WireProbe();
  return *probe;
}

// Pads `message` (its `data` field) so that it serializes to `total` bytes, or one less where
// the length prefix would grow at exactly that size.
template <typename Message>
void PadTo(int64_t total, Message* message) {
  message->clear_data();
  const int64_t n = total - static_cast<int64_t>(message->ByteSizeLong()) - 2;  // tag + length
  if (n <= 0) return;
  message->mutable_data()->assign(static_cast<size_t>(n), '\x5a');
  while (static_cast<int64_t>(message->ByteSizeLong()) > total) message->mutable_data()->pop_back();
}

class EchoService final : public kvmem::bench::Echo::Service {
  grpc::Status Sink(grpc::ServerContext*, const kvmem::bench::Payload* request,
                    kvmem::bench::Ack* reply) override {
    reply->set_bytes(request->data().size());
    if (request->reply_bytes() > 0) PadTo(static_cast<int64_t>(request->reply_bytes()), reply);
    return grpc::Status::OK;
  }
};

// --- The daemons ----------------------------------------------------------------------------

// kUnixChannel: a daemon on a unix socket whose client sends StepBatch through a step
// channel (shared memory) instead of gRPC.
enum class Daemon { kTcp, kTcpSerialBatches, kUnix, kUnixChannel };
enum class Transport { kTcp, kUnix };

std::string SocketPath(const char* what) {
  return absl::StrCat("/tmp/kvmem-grpc-path-", what, "-", static_cast<int64_t>(getpid()), ".sock");
}

struct Fixture {
  Fixture() {
    daemons[static_cast<int>(Daemon::kTcp)] = StartDaemon("127.0.0.1:0", true);
    daemons[static_cast<int>(Daemon::kTcpSerialBatches)] = StartDaemon("127.0.0.1:0", false);
    std::remove(SocketPath("kvmemd").c_str());
    daemons[static_cast<int>(Daemon::kUnix)] = StartDaemon("unix:" + SocketPath("kvmemd"), true);
    std::remove(SocketPath("kvmemd-channel").c_str());
    daemons[static_cast<int>(Daemon::kUnixChannel)] =
        StartDaemon("unix:" + SocketPath("kvmemd-channel"), true);
    if (absl::Status s = client(Daemon::kUnixChannel).OpenStepChannel(); !s.ok()) {
      std::fprintf(stderr, "step channel: %s\n", s.ToString().c_str());
      std::abort();
    }

    std::remove(SocketPath("echo").c_str());
    std::remove(SocketPath("kvmemd-channel").c_str());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.AddListeningPort("unix:" + SocketPath("echo"), grpc::InsecureServerCredentials());
    builder.RegisterService(&echo_service);
    builder.SetMaxReceiveMessageSize(64 << 20);
    echo_server = builder.BuildAndStart();
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    echo[static_cast<int>(Transport::kTcp)] = kvmem::bench::Echo::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
    echo[static_cast<int>(Transport::kUnix)] =
        kvmem::bench::Echo::NewStub(grpc::CreateCustomChannel(
            "unix:" + SocketPath("echo"), grpc::InsecureChannelCredentials(), args));
  }

  struct Running {
    std::unique_ptr<kvmem::service::Server> server;
    std::unique_ptr<Client> client;
  };
  static Running StartDaemon(const std::string& listen, bool parallel_batches) {
    kvmem::service::ServerConfig config;
    config.listen = listen;
    config.engine.pool_bytes = 1ull << 30;  // pages are touched only when used
    config.engine.parallel_batches = parallel_batches;
    Running d;
    d.server = *kvmem::service::Server::Start(config);
    const bool unix_socket = listen.rfind("unix:", 0) == 0;
    d.client =
        *Client::Connect(unix_socket ? listen : "127.0.0.1:" + std::to_string(d.server->port()));
    return d;
  }

  Client& client(Daemon d) { return *daemons[static_cast<int>(d)].client; }
  kvmem::bench::Echo::Stub& raw(Transport t) { return *echo[static_cast<int>(t)]; }

  Running daemons[4];
  EchoService echo_service;
  std::unique_ptr<grpc::Server> echo_server;
  std::unique_ptr<kvmem::bench::Echo::Stub> echo[2];
};

Fixture* g_fixture = nullptr;

Fixture& Shared() {
  if (g_fixture == nullptr) g_fixture = new Fixture();
  return *g_fixture;
}

// The daemons and their clients end before the process does (4 GiB of pools).
void StopShared() {
  if (g_fixture == nullptr) return;
  for (auto& d : g_fixture->daemons) {
    d.client.reset();
    d.server.reset();
  }
  g_fixture->echo_server->Shutdown();
}

// One raw call carrying `payload` (its reply_bytes set for the answer's size).
void RawCall(benchmark::State& state, kvmem::bench::Echo::Stub& stub,
             const kvmem::bench::Payload& payload) {
  grpc::ClientContext context;
  kvmem::bench::Ack ack;
  grpc::Status s = stub.Sink(&context, payload, &ack);
  if (!s.ok()) state.SkipWithError(s.error_message().c_str());
}

// Wall time per call, and the whole process's CPU time (client, daemon and echo threads):
// on a shared machine the wall time includes waiting for a core, the CPU time does not.
void Timed(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->MeasureProcessCPUTime()->MinTime(2.0);
}

// --- Append of 1 MiB ------------------------------------------------------------------------

// 4 layers x 2 KV heads x head_dim 64, f16: 2 KiB of K+V per token; 512 tokens = 1 MiB.
constexpr uint32_t kL = 4, kH = 2, kD = 64;
constexpr uint32_t kTokensPerMiB = (1u << 20) / (kL * kH * kD * 2 * 2);
const kvmem::client::Layout kSmallLayout{kL, kH, kD, kvmem::client::DType::kF16, 16, 32000};

void BM_Append1MiB(benchmark::State& state) {
  Client& client = Shared().client(Daemon::kTcp);
  const std::string kv(kTokensPerMiB * kL * kH * kD * 2, '\x11');  // K, and V the same
  std::vector<int64_t> positions(kTokensPerMiB);
  uint64_t id = client.CreateSequence(kSmallLayout, {"full", {}})->id;
  int64_t next = 0;
  for (auto _ : state) {
    for (auto& p : positions) p = next++;
    auto r = client.Append(id, {positions, {}, kv, kv, {}, {}});
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
    if (next >= 64 * kTokensPerMiB) {  // keep the pool from filling: start a new sequence
      state.PauseTiming();
      (void)client.Release(id);
      id = client.CreateSequence(kSmallLayout, {"full", {}})->id;
      next = 0;
      state.ResumeTiming();
    }
  }
  (void)client.Release(id);
  state.SetBytesProcessed(state.iterations() * int64_t{2} * static_cast<int64_t>(kv.size()));
}
BENCHMARK(BM_Append1MiB)->Apply(Timed);

void BM_RawGrpc1MiB(benchmark::State& state) {
  kvmem::bench::Echo::Stub& stub = Shared().raw(Transport::kTcp);
  kvmem::bench::Payload payload;
  payload.set_data(std::string(1u << 20, '\x11'));
  for (auto _ : state) RawCall(state, stub, payload);
  state.SetBytesProcessed(state.iterations() * int64_t{1} << 20);
}
BENCHMARK(BM_RawGrpc1MiB)->Apply(Timed);

// --- The decode loop at SmolLM2-135M's shape -------------------------------------------------

// 30 layers x 3 KV heads x head_dim 64, f16, 16-token blocks: 11.25 KiB of K (and of V) per
// token, 90 streams.
const kvmem::client::Layout kSmolLm2{30, 3, 64, kvmem::client::DType::kF16, 16, 49152};
constexpr uint32_t kStreams = 30 * 3;
constexpr int64_t kContextTokens = 320;  // before the first step; both policies keep 256
constexpr int kWarmupSteps = 3;          // the first evicts 64 per stream, then 1 per step
// The long-context rows: the eval speed study's 8k prompt and policies (window 512, confkv's
// defaults), one sequence, a fixed number of steps (`full` grows by one token per step).
constexpr int64_t kLongContextTokens = 8000;
constexpr int64_t kLongContextSteps = 256;
constexpr int64_t kPrefillChunk = 500;  // tokens per prefill Append (11 MiB at this shape)
// About what SmolLM2-135M's forward pass reads per token (its Q4_1 weights); far more than
// a core's L2, less than some machines' last-level cache.
constexpr size_t kColdSweepBytes = size_t{64} << 20;

enum class PolicyKind { kWindow, kConfKv, kFull };

// How each step reaches the daemon: one StepBatch for all sequences (the new token folded
// in), or, for one sequence, an Append and then a Step (only the Step is timed).
enum class Calls { kStepBatch, kAppendThenStep };

struct Scenario {
  PolicyKind policy;
  int sequences;
  Calls calls;
  // The calls name the client's BlockTable and apply the daemon's delta to it. Without,
  // the step's answer carries no table (a worker that reads no table, or the step's own
  // cost without the delta); the untimed Append of kAppendThenStep still fetches it.
  bool tables = true;
  int64_t context = kContextTokens;  // tokens before the first step
  // Before each step (timing paused) the process reads a 64 MiB buffer, as a worker's forward
  // pass reads its weights between two steps: the step finds its state out of the cores'
  // caches.
  bool cold = false;

  bool long_context() const { return context != kContextTokens; }
  std::string Key() const {
    return absl::StrCat(static_cast<int>(policy), "/", sequences, "/", static_cast<int>(calls), "/",
                        tables, "/", context);
  }
  kvmem::client::PolicySpec Spec() const {
    switch (policy) {
      case PolicyKind::kWindow:
        return {"window", {{"window", long_context() ? 512 : 256}}};
      case PolicyKind::kConfKv:
        if (long_context()) return {"confkv", {}};
        return {"confkv", {{"c_high", 256}, {"c_low", 512}}};
      case PolicyKind::kFull:
        return {"full", {}};
    }
    return {};
  }
};

// Sequences decoding in lockstep at their steady state, each with its BlockTable kept
// current from the daemon's table deltas (positions not asked for). confkv's signals are
// what a worker sends: logit statistics of a confident step (budget c_high) and one
// attention row per stream over the retained slots and the new token, as f16.
class DecodingSequences {
 public:
  static absl::StatusOr<std::unique_ptr<DecodingSequences>> Start(Client& client,
                                                                  const Scenario& scenario) {
    auto d = std::unique_ptr<DecodingSequences>(new DecodingSequences(client, scenario));
    if (absl::Status s = d->Prefill(); !s.ok()) return s;
    // A step channel's batches cross no gRPC call: nothing recorded stays zero.
    Probe().request = 0;
    Probe().response = 0;
    for (int i = 0; i < kWarmupSteps; ++i) {
      Probe().recording = i == kWarmupSteps - 1;  // the steady state's sizes
      absl::Status s = d->StepOnce();
      Probe().recording = false;
      if (!s.ok()) return s;
    }
    d->wire_ = {Probe().request.load(), Probe().response.load()};
    d->evicted_ = 0;
    return d;
  }

  ~DecodingSequences() {
    for (const Decoding& s : sequences_) (void)client_.Release(s.table.sequence_id);
  }

  // One decode step of every sequence. With Calls::kAppendThenStep the Append runs with the
  // benchmark's timing paused.
  absl::Status StepOnce(benchmark::State* state = nullptr) {
    if (scenario_.calls == Calls::kAppendThenStep) return AppendThenStep(state);
    for (size_t i = 0; i < sequences_.size(); ++i) {
      sequences_[i].position = sequences_[i].next_position++;
      FitSignals(i, 1);
    }
    auto results = client_.StepBatch(entries_);
    if (!results.ok()) return results.status();
    for (const kvmem::client::BatchResult& r : *results) {
      if (!r.status.ok()) return r.status;
      evicted_ += r.step->evicted_tokens;
    }
    return absl::OkStatus();
  }

  int count() const { return static_cast<int>(sequences_.size()); }
  WireBytes wire() const { return wire_; }
  uint64_t evicted() const { return evicted_; }  // since the warm-up

 private:
  struct Decoding {
    BlockTable table;
    int64_t next_position = 0;
    int64_t position = 0;  // the token being appended (its AppendArgs::positions points here)
  };

  DecodingSequences(Client& client, const Scenario& scenario)
      : client_(client),
        scenario_(scenario),
        kv_(size_t{kStreams} * kSmolLm2.head_dim * 2, '\x22') {}

  absl::Status Prefill() {
    sequences_.resize(scenario_.sequences);  // never resized again: entries_ point into it
    const int64_t chunk = std::min(scenario_.context, kPrefillChunk);
    std::vector<int64_t> positions(chunk);
    const std::string prompt(chunk * kv_.size(), '\x22');
    for (Decoding& s : sequences_) {
      auto created = client_.CreateSequence(kSmolLm2, scenario_.Spec(), absl::Hours(1));
      if (!created.ok()) return created.status();
      s.table.sequence_id = created->id;
      for (int64_t at = 0; at < scenario_.context; at += chunk) {
        const int64_t n = std::min(chunk, scenario_.context - at);
        for (int64_t i = 0; i < n; ++i) positions[i] = at + i;
        const std::string_view kv(prompt.data(), n * kv_.size());
        auto appended = client_.Append(
            created->id, {absl::MakeConstSpan(positions.data(), n), {}, kv, kv, {}, {}}, &s.table);
        if (!appended.ok()) return appended.status();
      }
      s.next_position = scenario_.context;
      BatchEntry entry;
      entry.sequence_id = created->id;
      entry.append =
          kvmem::client::AppendArgs{absl::MakeConstSpan(&s.position, 1), {}, kv_, kv_, {}, {}};
      entry.step.emplace();
      if (scenario_.policy == PolicyKind::kConfKv) {
        entry.step->logit_stats = kvmem::client::LogitStats{0.5f, 0.9f, 0.05f, {}};
        entry.step->attention_f16 = true;
      }
      entry.table = scenario_.tables ? &s.table : nullptr;
      entries_.push_back(std::move(entry));
    }
    return absl::OkStatus();
  }

  // Sets sequence i's step to its table's epoch and sizes confkv's rows to the retained
  // slots plus `new_tokens` (uniform weights; rebuilt only when a size changes).
  void FitSignals(size_t i, uint32_t new_tokens) {
    const BlockTable& table = sequences_[i].table;
    kvmem::client::StepArgs& step = *entries_[i].step;
    step.epoch = table.epoch;
    if (scenario_.policy != PolicyKind::kConfKv) return;
    step.attention.resize(table.streams.size());
    for (size_t r = 0; r < table.streams.size(); ++r) {
      const kvmem::client::StreamTable& st = table.streams[r];
      size_t slots = new_tokens;
      for (const kvmem::client::TableBlock& b : st.blocks) slots += b.count;
      kvmem::client::StreamSignal& row = step.attention[r];
      row.layer = st.layer;
      row.kv_head = st.kv_head;
      if (row.values.size() != slots) row.values.assign(slots, 1.0f / slots);
    }
  }

  absl::Status AppendThenStep(benchmark::State* state) {
    for (size_t i = 0; i < sequences_.size(); ++i) {
      Decoding& s = sequences_[i];
      if (state != nullptr) state->PauseTiming();
      s.position = s.next_position++;
      auto appended = client_.Append(s.table.sequence_id, *entries_[i].append, &s.table);
      if (state != nullptr) state->ResumeTiming();
      if (!appended.ok()) return appended.status();
      FitSignals(i, 0);
      auto stepped = client_.Step(s.table.sequence_id, *entries_[i].step, entries_[i].table);
      if (!stepped.ok()) return stepped.status();
      evicted_ += stepped->evicted_tokens;
    }
    return absl::OkStatus();
  }

  Client& client_;
  const Scenario scenario_;
  const std::string kv_;  // one token's K (and V): [L][H][1][D]
  std::vector<Decoding> sequences_;
  std::vector<BatchEntry> entries_;  // the StepBatch, one entry per sequence, reused
  WireBytes wire_;
  uint64_t evicted_ = 0;
};

// The bytes of a scenario's steady-state call, measured once (by whichever benchmark of the
// pair runs first).
std::map<std::string, WireBytes>& MeasuredWire() {
  static auto* measured = new std::map<std::string, WireBytes>();
  return *measured;
}

void BM_Decode(benchmark::State& state, Scenario scenario, Daemon daemon) {
  auto d = DecodingSequences::Start(Shared().client(daemon), scenario);
  if (!d.ok()) {
    state.SkipWithError(std::string(d.status().message()).c_str());
    return;
  }
  // A step channel's batches cross no gRPC call: its rows report the gRPC rows' sizes.
  WireBytes wire = (*d)->wire();
  if (wire.request > 0) MeasuredWire()[scenario.Key()] = wire;
  if (wire.request == 0 && MeasuredWire().count(scenario.Key()) > 0) {
    wire = MeasuredWire()[scenario.Key()];
  }
  const std::vector<uint64_t> sweep(scenario.cold ? kColdSweepBytes / sizeof(uint64_t) : 0, 1);
  for (auto _ : state) {
    if (scenario.cold) {
      state.PauseTiming();
      uint64_t sum = 0;
      for (uint64_t word : sweep) sum += word;
      benchmark::DoNotOptimize(sum);
      state.ResumeTiming();
    }
    if (absl::Status s = (*d)->StepOnce(&state); !s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
  }
  state.counters["seqs"] = (*d)->count();
  state.counters["req_bytes"] = static_cast<double>(wire.request);
  state.counters["resp_bytes"] = static_cast<double>(wire.response);
  if (state.iterations() > 0) {  // steady state: 90 (one per stream) per sequence and step
    state.counters["evicted_per_seq_step"] =
        static_cast<double>((*d)->evicted()) /
        static_cast<double>(state.iterations() * (*d)->count());
  }
}

// The raw twin of BM_Decode: one echo call per step carrying the same request and response
// sizes.
void BM_RawLike(benchmark::State& state, Scenario scenario, Transport transport) {
  if (MeasuredWire().count(scenario.Key()) == 0) {
    auto d = DecodingSequences::Start(Shared().client(Daemon::kTcp), scenario);
    if (!d.ok()) {
      state.SkipWithError(std::string(d.status().message()).c_str());
      return;
    }
    MeasuredWire()[scenario.Key()] = (*d)->wire();
  }
  const WireBytes wire = MeasuredWire()[scenario.Key()];
  kvmem::bench::Payload payload;
  payload.set_reply_bytes(static_cast<uint64_t>(wire.response));
  PadTo(wire.request, &payload);
  kvmem::bench::Echo::Stub& stub = Shared().raw(transport);
  for (auto _ : state) RawCall(state, stub, payload);
  state.counters["req_bytes"] = static_cast<double>(payload.ByteSizeLong());
  state.counters["resp_bytes"] = static_cast<double>(wire.response);
}

constexpr auto kWindow = PolicyKind::kWindow;
constexpr auto kConfKv = PolicyKind::kConfKv;
constexpr auto kBatch = Calls::kStepBatch;
constexpr auto kStep = Calls::kAppendThenStep;
constexpr auto kSerial = Daemon::kTcpSerialBatches;

// Target 1: a step of 64 sequences in one StepBatch against a 1-entry StepBatch, kvmemd's
// parallel batches off and on; tables kept.
BENCHMARK_CAPTURE(BM_Decode, window_batch1, Scenario{kWindow, 1, kBatch}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch64_serial, Scenario{kWindow, 64, kBatch}, kSerial)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch64_parallel, Scenario{kWindow, 64, kBatch}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_batch1, Scenario{kConfKv, 1, kBatch}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_batch64_serial, Scenario{kConfKv, 64, kBatch}, kSerial)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_batch64_parallel, Scenario{kConfKv, 64, kBatch}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_batch1, Scenario{kWindow, 1, kBatch}, Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_batch64, Scenario{kWindow, 64, kBatch}, Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, confkv_batch1, Scenario{kConfKv, 1, kBatch}, Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, confkv_batch64, Scenario{kConfKv, 64, kBatch}, Transport::kTcp)
    ->Apply(Timed);
// The same without tables: what the deltas cost.
BENCHMARK_CAPTURE(BM_Decode, window_batch1_notable, Scenario{kWindow, 1, kBatch, false},
                  Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch64_notable, Scenario{kWindow, 64, kBatch, false},
                  Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_batch1_notable, Scenario{kWindow, 1, kBatch, false},
                  Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_batch64_notable, Scenario{kWindow, 64, kBatch, false},
                  Transport::kTcp)
    ->Apply(Timed);

// The same-host step channel against StepBatch over gRPC on a unix socket and the raw call.
BENCHMARK_CAPTURE(BM_Decode, window_batch1_unix, Scenario{kWindow, 1, kBatch}, Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch1_channel, Scenario{kWindow, 1, kBatch},
                  Daemon::kUnixChannel)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_batch1_unix, Scenario{kWindow, 1, kBatch}, Transport::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_batch1_unix, Scenario{kConfKv, 1, kBatch}, Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_batch1_channel, Scenario{kConfKv, 1, kBatch},
                  Daemon::kUnixChannel)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, confkv_batch1_unix, Scenario{kConfKv, 1, kBatch}, Transport::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch64_unix, Scenario{kWindow, 64, kBatch}, Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch64_channel, Scenario{kWindow, 64, kBatch},
                  Daemon::kUnixChannel)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_batch1_channel_notable, Scenario{kWindow, 1, kBatch, false},
                  Daemon::kUnixChannel)
    ->Apply(Timed);

// The daemon's share of a decode step at 8k context (the eval speed study's target), through
// the step channel as the reference worker steps.
void LongTimed(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->MeasureProcessCPUTime()->Iterations(kLongContextSteps);
}
BENCHMARK_CAPTURE(BM_Decode, full_8k_channel,
                  Scenario{PolicyKind::kFull, 1, kBatch, true, kLongContextTokens},
                  Daemon::kUnixChannel)
    ->Apply(LongTimed);
BENCHMARK_CAPTURE(BM_Decode, window_8k_channel,
                  Scenario{kWindow, 1, kBatch, true, kLongContextTokens}, Daemon::kUnixChannel)
    ->Apply(LongTimed);
BENCHMARK_CAPTURE(BM_Decode, confkv_8k_channel,
                  Scenario{kConfKv, 1, kBatch, true, kLongContextTokens}, Daemon::kUnixChannel)
    ->Apply(LongTimed);
// The same with each step's caches cold (Scenario::cold), as between a worker's forward passes.
BENCHMARK_CAPTURE(BM_Decode, full_8k_channel_cold,
                  Scenario{PolicyKind::kFull, 1, kBatch, true, kLongContextTokens, true},
                  Daemon::kUnixChannel)
    ->Apply(LongTimed);
BENCHMARK_CAPTURE(BM_Decode, window_8k_channel_cold,
                  Scenario{kWindow, 1, kBatch, true, kLongContextTokens, true},
                  Daemon::kUnixChannel)
    ->Apply(LongTimed);
BENCHMARK_CAPTURE(BM_Decode, confkv_8k_channel_cold,
                  Scenario{kConfKv, 1, kBatch, true, kLongContextTokens, true},
                  Daemon::kUnixChannel)
    ->Apply(LongTimed);

// Target 2: the single-sequence Step round trip over TCP and a unix socket, with and without
// the table's delta.
BENCHMARK_CAPTURE(BM_Decode, window_step_tcp, Scenario{kWindow, 1, kStep}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_step_unix, Scenario{kWindow, 1, kStep}, Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_step_tcp_notable, Scenario{kWindow, 1, kStep, false},
                  Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, window_step_unix_notable, Scenario{kWindow, 1, kStep, false},
                  Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_step_tcp, Scenario{kConfKv, 1, kStep}, Daemon::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_Decode, confkv_step_unix, Scenario{kConfKv, 1, kStep}, Daemon::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_step_tcp, Scenario{kWindow, 1, kStep}, Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_step_unix, Scenario{kWindow, 1, kStep}, Transport::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_step_tcp_notable, Scenario{kWindow, 1, kStep, false},
                  Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, window_step_unix_notable, Scenario{kWindow, 1, kStep, false},
                  Transport::kUnix)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, confkv_step_tcp, Scenario{kConfKv, 1, kStep}, Transport::kTcp)
    ->Apply(Timed);
BENCHMARK_CAPTURE(BM_RawLike, confkv_step_unix, Scenario{kConfKv, 1, kStep}, Transport::kUnix)
    ->Apply(Timed);

}  // namespace

int main(int argc, char** argv) {
  // As kvmemd runs (server/main.cc): abseil's lock-order graph off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Before any call: gRPC reads the global interceptor factory when a call starts.
  grpc::experimental::RegisterGlobalClientInterceptorFactory(&Probe());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  StopShared();
  std::remove(SocketPath("kvmemd").c_str());
  std::remove(SocketPath("echo").c_str());
  std::remove(SocketPath("kvmemd-channel").c_str());
  return 0;
}
