#include "server/transport/attach_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvmem/v1/attach.h"
#include "server/common/mutex.h"

namespace kvmem::transport {
namespace wire = v1::attach;
namespace {

// google.rpc.Code values of the refusals.
constexpr uint32_t kInvalidArgument = 3, kDeadlineExceeded = 4, kPermissionDenied = 7,
                   kFailedPrecondition = 9, kInternal = 13, kUnauthenticated = 16;

// How long one peer may take to take its reply (a few hundred bytes: its socket buffer
// holds them, so a send waits only on a peer that stopped reading mid-way).
constexpr timeval kPeerTimeout = {0, 100 * 1000};

std::string RandomBytes(size_t n) {
  std::string bytes(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(bytes.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) std::abort();  // the kernel's generator never fails after boot
    got += static_cast<size_t>(r);
  }
  return bytes;
}

void Refuse(int connection, uint32_t code, const std::string& message) {
  wire::Reply reply{};
  reply.magic = wire::kMagic;
  reply.version = wire::kVersion;
  reply.code = code;
  std::memcpy(reply.message, message.data(),
              std::min<size_t>(message.size(), wire::kMessageBytes - 1));
  (void)send(connection, &reply, sizeof reply, MSG_NOSIGNAL);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttachSocket>> AttachSocket::Start(Options options) {
  if (options.address.empty()) {
    options.address =
        absl::StrCat("@kvmemd-", getpid(), "-", absl::BytesToHexString(RandomBytes(8)));
  }
  // Only the daemon's user connects unless other uids are served (SO_PEERCRED still decides
  // who gets anything).
  const bool others = std::any_of(options.uids.begin(), options.uids.end(),
                                  [](uid_t uid) { return uid != getuid(); });
  options.uids.push_back(getuid());  // kvmemd's own user always
  absl::StatusOr<UnixListener> listener = UnixListener::Listen(
      options.address, SOCK_SEQPACKET, others ? 0666 : 0600, "--attach-socket");
  if (!listener.ok()) return listener.status();
  std::unique_ptr<AttachSocket> socket(new AttachSocket(std::move(options)));
  socket->listener_ = *std::move(listener);
  socket->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (socket->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("attach socket: eventfd: ", std::strerror(errno)));
  }
  socket->server_ = std::thread([s = socket.get()] { s->Serve(); });
  return socket;
}

AttachSocket::~AttachSocket() {
  if (server_.joinable()) {
    const uint64_t one = 1;
    (void)write(stop_fd_, &one, sizeof one);
    server_.join();
  }
  if (stop_fd_ >= 0) close(stop_fd_);
}

std::string AttachSocket::Issue(std::vector<Grant> grants, const std::string& issuer) {
  std::string ticket = RandomBytes(wire::kTicketBytes);
  const absl::Time now = absl::Now();
  kvmem::MutexLock lock(&mu_);
  std::deque<std::string>& order = issued_[issuer];
  Trim(order, options_.tickets_per_issuer, now);
  tickets_[ticket] = Ticket{std::move(grants), now + options_.ticket_life};
  order.push_back(ticket);
  return ticket;
}

size_t AttachSocket::outstanding() const {
  kvmem::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [ticket, t] : tickets_) n += t.expires > absl::Now() ? 1 : 0;
  return n;
}

void AttachSocket::Trim(std::deque<std::string>& order, size_t keep, absl::Time now) {
  while (!order.empty()) {
    auto it = tickets_.find(order.front());
    if (it != tickets_.end() && it->second.expires > now && order.size() < keep) break;
    if (it != tickets_.end()) tickets_.erase(it);
    order.pop_front();
  }
}

absl::StatusOr<std::vector<AttachSocket::Grant>> AttachSocket::Redeem(const std::string& ticket) {
  kvmem::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end() || it->second.expires <= absl::Now()) {
    return absl::NotFoundError(
        "the ticket is unknown or expired: ask for a new one (GetInfo or OpenStepChannel)");
  }
  return it->second.grants;
}

