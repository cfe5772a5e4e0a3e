// The kvmemd binary itself: starts from flags, serves grpc.health.v1, answers kvmemctl,
// refuses what it was not built for, drains on SIGTERM with exit code 0 (accepted calls
// finish, new ones get UNAVAILABLE), applies no AppendStream that did not end cleanly,
// names no shared-memory segment, refuses a pool the machine cannot hold and echoes
// little of what a client sent.
#include "tests/testing/kvmemd_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"
#if KVMEM_WITH_UCX
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include "kvmem/ucx_pool.h"
#include "kvmem/ucx_sender.h"
#endif
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "tests/testing/payload.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/unix_sockets.h"

namespace {

using ::testing::HasSubstr;

// grpc.health.v1.Health/Check through the generic stub: request {service = name},
// response field 1 is the status (1 SERVING, 2 NOT_SERVING).
int HealthStatus(const std::string& target, const std::string& service) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  std::string request = "\x0a";
  request.push_back(static_cast<char>(service.size()));
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1), out;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", in, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&out, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
  if (!status.ok()) return -static_cast<int>(status.error_code());
  std::vector<grpc::Slice> slices;
  out.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;  // proto3 omits 0 (UNKNOWN)
}

std::string RunShell(const std::string& command) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  return out;
}

TEST(KvmemdProcessTest, ServesHealthAnswersKvmemctlAndDrainsOnSigterm) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--lease-seconds=30", "--drain-seconds=1"});
  ASSERT_GT(d.port, 0);
  const std::string target = "127.0.0.1:" + std::to_string(d.port);
  EXPECT_EQ(HealthStatus(target, ""), 1);
  EXPECT_EQ(HealthStatus(target, "kvmem.v1.KvCache"), 1);

  auto client = *kvmem::client::Client::Connect(target);
  auto seq = client->CreateSequence({2, 1, 8, kvmem::client::DType::kF32, std::nullopt, 10},
                                    {"window", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lease, absl::Seconds(30));

  const std::string info = RunShell(std::string(KVMEMCTL_PATH) + " --target=" + target + " info");
  EXPECT_THAT(info, HasSubstr("backend          cpu"));
  EXPECT_THAT(info, HasSubstr("window"));
  EXPECT_THAT(info, HasSubstr("default 512"));
  EXPECT_THAT(info, HasSubstr("policy steps     in host policy code"));  // auto on the CPU
  const std::string seqs =
      RunShell(std::string(KVMEMCTL_PATH) + " --target=" + target + " sequences");
  EXPECT_THAT(seqs, HasSubstr("window"));
  const std::string stats = RunShell(std::string(KVMEMCTL_PATH) + " --target=" + target + " stats");
  EXPECT_THAT(stats, HasSubstr("1 active"));
  EXPECT_THAT(stats, HasSubstr("slot state       0 B"));

  // The client stays connected: a drain must not wait for idle workers to hang up.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

TEST(KvmemdProcessTest, RefusesBadFlagsWithAClearError) {
  for (const char* flag : {"--backend=tpu", "--pool-bytes=10"}) {
    const std::string out =
        RunShell(std::string(KVMEMD_PATH) + " --listen=127.0.0.1:0 --metrics-listen= " + flag +
                 " 2>&1; echo rc=$?");
    EXPECT_THAT(out, HasSubstr("rc=2")) << flag;
  }
  const std::string cuda =
      RunShell(std::string(KVMEMD_PATH) +
               " --listen=127.0.0.1:0 --metrics-listen= --backend=cuda 2>&1; echo rc=$?");
  EXPECT_THAT(cuda, HasSubstr("--backend=cuda"));
  EXPECT_THAT(cuda, HasSubstr("rc=2"));
}

// No segment of kvmemd has a name another process could open or list (the pool, epoch board,
// table area and a step channel with its signal area are memfds handed out by descriptor),
// and a daemon killed outright leaves nothing behind.
TEST(KvmemdProcessTest, NoSegmentHasANameAndAKilledDaemonLeavesNone) {
  const std::set<std::string> before = kvmem::testing::ShmNames();
  kvmem::testing::KvmemdProcess d =
      kvmem::testing::StartKvmemd(KVMEMD_PATH, {"--listen=127.0.0.1:0", "--pool-bytes=33554432",
                                                "--table-area-bytes=1048576", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  auto client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(d.port));
  auto info = client->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(kvmem::client::SharedPool::Attach(*info).ok());
  ASSERT_TRUE(client->OpenStepChannel(1ull << 20, 1ull << 20).ok());
  EXPECT_EQ(kvmem::testing::ShmNames(), before);
  kill(d.pid, SIGKILL);
  kvmem::testing::WaitExit(d.pid);
  d.pid = 0;
  EXPECT_EQ(kvmem::testing::ShmNames(), before);
  if (d.out != nullptr) fclose(d.out);
}

#if KVMEM_WITH_UCX
// A reader in another process reads a kvmemd's pool by UCX RMA (kvmemd --ucx), over TCP and
// over shared memory, bit-exact against ReadKv; a kvmemd killed under it fails its next read
// within the pool's deadline.
// A kvmemd --ucx (transports: UCX_TLS) holding one sequence of 40 tokens of a 2x2x64 f16
// layout (K and V: Payload16 with salts 0 and 1); `sequence_id` 0 when it could not.
struct UcxDaemon {
  kvmem::testing::KvmemdProcess d;
  std::unique_ptr<kvmem::client::Client> client;
  uint64_t sequence_id = 0;
};
UcxDaemon StartUcxDaemon() {
  UcxDaemon u;
  u.d = kvmem::testing::StartKvmemd(KVMEMD_PATH,
                                    {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--ucx",
                                     "--ucx_trusted_network", "--log-level=warn"});
  if (u.d.port <= 0) return u;
  u.client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(u.d.port));
  kvmem::client::Layout layout{2, 2, 64, kvmem::client::DType::kF16, 16, 1000};
  auto seq = u.client->CreateSequence(layout, {"full", {}});
  EXPECT_TRUE(seq.ok()) << seq.status();
  if (!seq.ok()) return u;
  const std::vector<int64_t> positions = kvmem::testing::Range(0, 40);
  const std::string k = kvmem::testing::Payload16(2 * 2, 0, 40, 64, 0);
  const std::string v = kvmem::testing::Payload16(2 * 2, 0, 40, 64, 1);
  const absl::Status appended = u.client->Append(seq->id, {positions, {}, k, v, {}, {}}).status();
  EXPECT_TRUE(appended.ok()) << appended;
  if (appended.ok()) u.sequence_id = seq->id;
  return u;
}

TEST(KvmemdProcessTest, ARemoteReaderReadsThePoolByUcx) {
  for (const char* tls : {"tcp", "sm,self"}) {
    SCOPED_TRACE(tls);
    const kvmem::testing::ScopedEnv transports("UCX_TLS", tls);
    UcxDaemon u = StartUcxDaemon();
    ASSERT_NE(u.sequence_id, 0u);
    kvmem::testing::KvmemdProcess& d = u.d;
    auto info = u.client->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    auto pool = kvmem::client::UcxPool::Connect(*info, absl::Seconds(3));
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto table = *u.client->GetBlockTable(u.sequence_id);
    auto streams = *u.client->ReadKv(u.sequence_id);
    for (const kvmem::client::StreamKv& kv : streams) {
      std::string rk, rv;
      const absl::Status read = (*pool)->ReadStream(table, kv.layer, kv.kv_head, &rk, &rv);
      ASSERT_TRUE(read.ok()) << read;
      EXPECT_EQ(rk, kv.k);
      EXPECT_EQ(rv, kv.v);
    }
    kill(d.pid, SIGKILL);
    kvmem::testing::WaitExit(d.pid);
    if (d.out != nullptr) fclose(d.out);
    std::string rk, rv;
    const auto started = std::chrono::steady_clock::now();
    EXPECT_FALSE((*pool)->ReadStream(table, 0, 0, &rk, &rv).ok());
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  }
}

// A read for a call ends by the call's deadline (UcxPool::Deadline), not the pool's: a daemon
// stopped mid-read (SIGSTOP: over TCP its worker answers no get) fails it in about the
// call's time; a deadline already past fails before any get and leaves the pool whole.
TEST(KvmemdProcessTest, AUcxReadEndsByTheCallsDeadline) {
  const kvmem::testing::ScopedEnv transports("UCX_TLS", "tcp");
  UcxDaemon u = StartUcxDaemon();
  ASSERT_NE(u.sequence_id, 0u);
  kvmem::testing::KvmemdProcess& d = u.d;
  auto info = u.client->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  auto pool = kvmem::client::UcxPool::Connect(*info, absl::Seconds(30));
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto table = *u.client->GetBlockTable(u.sequence_id);
  const std::string k = kvmem::testing::Payload16(2 * 2, 0, 40, 64, 0);
  std::string rk, rv;
  {
    const kvmem::client::UcxPool::Deadline past(absl::Now() - absl::Seconds(1));
    EXPECT_EQ((*pool)->ReadStream(table, 0, 0, &rk, &rv).code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_FALSE((*pool)->broken());
  const absl::Status whole = (*pool)->ReadStream(table, 0, 0, &rk, &rv);
  ASSERT_TRUE(whole.ok()) << whole;
  EXPECT_EQ(rk, k.substr(0, 40 * 64 * 2));

  ASSERT_TRUE(kvmem::testing::PauseKvmemd(d.pid));
  const absl::Time started = absl::Now();
  {
    const kvmem::client::UcxPool::Deadline by_call(started + absl::Milliseconds(500));
    const absl::Status stalled = (*pool)->ReadStream(table, 1, 1, &rk, &rv);
    EXPECT_EQ(stalled.code(), absl::StatusCode::kDeadlineExceeded) << stalled;
  }
  // The read's half second and the forced close's second at most, not the pool's 30 s.
  EXPECT_LT(absl::Now() - started, absl::Seconds(5));
  EXPECT_TRUE((*pool)->broken());
  kill(d.pid, SIGCONT);
  kill(d.pid, SIGKILL);
  kvmem::testing::WaitExit(d.pid);
  if (d.out != nullptr) fclose(d.out);
}
#endif

// A worker's step channel when its daemon dies outright: the batch in flight fails with
// UNAVAILABLE within the client's deadline instead of waiting on a futex no one will wake,
// and the client goes back to gRPC.
TEST(KvmemdProcessTest, AStepChannelEndsWithItsDaemon) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH, {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(5);
  options.max_attempts = 1;
  auto client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(d.port), options);
  ASSERT_TRUE(client->OpenStepChannel(1ull << 20).ok());
  auto seq =
      client->CreateSequence({2, 1, 8, kvmem::client::DType::kF32, std::nullopt, 10}, {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<int64_t> positions = {0};
  const std::string kv(2 * 1 * 8 * 4, '\0');
  kvmem::client::BatchEntry entry;
  entry.sequence_id = seq->id;
  entry.append = kvmem::client::AppendArgs{positions, {}, kv, kv, {}, {}};
  auto first = client->StepBatch({entry});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE((*first)[0].status.ok()) << (*first)[0].status;
  EXPECT_EQ(client->step_channel_batches(), 1u);

  kill(d.pid, SIGKILL);
  kvmem::testing::WaitExit(d.pid);
  const absl::Time start = absl::Now();
  const std::vector<int64_t> next = {1};
  entry.append = kvmem::client::AppendArgs{next, {}, kv, kv, {}, {}};
  auto after = client->StepBatch({entry});
  EXPECT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(client->step_channel_open());
  EXPECT_EQ(client->step_channel_batches(), 1u);
  if (d.out != nullptr) fclose(d.out);
}

TEST(KvmemdProcessTest, RefusesAPoolTheMachineCannotHold) {
  struct sysinfo mem {};
  ASSERT_EQ(sysinfo(&mem), 0);
  // Larger than all of the machine's memory and swap: refused at once, without filling
  // memory on the way.
  const uint64_t page = 64 * 1024;
  const uint64_t all = (uint64_t{mem.totalram} + mem.totalswap) * mem.mem_unit;
  const uint64_t pool = (all / page + 1024) * page;
  const std::string out =
      RunShell("timeout 30 " + std::string(KVMEMD_PATH) +
               " --listen=127.0.0.1:0 --metrics-listen= --pool-bytes=" + std::to_string(pool) +
               " 2>&1; echo rc=$?");
  EXPECT_THAT(out, HasSubstr("rc=2"));
  EXPECT_THAT(out, HasSubstr("--pool-bytes=" + std::to_string(pool)));
  EXPECT_THAT(out, HasSubstr("bytes available (MemAvailable)"));
}

// SIGTERM while kvmemd allocates a large pool (seconds) stops it before it serves (at the
// latest when the allocation call returns); before, the signal waited until kvmemd had
// started serving, then drained it.
TEST(KvmemdProcessTest, SigtermWhileStartingStopsItBeforeItServes) {
  const uint64_t pool = 4ull << 30;  // about 2 s to allocate on a 2-vCPU VM
  struct sysinfo mem {};
  ASSERT_EQ(sysinfo(&mem), 0);
  if (uint64_t{mem.freeram} * mem.mem_unit < 2 * pool) {
    GTEST_SKIP() << "less than 8 GiB of free memory";
  }
  const std::string dir = ::testing::TempDir() + "/kvmemd_stop_" + std::to_string(getpid());
  const std::string out = RunShell(
      "mkdir -p " + dir + " && cd " + dir + " || exit 1; " + std::string(KVMEMD_PATH) +
      " --listen=127.0.0.1:0 --metrics-listen= --pool-prefault=false --pool-bytes=" +
      std::to_string(pool) +
      " >stdout 2>stderr & pid=$!; "
      "for i in $(seq 500); do grep -q 'kvmemd: starting' stderr && break; sleep 0.01; done; "
      "kill -TERM $pid; wait $pid; echo rc=$?; echo pid=$pid; cat stdout stderr; rm -rf " +
      dir);
  EXPECT_THAT(out, HasSubstr("rc=0"));
  EXPECT_THAT(out, HasSubstr("stopped before serving"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("READY")));
}

// ---- raw-stub helpers: no client-side retries, so every status is the daemon's own ----

// Layout of the sequences below: 2 layers x 1 head x head_dim 8, f32 (64 bytes per token
// of K, and of V).
constexpr uint32_t kLayers = 2, kHeadDim = 8;

std::unique_ptr<kvmem::v1::KvCache::Stub> Stub(int port) {
  return kvmem::v1::KvCache::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

void SetDeadline(grpc::ClientContext* context, int seconds = 20) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

TEST(KvmemdProcessTest, EchoesNoMoreThanAFewBytesOfClientText) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=1", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  auto stub = Stub(d.port);
  const std::string huge(200 * 1024, 'x');
  for (const char* what : {"policy name", "parameter name"}) {
    kvmem::v1::CreateSequenceRequest request;
    kvmem::v1::Layout* layout = request.mutable_layout();
    layout->set_num_layers(kLayers);
    layout->set_num_kv_heads(1);
    layout->set_head_dim(kHeadDim);
    layout->set_dtype(kvmem::v1::DTYPE_F32);
    layout->set_vocab_size(10);
    if (std::string(what) == "policy name") {
      request.mutable_policy()->set_name(huge);
    } else {
      request.mutable_policy()->set_name("window");
      (*request.mutable_policy()->mutable_params())[huge] = 1;
    }
    kvmem::v1::CreateSequenceResponse response;
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status status = stub->CreateSequence(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << what << ": " << status.error_message().substr(0, 200);
    EXPECT_LT(status.error_message().size(), 1024u) << what;
    EXPECT_THAT(status.error_message(), HasSubstr("204800 bytes")) << what;
  }
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

uint64_t CreateSequence(kvmem::v1::KvCache::Stub& stub) {
  kvmem::v1::CreateSequenceRequest request;
  kvmem::v1::Layout* layout = request.mutable_layout();
  layout->set_num_layers(kLayers);
  layout->set_num_kv_heads(1);
  layout->set_head_dim(kHeadDim);
  layout->set_dtype(kvmem::v1::DTYPE_F32);
  layout->set_vocab_size(10);
  request.mutable_policy()->set_name("full");
  kvmem::v1::CreateSequenceResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub.CreateSequence(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.sequence_id();
}

// Tokens [first, first + n) of sequence `id`: a chunk of an AppendStream, or an AppendRequest.
template <typename Request = kvmem::v1::AppendStreamRequest>
Request Chunk(uint64_t id, int64_t first, uint32_t n) {
  Request request;
  request.set_sequence_id(id);
  for (uint32_t i = 0; i < n; ++i) request.add_positions(first + i);
  request.set_k(std::string(size_t{kLayers} * n * kHeadDim * sizeof(float), '\1'));
  request.set_v(std::string(size_t{kLayers} * n * kHeadDim * sizeof(float), '\2'));
  return request;
}

// Sequence `id`'s appended_tokens as Stats reports it; -1 when the call fails.
int64_t AppendedTokens(kvmem::v1::KvCache::Stub& stub, uint64_t id) {
  kvmem::v1::StatsRequest request;
  request.set_include_sequences(true);
  kvmem::v1::StatsResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  if (!stub.Stats(&context, request, &response).ok()) return -1;
  for (const kvmem::v1::SequenceStats& s : response.sequences()) {
    if (s.sequence_id() == id) return static_cast<int64_t>(s.appended_tokens());
  }
  return -1;
}

// A whole prefill of `chunks` chunks of 16 tokens in one AppendStream.
grpc::Status StreamPrefill(kvmem::v1::KvCache::Stub& stub, uint64_t id, int chunks,
                           kvmem::v1::AppendStreamResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  auto writer = stub.AppendStream(&context, response);
  for (int c = 0; c < chunks; ++c) writer->Write(Chunk(id, 16 * c, 16));
  writer->WritesDone();
  return writer->Finish();
}

// Wait for what a daemon thread may still be doing with a call the client gave up on.
void LetTheDaemonCatchUp() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

// After a stream that did not end cleanly: nothing of it was appended, and the whole
// prefill sent again is accepted, as if the broken one had never been sent.
void ExpectNothingAppendedThenPrefillWorks(kvmem::v1::KvCache::Stub& stub, uint64_t id) {
  LetTheDaemonCatchUp();
  EXPECT_EQ(AppendedTokens(stub, id), 0);
  kvmem::v1::AppendStreamResponse response;
  const grpc::Status retry = StreamPrefill(stub, id, 4, &response);
  EXPECT_TRUE(retry.ok()) << retry.error_message();
  EXPECT_EQ(response.appended_tokens(), 64u);
}

TEST(KvmemdProcessTest, CancelledAppendStreamAppendsNothing) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=1", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  auto stub = Stub(d.port);
  const uint64_t id = CreateSequence(*stub);
  {
    kvmem::v1::AppendStreamResponse response;
    grpc::ClientContext context;
    SetDeadline(&context);
    auto writer = stub->AppendStream(&context, &response);
    for (int c = 0; c < 3; ++c) ASSERT_TRUE(writer->Write(Chunk(id, 16 * c, 16)));
    LetTheDaemonCatchUp();  // the daemon has read the three chunks
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectNothingAppendedThenPrefillWorks(*stub, id);
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

// Runs test KvmemdProcessChild.`name` of this binary in a fresh process (a forked copy of a
// process with gRPC threads could not use gRPC), with this environment plus `env`
// ("KEY=value") and the pipe's write end as KVMEM_CHILD_FD; closes that end here.
// Everything the child needs is built before the fork: it only execs.
pid_t StartChild(const char* name, const int fds[2], std::vector<std::string> env) {
  env.push_back("KVMEM_CHILD_FD=" + std::to_string(fds[1]));
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string self = "kvmemd_process_test", all = "--gtest_also_run_disabled_tests";
  std::string filter = std::string("--gtest_filter=KvmemdProcessChild.") + name;
  char* argv[] = {self.data(), filter.data(), all.data(), nullptr};
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    execve("/proc/self/exe", argv, envp.data());
    _exit(127);
  }
  close(fds[1]);
  return child;
}

// The child side of ClientKilledMidStreamAppendsNothing, run in a fresh process (a forked
// copy of a process with gRPC threads could not use gRPC): streams three chunks of the
// sequence named by the environment, says so on the pipe, then waits to be killed.
TEST(KvmemdProcessChild, DISABLED_StreamsThreeChunksThenWaits) {
  const char* port = std::getenv("KVMEM_CHILD_PORT");
  const char* id = std::getenv("KVMEM_CHILD_SEQUENCE");
  const char* fd = std::getenv("KVMEM_CHILD_FD");
  if (port == nullptr || id == nullptr || fd == nullptr) GTEST_SKIP() << "child of a test only";
  auto stub = Stub(std::atoi(port));
  kvmem::v1::AppendStreamResponse response;
  grpc::ClientContext context;
  auto writer = stub->AppendStream(&context, &response);
  for (int c = 0; c < 3; ++c) writer->Write(Chunk(std::strtoull(id, nullptr, 10), 16 * c, 16));
  const int out = std::atoi(fd);
  if (write(out, "W", 1) != 1) _exit(1);
  close(out);
  pause();
}

TEST(KvmemdProcessTest, ClientKilledMidStreamAppendsNothing) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=1", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  auto stub = Stub(d.port);
  const uint64_t id = CreateSequence(*stub);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = StartChild(
      "DISABLED_StreamsThreeChunksThenWaits", fds,
      {"KVMEM_CHILD_PORT=" + std::to_string(d.port), "KVMEM_CHILD_SEQUENCE=" + std::to_string(id)});
  char wrote = 0;
  ASSERT_EQ(read(fds[0], &wrote, 1), 1) << "the streaming child did not start";
  close(fds[0]);
  LetTheDaemonCatchUp();  // the daemon has read the three chunks
  kill(child, SIGKILL);
  EXPECT_EQ(kvmem::testing::WaitExit(child), 128 + SIGKILL);
  ExpectNothingAppendedThenPrefillWorks(*stub, id);
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

// The child side of ADaemonEndsWithTheTestThatStartedIt, run in a fresh process: starts a
// kvmemd, sends its pid on the pipe, and ends without stopping it (as a test whose ASSERT
// returned early, or that crashed).
TEST(KvmemdProcessChild, DISABLED_StartsADaemonAndEnds) {
  const char* fd = std::getenv("KVMEM_CHILD_FD");
  if (fd == nullptr) GTEST_SKIP() << "child of a test only";
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=1", "--log-level=warn"});
  const int out = std::atoi(fd);
  if (d.port == 0 || write(out, &d.pid, sizeof d.pid) != sizeof d.pid) _exit(1);
  _exit(0);
}

// A pid's process is gone or a zombie (an orphan is reaped by whoever adopts it, if at all).
bool Ended(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char state = '?';
  const int read = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return read == 1 && (state == 'Z' || state == 'X');
}

TEST(KvmemdProcessTest, ADaemonEndsWithTheTestThatStartedIt) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = StartChild("DISABLED_StartsADaemonAndEnds", fds, {});
  pid_t daemon = -1;
  const bool got = read(fds[0], &daemon, sizeof daemon) == sizeof daemon;
  close(fds[0]);
  EXPECT_EQ(kvmem::testing::WaitExit(child), 0);
  ASSERT_TRUE(got) << "the child did not start a daemon";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!Ended(daemon) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const bool ended = Ended(daemon);
  if (!ended) kill(daemon, SIGKILL);
  EXPECT_TRUE(ended) << "kvmemd " << daemon << " outlived the test process that started it";
}

TEST(KvmemdProcessTest, SigtermFinishesAcceptedCallsAndRefusesNewOnes) {
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=5", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  const std::string target = "127.0.0.1:" + std::to_string(d.port);
  auto stub = Stub(d.port);

  // Eight AppendStreams inside their handler when SIGTERM comes; they finish afterwards.
  constexpr int kHeld = 8;
  std::vector<uint64_t> held_ids;
  for (int i = 0; i < kHeld; ++i) held_ids.push_back(CreateSequence(*stub));
  std::atomic<bool> sigterm_sent{false};
  std::atomic<int> streaming{0};
  std::vector<grpc::Status> held_status(kHeld);
  std::vector<uint64_t> held_tokens(kHeld);
  std::vector<std::thread> threads;
  for (int i = 0; i < kHeld; ++i) {
    threads.emplace_back([&, i] {
      kvmem::v1::AppendStreamResponse response;
      grpc::ClientContext context;
      SetDeadline(&context, 60);
      auto writer = stub->AppendStream(&context, &response);
      writer->Write(Chunk(held_ids[i], 0, 16));
      ++streaming;
      while (!sigterm_sent) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      writer->Write(Chunk(held_ids[i], 16, 16));
      writer->WritesDone();
      held_status[i] = writer->Finish();
      held_tokens[i] = response.appended_tokens();
    });
  }
  // Eight more threads send unary Appends back to back until one is refused: calls arrive
  // during every phase of the drain.
  std::vector<uint64_t> busy_ids;
  for (int i = 0; i < kHeld; ++i) busy_ids.push_back(CreateSequence(*stub));
  std::vector<std::vector<grpc::Status>> busy_status(kHeld);
  for (int i = 0; i < kHeld; ++i) {
    threads.emplace_back([&, i] {
      for (int64_t p = 0;; ++p) {
        kvmem::v1::AppendResponse response;
        grpc::ClientContext context;
        SetDeadline(&context);
        busy_status[i].push_back(
            stub->Append(&context, Chunk<kvmem::v1::AppendRequest>(busy_ids[i], p, 1), &response));
        if (!busy_status[i].back().ok()) break;
      }
    });
  }
  while (streaming < kHeld) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  LetTheDaemonCatchUp();  // the held streams are inside their handler
  ASSERT_EQ(kill(d.pid, SIGTERM), 0);
  sigterm_sent = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));

  // Draining: health says NOT_SERVING, to new Check calls too; new calls are refused.
  EXPECT_EQ(HealthStatus(target, ""), 2);
  EXPECT_EQ(HealthStatus(target, "kvmem.v1.KvCache"), 2);
  {
    kvmem::v1::GetInfoResponse info;
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status refused = stub->GetInfo(&context, {}, &info);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(refused.error_message(), HasSubstr("draining"));
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kHeld; ++i) {
    EXPECT_TRUE(held_status[i].ok())
        << "held stream " << i << ": " << held_status[i].error_message();
    EXPECT_EQ(held_tokens[i], 32u) << "held stream " << i;
  }
  for (int i = 0; i < kHeld; ++i) {
    const grpc::Status& last = busy_status[i].back();
    EXPECT_EQ(last.error_code(), grpc::StatusCode::UNAVAILABLE)
        << "busy thread " << i << " after " << busy_status[i].size()
        << " calls: " << last.error_message();
  }
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

}  // namespace

#if KVMEM_WITH_UCX
// /metrics of a daemon, one sample's value (-1: absent).
double MetricOf(int port, const std::string& sample) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string text;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t at = text.find("\n" + sample + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size() + 2));
}

// A sequence of the layout below, created through the client.
constexpr uint32_t kUcxTokens = 4096;  // 4 MiB of K+V in f32, 2 layers x 4 heads x 32
kvmem::client::Layout UcxLayout() {
  return kvmem::client::Layout{2, 4, 32, kvmem::client::DType::kF32, 16, 1000};
}

// The child side of AClientKilledMidTransferLeavesNothingBehind, in a fresh process: posts
// a remote append's message (rendezvous: its header goes, its data waits here), announces
// it with the gRPC call on a thread, says so on the pipe and stops progressing UCX, so that
// the daemon's receive over TCP waits for data that never comes; then waits to be killed.
TEST(KvmemdProcessChild, DISABLED_PostsAUcxPayloadThenStops) {
  const char* port = std::getenv("KVMEM_CHILD_PORT");
  const char* id = std::getenv("KVMEM_CHILD_SEQUENCE");
  const char* fd = std::getenv("KVMEM_CHILD_FD");
  if (port == nullptr || id == nullptr || fd == nullptr) GTEST_SKIP() << "child of a test only";
  auto client = *kvmem::client::Client::Connect(std::string("127.0.0.1:") + port);
  const kvmem::client::Info info = *client->GetInfo();
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context;
  ucp_worker_h worker;
  ucp_ep_h ep;
  ucp_worker_params_t wp{};
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // as UcxSender's over TCP
  ep_params.address = reinterpret_cast<const ucp_address_t*>(info.ucx.append_worker_address.data());
  if (ucp_init(&params, nullptr, &context) != UCS_OK ||
      ucp_worker_create(context, &wp, &worker) != UCS_OK ||
      ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) {
    _exit(2);
  }
  static const std::string kv(size_t{kUcxTokens} * 2 * 4 * 32 * 4 * 2, '\0');
  static const struct {
    uint32_t magic = 0x4B564D55, version = 1;
    uint64_t hi = 0xfeed, lo = 0xbeef;
  } header;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t sent =
      ucp_am_send_nbx(ep, 1, &header, sizeof header, kv.data(), kv.size(), &param);
  if (UCS_PTR_IS_ERR(sent)) _exit(3);
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < end) ucp_worker_progress(worker);  // the header goes
  static std::vector<int64_t> positions(kUcxTokens);
  for (uint32_t i = 0; i < kUcxTokens; ++i) positions[i] = i;
  std::thread([&client, id] {
    (void)client->Append(
        std::strtoull(id, nullptr, 10),
        {positions, {}, kv.substr(0, kv.size() / 2), kv.substr(kv.size() / 2), {}, {}},
        kvmem::client::UcxTransfer{0xfeed, 0xbeef, kv.size()});
  }).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the call has announced it
  const int out = std::atoi(fd);
  if (write(out, "W", 1) != 1) _exit(1);
  close(out);
  pause();
}

// A client killed while its remote append's data is in flight: the daemon's call ends, the
// receive it left ends too (its endpoint closed: the client's has peer error handling, as
// UcxSender's over TCP; without it the receive would stay, see ucx_plane.h), nothing
// applies, and the next client's remote append works. Failed before the endpoint close.
TEST(KvmemdProcessTest, AClientKilledMidTransferLeavesNothingBehind) {
  const kvmem::testing::ScopedEnv tcp("UCX_TLS", "tcp");
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH, {"--listen=127.0.0.1:0", "--pool-bytes=67108864", "--ucx",
                    "--ucx_trusted_network", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  ASSERT_GT(d.metrics_port, 0);
  auto client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(d.port));
  auto seq = client->CreateSequence(UcxLayout(), {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = StartChild("DISABLED_PostsAUcxPayloadThenStops", fds,
                                 {"KVMEM_CHILD_PORT=" + std::to_string(d.port),
                                  "KVMEM_CHILD_SEQUENCE=" + std::to_string(seq->id)});
  char wrote = 0;
  ASSERT_EQ(read(fds[0], &wrote, 1), 1) << "the child did not announce its payload";
  close(fds[0]);
  EXPECT_EQ(MetricOf(d.metrics_port, "kvmem_ucx_receives_in_flight"), 1);  // mid-transfer
  kill(child, SIGKILL);
  EXPECT_EQ(kvmem::testing::WaitExit(child), 128 + SIGKILL);
  const auto started = std::chrono::steady_clock::now();
  while (MetricOf(d.metrics_port, "kvmem_ucx_receives_in_flight") != 0 &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(MetricOf(d.metrics_port, "kvmem_ucx_receives_in_flight"), 0);
  EXPECT_EQ(MetricOf(d.metrics_port, "kvmem_ucx_held_messages"), 0);
  EXPECT_EQ(
      MetricOf(d.metrics_port, "kvmem_ucx_transfers_total{direction=\"in\",result=\"failed\"}"), 1);
  EXPECT_EQ(client->GetBlockTable(seq->id)->streams[0].positions.size(), 0u);
  // The next client's remote append lands.
  auto sender = kvmem::client::UcxSender::Connect(*client->GetInfo());
  ASSERT_TRUE(sender.ok()) << sender.status();
  const std::vector<int64_t> positions = kvmem::testing::Range(0, 64);
  const std::string k(64 * 2 * 4 * 32 * 4, 'k'), v(k.size(), 'v');
  const std::string kf(k.size(), '\0'), vf(k.size(), '\0');  // finite f32 zeros
  auto appended = (*sender)->Append(*client, seq->id, {positions, {}, kf, vf, {}, {}});
  EXPECT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

// A daemon killed under a remote append: the call fails within the client's time, and a
// new daemon takes the next one.
TEST(KvmemdProcessTest, ADaemonKilledMidTransferFailsTheAppendInTime) {
  const kvmem::testing::ScopedEnv tcp("UCX_TLS", "tcp");
  const std::vector<std::string> flags = {"--listen=127.0.0.1:0", "--pool-bytes=268435456", "--ucx",
                                          "--ucx_trusted_network", "--log-level=warn"};
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(KVMEMD_PATH, flags);
  ASSERT_GT(d.port, 0);
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(10);
  auto client = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(d.port), options);
  auto seq = client->CreateSequence(UcxLayout(), {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto sender = *kvmem::client::UcxSender::Connect(*client->GetInfo());
  const uint32_t n = 8 * kUcxTokens;  // 32 MiB
  const std::vector<int64_t> positions = kvmem::testing::Range(0, n);
  const std::string k(size_t{n} * 2 * 4 * 32 * 4, '\0'), v(k.size(), '\0');
  absl::StatusOr<kvmem::client::AppendResult> result;
  const auto started = std::chrono::steady_clock::now();
  std::thread append([&] {
    result = sender->Append(*client, seq->id, {positions, {}, k, v, {}, {}});
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  kill(d.pid, SIGKILL);
  kvmem::testing::WaitExit(d.pid);
  if (d.out != nullptr) fclose(d.out);
  append.join();
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(20));
  if (result.ok()) std::fprintf(stderr, "(the append landed before the kill)\n");
  kvmem::testing::KvmemdProcess again = kvmem::testing::StartKvmemd(KVMEMD_PATH, flags);
  ASSERT_GT(again.port, 0);
  auto client2 = *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(again.port));
  auto seq2 = client2->CreateSequence(UcxLayout(), {"full", {}});
  ASSERT_TRUE(seq2.ok()) << seq2.status();
  auto sender2 = *kvmem::client::UcxSender::Connect(*client2->GetInfo());
  auto appended = sender2->Append(*client2, seq2->id, {positions, {}, k, v, {}, {}});
  EXPECT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(kvmem::testing::StopKvmemd(again), 0);
}
#endif

// MoveSequence between two kvmemd processes, one killed mid-move: the other answers in
// bounded time and ends whole — the receiver with nothing of the move, the holder with its
// sequence as it was (frozen no longer than the move's hold). By gRPC, and by UCX over TCP
// where built with it. Over UCX the kill comes once the connection is set up (150 ms in, the
// gets under way): UCX 1.13.1 (Debian 12) aborts the surviving process's worker on an
// assertion when a TCP peer dies while their connection is still being wired up (a pending
// wireup message purged; openucx/ucx#8175 removed the assertion upstream).
namespace move_kills {

constexpr uint32_t kLayers = 8, kHeads = 8, kDim = 128, kTokens = 8192;  // 256 MiB of K/V
#if KVMEM_WITH_UCX
constexpr bool kWithUcx = true;
#else
constexpr bool kWithUcx = false;
#endif
constexpr char kFleetToken[] = "move-kill-fleet-token-0123456789";

// The token file both daemons read, and the receiver's peer token: the tests' calls and the
// receiver's GetInfo on the holder are the fleet's admin's.
struct Tokens {
  Tokens() {
    const std::string dir = ::testing::TempDir();
    file = dir + "/kvmem_move_kill_tokens." + std::to_string(getpid());
    peer = dir + "/kvmem_move_kill_peer." + std::to_string(getpid());
    std::ofstream(file) << "fleet " << kFleetToken << " admin\n";
    std::ofstream(peer) << kFleetToken << "\n";
  }
  ~Tokens() {
    std::remove(file.c_str());
    std::remove(peer.c_str());
  }
  std::string file, peer;
};

kvmem::client::Layout MoveLayout() {
  return kvmem::client::Layout{kLayers, kHeads, kDim, kvmem::client::DType::kF16, 16, 49152};
}

struct Pair {
  kvmem::testing::KvmemdProcess holder, receiver;
  std::unique_ptr<kvmem::client::Client> on_holder, on_receiver;
  std::string holder_address;
  uint64_t id = 0;
};

std::vector<std::string> HolderFlags(bool ucx, const Tokens& tokens) {
  std::vector<std::string> flags = {"--listen=127.0.0.1:0", "--pool-bytes=402653184",
                                    "--log-level=warn", "--auth-tokens=" + tokens.file};
  if (ucx) {
    flags.push_back("--ucx");
    flags.push_back("--ucx_trusted_network");
  }
  return flags;
}

void StartPair(bool ucx, const Tokens& tokens, Pair* p) {
  p->holder = kvmem::testing::StartKvmemd(KVMEMD_PATH, HolderFlags(ucx, tokens));
  ASSERT_GT(p->holder.port, 0);
  p->holder_address = "127.0.0.1:" + std::to_string(p->holder.port);
  p->receiver = kvmem::testing::StartKvmemd(
      KVMEMD_PATH, {"--listen=127.0.0.1:0", "--pool-bytes=402653184", "--log-level=warn",
                    "--cluster-peers=" + p->holder_address, "--auth-tokens=" + tokens.file,
                    "--cluster-peer-token-file=" + tokens.peer});
  ASSERT_GT(p->receiver.port, 0);
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(4);  // a move's hold too
  options.max_attempts = 1;
  options.auth_token = kFleetToken;
  p->on_holder = *kvmem::client::Client::Connect(p->holder_address, options);
  p->on_receiver =
      *kvmem::client::Client::Connect("127.0.0.1:" + std::to_string(p->receiver.port), options);
  auto seq = p->on_holder->CreateSequence(MoveLayout(), {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  p->id = seq->id;
  const uint32_t per = 256;
  const std::string k(size_t{kLayers} * kHeads * per * kDim * 2, '\x3c');
  for (uint32_t t = 0; t < kTokens; t += per) {
    const std::vector<int64_t> positions = kvmem::testing::Range(t, per);
    ASSERT_TRUE(p->on_holder->Append(p->id, {positions, {}, k, k, {}, {}}).ok());
  }
}

TEST(KvmemdProcessTest, AHolderKilledMidMoveFailsTheMoveInTimeAndLeavesTheReceiverEmpty) {
  const Tokens tokens;
  for (const bool ucx : {false, kWithUcx}) {
    std::optional<kvmem::testing::ScopedEnv> tcp;
    if (ucx) tcp.emplace("UCX_TLS", "tcp");
    Pair p;
    StartPair(ucx, tokens, &p);
    if (HasFatalFailure()) return;
    const uint64_t baseline = p.on_receiver->GetStats(false)->host_metadata_bytes;
    absl::StatusOr<kvmem::client::Client::Moved> moved;
    const auto started = std::chrono::steady_clock::now();
    std::thread move([&] { moved = p.on_receiver->MoveSequence(p.holder_address, p.id); });
    std::this_thread::sleep_for(std::chrono::milliseconds(ucx ? 150 : 15));
    kill(p.holder.pid, SIGKILL);
    kvmem::testing::WaitExit(p.holder.pid);
    if (p.holder.out != nullptr) fclose(p.holder.out);
    move.join();
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(15)) << ucx;
    if (moved.ok()) {
      std::fprintf(stderr, "(the move ended before the kill)\n");
      ASSERT_TRUE(p.on_receiver->Release(moved->sequence.id).ok());
    }
    auto stats = p.on_receiver->GetStats(false);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->blocks_used, 0u) << ucx;
    EXPECT_EQ(stats->host_metadata_bytes, baseline) << ucx;
    EXPECT_EQ(stats->sequences_active, 0u) << ucx;
    EXPECT_EQ(kvmem::testing::StopKvmemd(p.receiver), 0);
  }
}

TEST(KvmemdProcessTest, AReceiverKilledMidMoveLeavesTheHolderWhole) {
  const Tokens tokens;
  for (const bool ucx : {false, kWithUcx}) {
    std::optional<kvmem::testing::ScopedEnv> tcp;
    if (ucx) tcp.emplace("UCX_TLS", "tcp");
    Pair p;
    StartPair(ucx, tokens, &p);
    if (HasFatalFailure()) return;
    auto before = p.on_holder->ReadKv(p.id);
    ASSERT_TRUE(before.ok());
    const uint64_t blocks = p.on_holder->GetStats(false)->blocks_used;
    std::thread move([&] { (void)p.on_receiver->MoveSequence(p.holder_address, p.id); });
    std::this_thread::sleep_for(std::chrono::milliseconds(ucx ? 150 : 15));
    kill(p.receiver.pid, SIGKILL);
    kvmem::testing::WaitExit(p.receiver.pid);
    if (p.receiver.out != nullptr) fclose(p.receiver.out);
    move.join();
    // Unfrozen within the move's hold (twice the call's deadline of 4 s, and 10 s): appends
    // go on.
    const std::vector<int64_t> next = kvmem::testing::Range(kTokens, 1);
    const std::string k(size_t{kLayers} * kHeads * kDim * 2, '\x3b');
    const auto started = std::chrono::steady_clock::now();
    absl::Status appended;
    do {
      appended = p.on_holder->Append(p.id, {next, {}, k, k, {}, {}}).status();
      if (appended.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } while (std::chrono::steady_clock::now() - started < std::chrono::seconds(25));
    if (!appended.ok() && absl::IsNotFound(appended)) {
      std::fprintf(stderr, "(the move ended before the kill)\n");
    } else {
      EXPECT_TRUE(appended.ok()) << ucx << ": " << appended;
      auto after = p.on_holder->ReadKv(p.id);
      ASSERT_TRUE(after.ok());
      for (size_t s = 0; s < before->size(); ++s) {
        EXPECT_EQ((*after)[s].k.substr(0, (*before)[s].k.size()), (*before)[s].k) << s;
      }
      // Its blocks, the one the append added in each stream, and nothing a move held.
      EXPECT_LE(p.on_holder->GetStats(false)->blocks_used, blocks + kLayers * kHeads) << ucx;
    }
    EXPECT_EQ(kvmem::testing::StopKvmemd(p.holder), 0);
  }
}

}  // namespace move_kills
