#include "kvmem/attach.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvmem/v1/attach.h"

namespace kvmem::client {
namespace wire = v1::attach;
namespace {

// The daemon answers at once; a daemon that hangs must not hang its client.
constexpr timeval kTimeout = {5, 0};

}  // namespace

absl::StatusOr<std::vector<ReceivedSegment>> ReceiveSegments(const SegmentTicket& ticket,
                                                             absl::string_view what) {
  if (ticket.ticket.size() != wire::kTicketBytes || ticket.socket.size() < 2 ||
      ticket.socket.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     ": the daemon gave no attach ticket (same-host attach is not offered "
                     "to this caller)"));
  }
  const int connection = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (connection < 0) {
    return absl::InternalError(absl::StrCat(what, ": socket: ", std::strerror(errno)));
  }
  absl::Cleanup close_connection = [connection] { close(connection); };
  setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &kTimeout, sizeof kTimeout);
  setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &kTimeout, sizeof kTimeout);
  sockaddr_un address;
  const socklen_t length = wire::SocketAddress(ticket.socket, &address);
  if (connect(connection, reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    return absl::UnavailableError(absl::StrCat(what, ": the daemon's attach socket ", ticket.socket,
                                               ": ", std::strerror(errno),
                                               " (is the daemon on this host?)"));
  }
  if (ticket.daemon_uid) {
    ucred peer{};
    socklen_t peer_length = sizeof peer;
    if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) != 0 ||
        peer.uid != *ticket.daemon_uid) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the attach socket ", ticket.socket, " is held by uid ", peer.uid,
                       ", not the daemon's ", *ticket.daemon_uid, " (the daemon is gone?)"));
    }
  }
  wire::Request request{};
  request.magic = wire::kMagic;
  request.version = wire::kVersion;
  std::memcpy(request.ticket, ticket.ticket.data(), wire::kTicketBytes);
  // A signal taken while waiting (a handler without SA_RESTART: a profiler's, a worker's
  // SIGCHLD) interrupts the wait, not the exchange: asked again, within the timeout's time.
  const absl::Time give_up = absl::Now() + absl::DurationFromTimeval(kTimeout);
  const auto interrupted = [&](ssize_t r) {
    return r < 0 && errno == EINTR && absl::Now() < give_up;
  };
  ssize_t sent;
  do {
    sent = send(connection, &request, sizeof request, MSG_NOSIGNAL);
  } while (interrupted(sent));
  if (sent != sizeof request) {
    return absl::UnavailableError(
        absl::StrCat(what, ": sending the ticket: ", std::strerror(errno)));
  }
  wire::Reply reply{};
  iovec io{&reply, sizeof reply};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * wire::kMaxSegments)] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  ssize_t got;
  do {
    got = recvmsg(connection, &message, MSG_CMSG_CLOEXEC);
  } while (interrupted(got));
  const int err = errno;
  if (got < 0) message.msg_controllen = 0;  // nothing arrived: no control data to walk
  std::vector<int> descriptors;
  for (cmsghdr* h = CMSG_FIRSTHDR(&message); h != nullptr; h = CMSG_NXTHDR(&message, h)) {
    if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
      const size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const size_t at = descriptors.size();
      descriptors.resize(at + n);
      std::memcpy(descriptors.data() + at, CMSG_DATA(h), n * sizeof(int));
    }
  }
  // Closed on every error; handed over on success.
  absl::Cleanup close_descriptors = [&descriptors] {
    for (int fd : descriptors) close(fd);
  };
  if (got != static_cast<ssize_t>(sizeof reply) || reply.magic != wire::kMagic ||
      reply.version != wire::kVersion) {
    return absl::UnavailableError(absl::StrCat(what, ": no answer from the daemon's attach socket ",
                                               ticket.socket, got < 0 ? ": " : "",
                                               got < 0 ? std::strerror(err) : ""));
  }
  reply.message[wire::kMessageBytes - 1] = '\0';
  if (reply.code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        absl::StrCat(what, ": kvmemd refused the attach: ", reply.message));
  }
  if ((message.msg_flags & MSG_CTRUNC) != 0 || reply.count > wire::kMaxSegments ||
      descriptors.size() != reply.count) {
    return absl::UnavailableError(absl::StrCat(what, ": the daemon's descriptors did not arrive"));
  }
  std::vector<ReceivedSegment> received;
  for (uint32_t i = 0; i < reply.count; ++i) {
    const wire::Granted& g = reply.segments[i];
    received.push_back({g.kind, g.writable != 0, g.bytes, descriptors[i]});
  }
  std::move(close_descriptors).Cancel();
  return received;
}

absl::StatusOr<uint8_t*> MapSegment(const SegmentTicket& ticket, uint32_t kind, uint64_t bytes,
                                    bool writable, absl::string_view what, uint8_t* at) {
  absl::StatusOr<std::vector<ReceivedSegment>> received = ReceiveSegments(ticket, what);
  if (!received.ok()) return received.status();
  absl::Cleanup close_all = [&received] {
    for (const ReceivedSegment& r : *received) close(r.fd);
  };
  for (const ReceivedSegment& r : *received) {
    if (r.kind != kind) continue;
    if (writable && !r.writable) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": granted read-only (kvmemd --in-place-writes makes it writable)"));
    }
    // A segment shorter than announced would fault (SIGBUS) where the mapping passes its end,
    // and so would one shrunk later: kvmemd seals every segment's size (shared_segment.h).
    struct stat st {};
    if (r.bytes < bytes || fstat(r.fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": smaller than the ", bytes, " bytes announced"));
    }
    const int seals = fcntl(r.fd, F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": its size is not sealed (it could shrink under a read)"));
    }
    void* data = mmap(at, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                      MAP_SHARED | (at != nullptr ? MAP_FIXED : 0), r.fd, 0);
    if (data == MAP_FAILED) {
      return absl::UnavailableError(absl::StrCat(what, ": mmap: ", std::strerror(errno)));
    }
    return static_cast<uint8_t*>(data);
  }
  return absl::FailedPreconditionError(absl::StrCat(what, ": the ticket grants no such segment"));
}

}  // namespace kvmem::client