void AttachSocket::Serve() {
  struct Pending {
    int fd;
    absl::Time deadline;
    bool served;  // its uid is served: the other kind cannot push it out
  };
  // Peers of uids not served are answered (a refusal) but never hold more than a few
  // places, so that a flood of them delays no served client.
  constexpr size_t kMaxUnserved = 8;
  std::deque<Pending> pending;  // in accept (= deadline) order
  std::vector<pollfd> fds;
  const std::string late =
      absl::StrCat("no request within ", absl::FormatDuration(options_.request_deadline));
  auto refuse_and_close = [&late](int fd) {
    Refuse(fd, kDeadlineExceeded, late);
    close(fd);
  };
  while (true) {
    fds.clear();
    fds.push_back({stop_fd_, POLLIN, 0});
    fds.push_back({listener_->fd(), POLLIN, 0});
    for (const Pending& p : pending) fds.push_back({p.fd, POLLIN, 0});
    int timeout_ms = -1;
    if (!pending.empty()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(pending.front().deadline - absl::Now()) + 1));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // ENOMEM: try again
      continue;
    }
    if (fds[0].revents != 0) break;
    // Requests that came, answered in arrival order; the rest past their deadline refused.
    const absl::Time now = absl::Now();
    std::deque<Pending> waiting;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (fds[2 + i].revents != 0) {
        Answer(pending[i].fd);
        close(pending[i].fd);
      } else if (pending[i].deadline <= now) {
        refuse_and_close(pending[i].fd);
      } else {
        waiting.push_back(pending[i]);
      }
    }
    pending.swap(waiting);
    if ((fds[1].revents & POLLIN) != 0) {
      // At most a pending list's worth per round: the requests that came are read first.
      for (size_t accepted = 0; accepted < options_.max_pending; ++accepted) {
        const int connection = accept4(listener_->fd(), nullptr, nullptr, SOCK_CLOEXEC);
        if (connection < 0) {
          // Out of descriptors: try again shortly rather than spin on a ready socket.
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          break;
        }
        setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &kPeerTimeout, sizeof kPeerTimeout);
        ucred peer{};
        socklen_t peer_length = sizeof peer;
        const bool served =
            getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) == 0 &&
            std::find(options_.uids.begin(), options_.uids.end(), peer.uid) != options_.uids.end();
        // Past its kind's places, the oldest of that kind goes.
        size_t of_kind = 0;
        for (const Pending& p : pending) of_kind += p.served == served ? 1 : 0;
        if (of_kind >= (served ? options_.max_pending : kMaxUnserved)) {
          auto oldest = std::find_if(pending.begin(), pending.end(),
                                     [served](const Pending& p) { return p.served == served; });
          refuse_and_close(oldest->fd);
          pending.erase(oldest);
        }
        pending.push_back({connection, now + options_.request_deadline, served});
      }
    }
  }
  for (const Pending& p : pending) close(p.fd);
}

void AttachSocket::Answer(int connection) {
  wire::Request request{};
  // One larger than a request: a longer message is truncated to it and refused. Read before
  // any refusal, so that the peer gets the refusal rather than a reset connection. The
  // connection is ready (poll): this does not wait.
  char buffer[sizeof request + 1];
  const ssize_t got = recv(connection, buffer, sizeof buffer, MSG_DONTWAIT);
  ucred peer{};
  socklen_t peer_length = sizeof peer;
  if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) != 0) {
    Refuse(connection, kInternal, absl::StrCat("SO_PEERCRED: ", std::strerror(errno)));
    return;
  }
  if (std::find(options_.uids.begin(), options_.uids.end(), peer.uid) == options_.uids.end()) {
    Refuse(connection, kPermissionDenied,
           absl::StrCat("uid ", peer.uid, " is not served here (kvmemd --attach-uids)"));
    return;
  }
  if (got != static_cast<ssize_t>(sizeof request)) {
    Refuse(connection, kInvalidArgument,
           absl::StrCat("a request is one message of ", sizeof request, " bytes"));
    return;
  }
  std::memcpy(&request, buffer, sizeof request);
  if (request.magic != wire::kMagic || request.version != wire::kVersion) {
    Refuse(connection, kInvalidArgument,
           absl::StrCat("not an attach request of version ", wire::kVersion));
    return;
  }
  absl::StatusOr<std::vector<Grant>> grants =
      Redeem(std::string(reinterpret_cast<const char*>(request.ticket), wire::kTicketBytes));
  if (!grants.ok()) {
    Refuse(connection, kUnauthenticated, std::string(grants.status().message()));
    return;
  }
  // Held until the descriptors are sent: a segment closed meanwhile stays valid for this.
  std::vector<std::shared_ptr<const SharedSegment>> held;
  std::vector<int> descriptors, opened;
  wire::Reply reply{};
  reply.magic = wire::kMagic;
  reply.version = wire::kVersion;
  for (const Grant& grant : *grants) {
    std::shared_ptr<const SharedSegment> segment = grant.segment.lock();
    if (segment == nullptr || held.size() == wire::kMaxSegments) {
      for (int fd : opened) close(fd);
      Refuse(connection, kFailedPrecondition,
             "a segment of the ticket is gone (its step channel closed)");
      return;
    }
    int fd = segment->fd();
    if (!grant.writable) {
      // A new open file description, read-only: its holder cannot map it writable.
      fd = open(absl::StrCat("/proc/self/fd/", segment->fd()).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        for (int f : opened) close(f);
        Refuse(connection, kInternal,
               absl::StrCat("reopening a segment read-only: ", std::strerror(errno)));
        return;
      }
      opened.push_back(fd);
    }
    reply.segments[held.size()] = {grant.kind, grant.writable ? 1u : 0u, segment->bytes()};
    descriptors.push_back(fd);
    held.push_back(std::move(segment));
  }
  reply.count = static_cast<uint32_t>(descriptors.size());
  iovec io{&reply, sizeof reply};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * wire::kMaxSegments)] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  if (!descriptors.empty()) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * descriptors.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * descriptors.size());
    std::memcpy(CMSG_DATA(header), descriptors.data(), sizeof(int) * descriptors.size());
  }
  (void)sendmsg(connection, &message, MSG_NOSIGNAL);
  for (int fd : opened) close(fd);
}

}  // namespace kvmem::transport
