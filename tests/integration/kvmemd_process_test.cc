// The kvmemd binary itself: starts from flags, serves grpc.health.v1, answers kvmemctl,
// refuses what it was not built for, drains on SIGTERM with exit code 0, cleans /dev/shm of
// dead daemons' segments, refuses a pool /dev/shm cannot hold and echoes little of what a
// client sent.
#include "tests/testing/kvmemd_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvmem/client.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

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
  auto seq = client->CreateSequence({2, 1, 8, kvmem::client::DType::kF32, 0, 10}, {"window", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->lease_seconds, 30u);

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
        RunShell(std::string(KVMEMD_PATH) + " --listen=127.0.0.1:0 " + flag + " 2>&1; echo rc=$?");
    EXPECT_THAT(out, HasSubstr("rc=2")) << flag;
  }
  const std::string cuda =
      RunShell(std::string(KVMEMD_PATH) + " --listen=127.0.0.1:0 --backend=cuda 2>&1; echo rc=$?");
  EXPECT_THAT(cuda, HasSubstr("--backend=cuda"));
  EXPECT_THAT(cuda, HasSubstr("rc=2"));
}

// A file in /dev/shm named like a segment, held open (and locked when `lock`) by this test.
struct FakeSegment {
  FakeSegment(const std::string& name, bool lock) : path("/dev/shm/" + name) {
    fd = open(path.c_str(), O_CREAT | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << path;
    EXPECT_EQ(write(fd, "kvmem", 5), 5);
    if (lock) {
      EXPECT_EQ(flock(fd, LOCK_SH), 0);
    }
  }
  ~FakeSegment() {
    close(fd);
    unlink(path.c_str());
  }
  bool exists() const { return access(path.c_str(), F_OK) == 0; }
  std::string path;
  int fd = -1;
};

TEST(KvmemdProcessTest, RemovesTheSegmentsOfDeadDaemonsAtStartup) {
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  kvmem::testing::WaitExit(dead);
  const std::string dead_pid = std::to_string(dead), live_pid = std::to_string(getpid());
  FakeSegment dead_pool("kvmem-pool-" + dead_pid + "-0", false);
  FakeSegment dead_epochs("kvmem-epochs-" + dead_pid + "-1", false);
  FakeSegment live_pool("kvmem-pool-" + live_pid + "-90", false);
  // A dead pid here, but the owner's lock is held: a daemon of another pid namespace.
  FakeSegment locked_pool("kvmem-pool-" + dead_pid + "-2", true);
  FakeSegment other_name("kvmem-pool-" + dead_pid + "-3-backup", false);
  kvmem::testing::KvmemdProcess d = kvmem::testing::StartKvmemd(
      KVMEMD_PATH,
      {"--listen=127.0.0.1:0", "--pool-bytes=33554432", "--drain-seconds=1", "--log-level=warn"});
  ASSERT_GT(d.port, 0);
  EXPECT_FALSE(dead_pool.exists());
  EXPECT_FALSE(dead_epochs.exists());
  EXPECT_TRUE(live_pool.exists());
  EXPECT_TRUE(locked_pool.exists());
  EXPECT_TRUE(other_name.exists());
  EXPECT_EQ(kvmem::testing::StopKvmemd(d), 0);
}

TEST(KvmemdProcessTest, RefusesAPoolThatDevShmCannotHold) {
  struct statvfs fs {};
  ASSERT_EQ(statvfs("/dev/shm", &fs), 0);
  if (fs.f_blocks == 0) GTEST_SKIP() << "/dev/shm has no size limit";
  // Larger than all of /dev/shm: refused at once, without filling it on the way.
  const uint64_t page = 64 * 1024;
  const uint64_t pool = (uint64_t{fs.f_blocks} * fs.f_frsize / page + 1024) * page;
  const std::string out =
      RunShell("timeout 30 " + std::string(KVMEMD_PATH) +
               " --listen=127.0.0.1:0 --pool-bytes=" + std::to_string(pool) + " 2>&1; echo rc=$?");
  EXPECT_THAT(out, HasSubstr("rc=2"));
  EXPECT_THAT(out, HasSubstr("--pool-bytes=" + std::to_string(pool)));
  EXPECT_THAT(out, HasSubstr("/dev/shm has"));
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

}  // namespace
