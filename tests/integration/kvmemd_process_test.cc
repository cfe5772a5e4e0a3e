// The kvmemd binary itself: starts from flags, serves grpc.health.v1, answers kvmemctl,
// refuses what it was not built for, and drains on SIGTERM with exit code 0.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvmem/client.h"

namespace {

using ::testing::HasSubstr;

struct Daemon {
  pid_t pid = -1;
  FILE* out = nullptr;
  int port = 0;
};

// Starts kvmemd with the given flags and waits for its READY line.
Daemon Start(const std::vector<std::string>& flags) {
  int pipe_fds[2];
  EXPECT_EQ(pipe(pipe_fds), 0);
  Daemon d;
  d.pid = fork();
  if (d.pid == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    close(pipe_fds[0]);
    std::vector<char*> argv = {const_cast<char*>(KVMEMD_PATH)};
    for (const std::string& f : flags) argv.push_back(const_cast<char*>(f.c_str()));
    argv.push_back(nullptr);
    execv(KVMEMD_PATH, argv.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  d.out = fdopen(pipe_fds[0], "r");
  char line[256];
  while (std::fgets(line, sizeof line, d.out) != nullptr) {
    if (std::sscanf(line, "READY port=%d", &d.port) == 1) break;
  }
  return d;
}

int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

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
  Daemon d = Start(
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
  const std::string seqs =
      RunShell(std::string(KVMEMCTL_PATH) + " --target=" + target + " sequences");
  EXPECT_THAT(seqs, HasSubstr("window"));
  const std::string stats = RunShell(std::string(KVMEMCTL_PATH) + " --target=" + target + " stats");
  EXPECT_THAT(stats, HasSubstr("1 active"));

  // The client stays connected: a drain must not wait for idle workers to hang up.
  const auto start = std::chrono::steady_clock::now();
  kill(d.pid, SIGTERM);
  EXPECT_EQ(WaitExit(d.pid), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  fclose(d.out);
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

}  // namespace
