// SharedSegment: page population stays inside the segment; a segment has no name and its
// size is sealed. AttachSocket: descriptors go only with a valid ticket, to a served uid,
// read-only where granted so.
#include "server/transport/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvmem/attach.h"
#include "kvmem/v1/attach.h"
#include "server/transport/attach_socket.h"
#include "tests/testing/unix_sockets.h"

namespace kvmem::transport {
namespace {

namespace wire = v1::attach;

uint64_t PageBytes() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

TEST(SharedSegmentTest, PopulateTakesRangesInsideTheSegmentOnly) {
  auto segment = *SharedSegment::Create("kvmem-test", 3 * PageBytes() + 100);
  absl::Status s = segment->Populate(0, 1);
  if (s.code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << s;
  ASSERT_TRUE(s.ok()) << s;
  // An unaligned start, the partial last page, an empty range at the end.
  EXPECT_TRUE(segment->Populate(PageBytes() + 7, 2 * PageBytes() + 93).ok());
  EXPECT_TRUE(segment->Populate(segment->bytes(), 0).ok());
  EXPECT_EQ(segment->Populate(segment->bytes(), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(segment->Populate(1, segment->bytes()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(segment->Populate(~uint64_t{0}, 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SharedSegmentTest, HasNoNameAndASealedSize) {
  const std::set<std::string> before = testing::ShmNames();
  auto segment = *SharedSegment::Create("kvmem-test", 2 * PageBytes());
  EXPECT_EQ(testing::ShmNames(), before);
  EXPECT_NE(ftruncate(segment->fd(), PageBytes()), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(segment->fd(), 4 * PageBytes()), 0);
  EXPECT_NE(fallocate(segment->fd(), 0, 0, 8 * PageBytes()), 0);
  // Sealed against writers: the daemon's own mapping still writes (and populates).
  ASSERT_TRUE(segment->Seal(/*writers_too=*/true).ok());
  segment->data()[0] = 7;
  EXPECT_EQ(segment->data()[0], 7);
  const absl::Status populated = segment->Populate(0, segment->bytes());
  EXPECT_TRUE(populated.ok() || populated.code() == absl::StatusCode::kUnimplemented) << populated;
  EXPECT_EQ(mmap(nullptr, PageBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd(), 0),
            MAP_FAILED);
  EXPECT_FALSE(segment->Seal(false).ok());  // no seal after the last
}

class AttachSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    segment_ = *SharedSegment::Create("kvmem-test", 2 * PageBytes());
    std::memcpy(segment_->data(), "daemon's bytes", 15);
  }
  std::unique_ptr<AttachSocket> Start(AttachSocket::Options options = {}) {
    auto socket = AttachSocket::Start(std::move(options));
    EXPECT_TRUE(socket.ok()) << socket.status();
    return socket.ok() ? *std::move(socket) : nullptr;
  }
  client::SegmentTicket Ticket(AttachSocket& socket, bool writable,
                               const std::string& issuer = "") {
    return {socket.address(), socket.Issue({{wire::kPool, segment_, writable}}, issuer), getuid()};
  }
  std::shared_ptr<SharedSegment> segment_;
};

TEST_F(AttachSocketTest, AReadOnlyGrantCannotBeMappedWritable) {
  ASSERT_TRUE(segment_->Seal(/*writers_too=*/true).ok());  // as kvmemd seals read-only ones
  auto socket = Start();
  auto received = client::ReceiveSegments(Ticket(*socket, false), "pool");
  ASSERT_TRUE(received.ok()) << received.status();
  ASSERT_EQ(received->size(), 1u);
  const client::ReceivedSegment& r = (*received)[0];
  EXPECT_EQ(r.kind, wire::kPool);
  EXPECT_FALSE(r.writable);
  EXPECT_EQ(r.bytes, segment_->bytes());
  EXPECT_EQ(mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  void* read = mmap(nullptr, r.bytes, PROT_READ, MAP_SHARED, r.fd, 0);
  ASSERT_NE(read, MAP_FAILED);
  EXPECT_STREQ(static_cast<const char*>(read), "daemon's bytes");
  munmap(read, r.bytes);
  EXPECT_NE(ftruncate(r.fd, 0), 0);
  // Nor reopened writable through /proc (same uid: the mode does not stop it, the seal does).
  const int reopened = open(("/proc/self/fd/" + std::to_string(r.fd)).c_str(), O_RDWR);
  if (reopened >= 0) {
    EXPECT_EQ(mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0), MAP_FAILED);
    EXPECT_EQ(write(reopened, "x", 1), -1);
    close(reopened);
  }
  close(r.fd);
  // MapSegment says so too.
  auto writable = client::MapSegment(Ticket(*socket, false), wire::kPool, r.bytes, true, "pool");
  EXPECT_EQ(writable.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(AttachSocketTest, AWritableGrantWritesTheDaemonsMemoryAndATicketServesTwice) {
  ASSERT_TRUE(segment_->Seal(/*writers_too=*/false).ok());
  auto socket = Start();
  const client::SegmentTicket ticket = Ticket(*socket, true);
  auto mapped = client::MapSegment(ticket, wire::kPool, segment_->bytes(), true, "pool");
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  std::memcpy(*mapped, "client's bytes", 15);
  EXPECT_STREQ(reinterpret_cast<const char*>(segment_->data()), "client's bytes");
  munmap(*mapped, segment_->bytes());
  auto again = client::MapSegment(ticket, wire::kPool, segment_->bytes(), false, "pool");
  ASSERT_TRUE(again.ok()) << again.status();
  munmap(*again, segment_->bytes());
  // The client checks who holds the socket: the daemon's uid, or no hearing.
  client::SegmentTicket checked = ticket;
  checked.daemon_uid = geteuid();
  auto checked_ok = client::MapSegment(checked, wire::kPool, segment_->bytes(), false, "pool");
  ASSERT_TRUE(checked_ok.ok()) << checked_ok.status();
  munmap(*checked_ok, segment_->bytes());
  checked.daemon_uid = geteuid() + 1;
  auto impostor = client::MapSegment(checked, wire::kPool, segment_->bytes(), false, "pool");
  EXPECT_EQ(impostor.status().code(), absl::StatusCode::kUnavailable) << impostor.status();
  EXPECT_NE(impostor.status().message().find("held by uid"), absl::string_view::npos);
  // A kind the ticket does not grant; a size past the segment's.
  EXPECT_EQ(client::MapSegment(ticket, wire::kTableArea, 1, false, "area").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      client::MapSegment(ticket, wire::kPool, segment_->bytes() + 1, false, "pool").status().code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(AttachSocketTest, ForgedExpiredPushedOutAndOrphanedTicketsGetNothing) {
  AttachSocket::Options options;
  options.tickets_per_issuer = 2;
  auto socket = Start(options);
  const client::SegmentTicket others = Ticket(*socket, false, "another tenant");
  client::SegmentTicket forged = Ticket(*socket, false);
  forged.ticket[5] = static_cast<char>(forged.ticket[5] ^ 0x20);
  EXPECT_EQ(client::ReceiveSegments(forged, "pool").status().code(),
            absl::StatusCode::kUnauthenticated);
  // The issuer's oldest of three goes when it may have two outstanding; another issuer's
  // ticket stays.
  const client::SegmentTicket first = Ticket(*socket, false);
  const client::SegmentTicket second = Ticket(*socket, false);
  const client::SegmentTicket third = Ticket(*socket, false);
  EXPECT_EQ(socket->outstanding(), 3u);
  EXPECT_EQ(client::ReceiveSegments(first, "pool").status().code(),
            absl::StatusCode::kUnauthenticated);
  for (const client::SegmentTicket& t : {second, third, others}) {
    auto kept = client::ReceiveSegments(t, "pool");
    ASSERT_TRUE(kept.ok()) << kept.status();
    for (const client::ReceivedSegment& r : *kept) close(r.fd);
  }
  // A segment gone before its ticket was redeemed (a step channel that closed).
  auto channel = *SharedSegment::Create("kvmem-test", PageBytes());
  const client::SegmentTicket orphan{
      socket->address(), socket->Issue({{wire::kChannel, channel, true}}, ""), getuid()};
  channel.reset();
  EXPECT_EQ(client::ReceiveSegments(orphan, "channel").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Expired.
  AttachSocket::Options brief;
  brief.ticket_life = absl::Milliseconds(1);
  auto short_lived = Start(brief);
  const client::SegmentTicket expired = Ticket(*short_lived, false);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(client::ReceiveSegments(expired, "pool").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(short_lived->outstanding(), 0u);
}

TEST_F(AttachSocketTest, APeerOfAnotherUidGetsNothing) {
  AttachSocket::Options options;
  options.uids = {getuid() + 1};
  auto socket = Start(options);
  // kvmemd's own uid is served whatever the list says.
  auto own = client::ReceiveSegments(Ticket(*socket, false), "pool");
  ASSERT_TRUE(own.ok()) << own.status();
  for (const client::ReceivedSegment& r : *own) close(r.fd);
  // A peer of another uid: a child that drops to it (as root only).
  if (getuid() != 0) GTEST_SKIP() << "needs root to run a peer of another uid";
  const client::SegmentTicket ticket = Ticket(*socket, false);
  const pid_t child = fork();
  if (child == 0) {
    if (setuid(getuid() + 2) != 0) _exit(90);
    auto refused = client::ReceiveSegments(ticket, "pool");
    const bool ok = refused.status().code() == absl::StatusCode::kPermissionDenied &&
                    refused.status().message().find("--attach-uids") != absl::string_view::npos;
    _exit(ok ? 0 : 91);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// A socket file path: a live daemon's is never taken, a dead one's (this user's) is, another
// kind of file is never removed, and each daemon removes only its own file.
TEST_F(AttachSocketTest, APathIsTakenOnlyFromADeadDaemon) {
  const std::string path = ::testing::TempDir() + "/kvmem_attach_" + std::to_string(getpid());
  unlink(path.c_str());
  AttachSocket::Options at_path;
  at_path.address = path;
  {
    auto first = Start(at_path);
    ASSERT_NE(first, nullptr);
    auto second = AttachSocket::Start(at_path);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
    auto received = client::ReceiveSegments(Ticket(*first, false), "pool");  // still serving
    ASSERT_TRUE(received.ok()) << received.status();
    for (const client::ReceivedSegment& r : *received) close(r.fd);
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0);  // removed with its daemon
  {
    // A socket file left by a daemon that died (bound, never unlinked).
    const int dead = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.data(), path.size());
    ASSERT_EQ(bind(dead, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
    close(dead);
    auto taken = Start(at_path);
    ASSERT_NE(taken, nullptr);
  }
  {
    std::ofstream(path) << "not a socket";
    auto refused = AttachSocket::Start(at_path);
    EXPECT_FALSE(refused.ok());
    EXPECT_EQ(access(path.c_str(), F_OK), 0);  // left alone
    unlink(path.c_str());
  }
}

// Peers that connect and say nothing are refused at their deadline, side by side: a client
// behind many of them is served at once (one thread served them one at a time before, half
// a second each).
TEST_F(AttachSocketTest, SilentPeersDoNotDelayAClient) {
  auto socket = Start();
  std::vector<int> silent;
  for (int i = 0; i < 20; ++i) {
    const int fd = testing::ConnectUnix(socket->address());
    ASSERT_GE(fd, 0);
    silent.push_back(fd);
  }
  const absl::Time start = absl::Now();
  auto received = client::ReceiveSegments(Ticket(*socket, false), "pool");
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(received.ok()) << received.status();
  for (const client::ReceivedSegment& r : *received) close(r.fd);
  EXPECT_LT(took, absl::Seconds(1));
  for (int fd : silent) close(fd);
}

// A client slow to send its request after connecting (descheduled on a loaded host) is
// served: half a second was refused before (the deadline was 200 ms).
TEST_F(AttachSocketTest, AClientSlowToSendIsServed) {
  auto socket = Start();
  const client::SegmentTicket ticket = Ticket(*socket, false);
  const int fd = testing::ConnectUnix(socket->address());
  ASSERT_GE(fd, 0);
  absl::SleepFor(absl::Milliseconds(500));
  wire::Request request{};
  request.magic = wire::kMagic;
  request.version = wire::kVersion;
  std::memcpy(request.ticket, ticket.ticket.data(), wire::kTicketBytes);
  ASSERT_EQ(send(fd, &request, sizeof request, 0), static_cast<ssize_t>(sizeof request));
  wire::Reply reply{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec io{&reply, sizeof reply};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  ASSERT_EQ(recvmsg(fd, &message, MSG_CMSG_CLOEXEC), static_cast<ssize_t>(sizeof reply));
  close(fd);
  EXPECT_EQ(reply.code, 0u) << reply.message;
  ASSERT_EQ(reply.count, 1u);
  const cmsghdr* h = CMSG_FIRSTHDR(&message);
  ASSERT_NE(h, nullptr);
  int granted = -1;
  std::memcpy(&granted, CMSG_DATA(h), sizeof granted);
  EXPECT_GE(granted, 0);
  close(granted);
}

// Garbage on the socket (a short message, a wrong magic, a silent peer) gets a refusal or
// a timeout, and the socket serves the next client.
TEST_F(AttachSocketTest, MalformedRequestsAreRefusedAndTheSocketServesOn) {
  auto socket = Start();
  auto raw = [&](const std::string& bytes) {
    const int fd = testing::ConnectUnix(socket->address());
    EXPECT_GE(fd, 0);
    if (!bytes.empty()) send(fd, bytes.data(), bytes.size(), 0);
    wire::Reply reply{};
    const ssize_t got = recv(fd, &reply, sizeof reply, 0);
    close(fd);
    return got == static_cast<ssize_t>(sizeof reply) ? reply.code : 0xFFFFFFFFu;
  };
  EXPECT_EQ(raw("short"), 3u);  // INVALID_ARGUMENT
  wire::Request wrong{};
  wrong.magic = 1;
  EXPECT_EQ(raw(std::string(reinterpret_cast<const char*>(&wrong), sizeof wrong)), 3u);
  wire::Request zero{};
  zero.magic = wire::kMagic;
  zero.version = wire::kVersion;
  EXPECT_EQ(raw(std::string(reinterpret_cast<const char*>(&zero), sizeof zero)), 16u);
  EXPECT_EQ(raw(""), 4u);  // said nothing: timed out, refused (DEADLINE_EXCEEDED)
  auto received = client::ReceiveSegments(Ticket(*socket, true), "pool");
  ASSERT_TRUE(received.ok()) << received.status();
  for (const client::ReceivedSegment& r : *received) close(r.fd);
}

}  // namespace
}  // namespace kvmem::transport
