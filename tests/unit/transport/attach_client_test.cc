// The client's side of the attach socket (kvmem/attach.h) against a stand-in daemon.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvmem/attach.h"
#include "kvmem/v1/attach.h"

namespace kvmem {
namespace {

namespace wire = v1::attach;

// A stand-in daemon's attach socket at `name`, listening; -1 when it cannot be.
int Listen(const std::string& name) {
  const int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (listener < 0) return -1;
  sockaddr_un address;
  const socklen_t length = wire::SocketAddress(name, &address);
  if (bind(listener, reinterpret_cast<const sockaddr*>(&address), length) != 0 ||
      listen(listener, 1) != 0) {
    close(listener);
    return -1;
  }
  return listener;
}

// A client whose thread takes signals while it waits for the daemon's answer (a profiler's
// SIGPROF, a worker's SIGCHLD: handlers without SA_RESTART) still gets the answer: an
// interrupted wait is waited again, not taken for "no answer".
TEST(AttachClientTest, SignalsWhileWaitingDoNotLoseTheAnswer) {
  const std::string name = absl::StrCat("@kvmem-attach-client-test-", getpid());
  const int listener = Listen(name);
  ASSERT_GE(listener, 0);
  // The stand-in takes no SIGALRM (blocked in the thread it starts with): the test's does.
  sigset_t alarm_only, before;
  sigemptyset(&alarm_only);
  sigaddset(&alarm_only, SIGALRM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &alarm_only, &before), 0);
  std::thread daemon([listener] {
    const int c = accept(listener, nullptr, nullptr);
    if (c < 0) return;
    wire::Request request;
    (void)recv(c, &request, sizeof request, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a slow answer
    wire::Reply reply{};
    reply.magic = wire::kMagic;
    reply.version = wire::kVersion;
    reply.code = static_cast<uint32_t>(absl::StatusCode::kNotFound);
    std::strncpy(reply.message, "no such ticket", wire::kMessageBytes - 1);
    (void)send(c, &reply, sizeof reply, MSG_NOSIGNAL);
    close(c);
  });
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &before, nullptr), 0);
  struct sigaction on_alarm {
  }, old_action{};
  on_alarm.sa_handler = [](int) {};  // no SA_RESTART: a blocked call fails with EINTR
  sigemptyset(&on_alarm.sa_mask);
  ASSERT_EQ(sigaction(SIGALRM, &on_alarm, &old_action), 0);
  const itimerval every_ms{{0, 1000}, {0, 1000}};
  itimerval old_timer{};
  ASSERT_EQ(setitimer(ITIMER_REAL, &every_ms, &old_timer), 0);

  const auto got =
      client::ReceiveSegments({name, std::string(wire::kTicketBytes, 'x'), std::nullopt}, "test");

  const itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  sigaction(SIGALRM, &old_action, nullptr);
  daemon.join();
  close(listener);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_NE(got.status().message().find("no such ticket"), std::string::npos) << got.status();
}

// A segment granted with a size that is not sealed could be shrunk under the reader's
// mapping (SIGBUS where a read passes the new end): refused before it is mapped, however
// large it is now; the same segment sealed maps.
TEST(AttachClientTest, ASegmentWhoseSizeIsNotSealedIsRefused) {
  for (const bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "not sealed");
    const std::string name = absl::StrCat("@kvmem-attach-seal-test-", getpid(), "-", sealed);
    const int listener = Listen(name);
    ASSERT_GE(listener, 0);
    constexpr uint64_t kBytes = 1 << 16;
    const int segment = memfd_create("kvmem-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(segment, 0);
    ASSERT_EQ(ftruncate(segment, kBytes), 0);
    if (sealed) ASSERT_EQ(fcntl(segment, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    std::thread daemon([listener, segment] {
      const int c = accept(listener, nullptr, nullptr);
      if (c < 0) return;
      wire::Request request;
      (void)recv(c, &request, sizeof request, 0);
      wire::Reply reply{};
      reply.magic = wire::kMagic;
      reply.version = wire::kVersion;
      reply.count = 1;
      reply.segments[0] = {wire::kPool, 0, kBytes};
      iovec data{&reply, sizeof reply};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr m{};
      m.msg_iov = &data;
      m.msg_iovlen = 1;
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      cmsghdr* c_msg = CMSG_FIRSTHDR(&m);
      c_msg->cmsg_level = SOL_SOCKET;
      c_msg->cmsg_type = SCM_RIGHTS;
      c_msg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c_msg), &segment, sizeof segment);
      (void)sendmsg(c, &m, MSG_NOSIGNAL);
      close(c);
    });
    const absl::StatusOr<uint8_t*> mapped =
        client::MapSegment({name, std::string(wire::kTicketBytes, 'x'), std::nullopt}, wire::kPool,
                           kBytes, /*writable=*/false, "the pool");
    daemon.join();
    close(listener);
    close(segment);
    if (sealed) {
      ASSERT_TRUE(mapped.ok()) << mapped.status();
      munmap(*mapped, kBytes);
    } else {
      EXPECT_EQ(mapped.status().code(), absl::StatusCode::kFailedPrecondition) << mapped.status();
      EXPECT_NE(mapped.status().message().find("not sealed"), std::string::npos) << mapped.status();
    }
  }
}

}  // namespace
}  // namespace kvmem
