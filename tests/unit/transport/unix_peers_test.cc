// UnixPeers: each accepted connection's peer credentials come from the kernel, a peer name
// answers only while its descriptor is still that connection's socket, and another uid is
// told apart (root only: a child that drops to it).
#include "server/transport/unix_peers.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/common/mutex.h"
#include "tests/testing/unix_sockets.h"

namespace kvmem::transport {
namespace {

int ConnectStream(const std::string& address) { return testing::ConnectUnix(address, SOCK_STREAM); }

class UnixPeersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    address_ = absl::StrCat(::testing::TempDir(), "/kvmem_peers_", getpid());
    auto peers = UnixPeers::Listen(address_, caps_);
    ASSERT_TRUE(peers.ok()) << peers.status();
    peers_ = *std::move(peers);
    peers_->Serve([this](int fd) {
      kvmem::MutexLock lock(&mu_);
      served_.push_back(fd);
    });
  }
  void TearDown() override {
    peers_.reset();
    for (int fd : served_) close(fd);
  }
  // The descriptor kvmemd's side got for the `n`-th connection (waits for it).
  int Served(size_t n) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      {
        kvmem::MutexLock lock(&mu_);
        if (n < served_.size()) return served_[n];
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return -1;
  }

  std::string address_;
  UnixPeers::Caps caps_;
  std::unique_ptr<UnixPeers> peers_;
  absl::Mutex mu_;
  std::vector<int> served_ ABSL_GUARDED_BY(mu_);
};

TEST_F(UnixPeersTest, APeersCredentialsAreTheKernelsAndAnswerOnlyForItsSocket) {
  const int client = ConnectStream(address_);
  ASSERT_GE(client, 0);
  const int fd = Served(0);
  ASSERT_GE(fd, 0);
  std::optional<ucred> peer = peers_->PeerOf(absl::StrCat("fd:", fd));
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->uid, getuid());
  EXPECT_EQ(peer->pid, getpid());
  EXPECT_EQ(peers_->accepted(), 1u);
  for (const std::string& name :
       {std::string("fd:"), std::string("fd:-1"), std::string("fd:x"),
        absl::StrCat("unix:", address_), absl::StrCat(" fd:", fd), absl::StrCat("fd:", client)}) {
    EXPECT_FALSE(peers_->PeerOf(name).has_value()) << name;
  }
  // The connection goes and its number is taken by a file: the name no longer answers.
  close(client);
  {
    kvmem::MutexLock lock(&mu_);
    close(fd);
    served_.clear();
  }
  const int file = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(file, 0);
  if (file == fd) {
    EXPECT_FALSE(peers_->PeerOf(absl::StrCat("fd:", fd)).has_value());
  }
  close(file);
  // A later connection under any number answers with its own peer.
  const int again = ConnectStream(address_);
  ASSERT_GE(again, 0);
  const int fd2 = Served(0);
  EXPECT_TRUE(peers_->PeerOf(absl::StrCat("fd:", fd2)).has_value());
  close(again);
}

class CappedUnixPeersTest : public UnixPeersTest {
 protected:
  void SetUp() override {
    caps_.per_uid = 3;
    UnixPeersTest::SetUp();
  }
};

// A uid holds at most its cap of connections; one that goes makes room.
TEST_F(CappedUnixPeersTest, AUidHoldsAtMostItsCapOfConnections) {
  std::vector<int> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(ConnectStream(address_));
    ASSERT_GE(Served(i), 0);
  }
  const int fourth = ConnectStream(address_);
  ASSERT_GE(fourth, 0);  // the kernel accepts it into the backlog; kvmemd closes it
  char byte = 0;
  EXPECT_EQ(read(fourth, &byte, 1), 0);  // closed: end of file
  EXPECT_EQ(peers_->refused(), 1u);
  EXPECT_EQ(peers_->accepted(), 3u);
  close(fourth);
  // One goes (kvmemd's side closes it, as gRPC would): the next is served.
  {
    kvmem::MutexLock lock(&mu_);
    close(served_[0]);
    served_.erase(served_.begin());
  }
  close(clients[0]);
  clients.erase(clients.begin());
  absl::SleepFor(absl::Milliseconds(150));  // past the last sweep's wait
  clients.push_back(ConnectStream(address_));
  ASSERT_GE(Served(2), 0);
  EXPECT_EQ(peers_->accepted(), 4u);
  for (int fd : clients) close(fd);
}

TEST_F(UnixPeersTest, StopRefusesNewConnectionsAndRemovesTheFile) {
  peers_->Stop();
  EXPECT_LT(ConnectStream(address_), 0);
  EXPECT_NE(access(address_.c_str(), F_OK), 0);
}

TEST_F(UnixPeersTest, APeerOfAnotherUidIsToldApart) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to run a peer of another uid";
  chmod(address_.c_str(), 0666);
  const uid_t other = getuid() + 2;
  const pid_t child = fork();
  if (child == 0) {
    if (setuid(other) != 0) _exit(90);
    const int fd = ConnectStream(address_);
    char byte = 0;
    (void)!read(fd, &byte, 1);  // held open until the parent has looked
    _exit(fd >= 0 ? 0 : 91);
  }
  const int fd = Served(0);
  ASSERT_GE(fd, 0);
  std::optional<ucred> peer = peers_->PeerOf(absl::StrCat("fd:", fd));
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->uid, other);
  EXPECT_EQ(peer->pid, child);
  (void)!write(fd, "x", 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace kvmem::transport
