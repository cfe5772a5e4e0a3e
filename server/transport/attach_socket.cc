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
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvmem/v1/attach.h"
#include "server/common/mutex.h"

namespace kvmem::transport {
namespace wire = v1::attach;
namespace {

// google.rpc.Code values of the refusals.
constexpr uint32_t kInvalidArgument = 3, kPermissionDenied = 7, kFailedPrecondition = 9,
                   kInternal = 13, kUnauthenticated = 16;

// How long one peer may take to send its request or take its reply.
constexpr timeval kPeerTimeout = {0, 500 * 1000};

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

// The sockaddr of `address` and its length ("@name": abstract).
socklen_t Address(const std::string& address, sockaddr_un* out) {
  *out = {};
  out->sun_family = AF_UNIX;
  std::memcpy(out->sun_path, address.data(), address.size());
  if (address[0] == '@') out->sun_path[0] = '\0';
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
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
  if (options.address.size() < 2 || options.address.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("attach socket \"", options.address, "\": 2 to ",
                                                   sizeof(sockaddr_un::sun_path) - 1,
                                                   " characters"));
  }
  if (options.uids.empty()) options.uids.push_back(getuid());
  std::unique_ptr<AttachSocket> socket(new AttachSocket(std::move(options)));
  const std::string& address = socket->options_.address;
  const bool abstract = address[0] == '@';
  socket->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (socket->listen_fd_ < 0) {
    return absl::InternalError(absl::StrCat("attach socket: socket: ", std::strerror(errno)));
  }
  if (!abstract) {
    // A socket file a daemon before this one left (never another kind of file).
    struct stat st {};
    if (lstat(address.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(address.c_str());
  }
  sockaddr_un addr;
  const socklen_t length = Address(address, &addr);
  if (bind(socket->listen_fd_, reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("attach socket \"", address, "\": bind: ", std::strerror(errno)));
  }
  if (!abstract) {
    // Only the daemon's user connects unless other uids are served (SO_PEERCRED still
    // decides who gets anything).
    const bool others = std::any_of(socket->options_.uids.begin(), socket->options_.uids.end(),
                                    [](uid_t uid) { return uid != getuid(); });
    chmod(address.c_str(), others ? 0666 : 0600);
  }
  if (listen(socket->listen_fd_, 64) != 0) {
    return absl::InternalError(
        absl::StrCat("attach socket \"", address, "\": listen: ", std::strerror(errno)));
  }
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
  if (listen_fd_ >= 0) close(listen_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
  if (!options_.address.empty() && options_.address[0] != '@') unlink(options_.address.c_str());
}

std::string AttachSocket::Issue(std::vector<Grant> grants) {
  std::string ticket = RandomBytes(wire::kTicketBytes);
  const absl::Time now = absl::Now();
  kvmem::MutexLock lock(&mu_);
  DropExpired(now);
  while (order_.size() >= options_.max_tickets) {
    tickets_.erase(order_.front());
    order_.pop_front();
  }
  tickets_[ticket] = Ticket{std::move(grants), now + options_.ticket_life};
  order_.push_back(ticket);
  return ticket;
}

size_t AttachSocket::outstanding() const {
  kvmem::MutexLock lock(&mu_);
  return tickets_.size();
}

void AttachSocket::DropExpired(absl::Time now) {
  while (!order_.empty()) {
    auto it = tickets_.find(order_.front());
    if (it != tickets_.end() && it->second.expires > now) break;
    if (it != tickets_.end()) tickets_.erase(it);
    order_.pop_front();
  }
}

absl::StatusOr<std::vector<AttachSocket::Grant>> AttachSocket::Redeem(const std::string& ticket) {
  kvmem::MutexLock lock(&mu_);
  DropExpired(absl::Now());
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return absl::NotFoundError(
        "the ticket is unknown or expired: ask for a new one (GetInfo or OpenStepChannel)");
  }
  return it->second.grants;
}

void AttachSocket::Serve() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int connection = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Answer(connection);
    close(connection);
  }
}

void AttachSocket::Answer(int connection) {
  setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &kPeerTimeout, sizeof kPeerTimeout);
  setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &kPeerTimeout, sizeof kPeerTimeout);
  wire::Request request{};
  // One larger than a request: a longer message is truncated to it and refused. Read before
  // any refusal, so that the peer gets the refusal rather than a reset connection.
  char buffer[sizeof request + 1];
  const ssize_t got = recv(connection, buffer, sizeof buffer, 0);
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
