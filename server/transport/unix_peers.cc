#include "server/transport/unix_peers.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/common/mutex.h"
#include "spdlog/spdlog.h"

namespace kvmem::transport {

absl::StatusOr<std::unique_ptr<UnixPeers>> UnixPeers::Listen(const std::string& address,
                                                             Caps caps) {
  // The socket file keeps the umask's permissions, as gRPC's own listener would: who may
  // call is decided per call (a token, or a uid the token file maps).
  absl::StatusOr<UnixListener> listener =
      UnixListener::Listen(address, SOCK_STREAM, /*mode=*/0, "--listen");
  if (!listener.ok()) return listener.status();
  std::unique_ptr<UnixPeers> peers(new UnixPeers());
  peers->address_ = address;
  peers->caps_ = caps;
  peers->listener_ = *std::move(listener);
  peers->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (peers->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("--listen: eventfd: ", std::strerror(errno)));
  }
  return peers;
}

void UnixPeers::Serve(std::function<void(int)> serve) {
  if (acceptor_.joinable() || !listener_) return;
  serve_ = std::move(serve);
  acceptor_ = std::thread([this] { Accept(); });
}

void UnixPeers::Stop() {
  if (acceptor_.joinable()) {
    const uint64_t one = 1;
    (void)write(stop_fd_, &one, sizeof one);
    acceptor_.join();
  }
  listener_.reset();  // refuses new connections, removes the socket file
}

UnixPeers::~UnixPeers() {
  Stop();
  if (stop_fd_ >= 0) close(stop_fd_);
}

uint64_t UnixPeers::accepted() const {
  kvmem::MutexLock lock(&mu_);
  return accepted_;
}

uint64_t UnixPeers::refused() const {
  kvmem::MutexLock lock(&mu_);
  return refused_;
}

bool UnixPeers::UnderCaps(uid_t uid) const {
  if (peers_.size() >= caps_.connections) return false;
  if (peers_.size() < caps_.per_uid) return true;
  size_t same = 0;
  for (const auto& [fd, peer] : peers_) same += peer.credentials.uid == uid ? 1 : 0;
  return same < caps_.per_uid;
}

void UnixPeers::Sweep() {
  // Only this thread (the acceptor) changes the table: the stats run without the lock, so
  // that the calls looking peers up never wait on them.
  std::vector<std::pair<int, Peer>> entries;
  {
    kvmem::MutexLock lock(&mu_);
    entries.assign(peers_.begin(), peers_.end());
  }
  std::vector<int> gone;
  for (const auto& [fd, peer] : entries) {
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_dev != peer.dev || st.st_ino != peer.ino) gone.push_back(fd);
  }
  kvmem::MutexLock lock(&mu_);
  for (int fd : gone) peers_.erase(fd);
}

void UnixPeers::Accept() {
  pthread_setname_np(pthread_self(), "kvmem_accept");
  pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {listener_->fd(), POLLIN, 0}};
  while (true) {
    fds[0].revents = fds[1].revents = 0;
    if (poll(fds, 2, -1) < 0 && errno != EINTR) {
      spdlog::error("--listen {}: poll: {}; no longer accepting", address(), std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents == 0) continue;
    const int connection = accept4(listener_->fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::warn("--listen {}: accept: {}; retrying in 100 ms", address(),
                     std::strerror(errno));
        poll(fds, 1, 100);  // returns early on Stop
      }
      continue;  // EAGAIN, ECONNABORTED, EINTR: the next one
    }
    Peer peer{};
    socklen_t length = sizeof peer.credentials;
    struct stat st {};
    if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer.credentials, &length) != 0 ||
        fstat(connection, &st) != 0) {
      close(connection);
      continue;
    }
    peer.dev = st.st_dev;
    peer.ino = st.st_ino;
    bool admitted;
    {
      kvmem::MutexLock lock(&mu_);
      // A number that a connection of ours had before is a new connection now.
      peers_.erase(connection);
      admitted = UnderCaps(peer.credentials.uid);
    }
    // At a cap: the entries of connections gone are dropped (a stat each, at most every
    // kSweepEvery), then it is asked again.
    if (!admitted && absl::Now() - last_sweep_ >= kSweepEvery) {
      Sweep();
      last_sweep_ = absl::Now();
      kvmem::MutexLock lock(&mu_);
      admitted = UnderCaps(peer.credentials.uid);
    }
    {
      kvmem::MutexLock lock(&mu_);
      if (!admitted) {
        ++refused_;
      } else {
        peers_[connection] = peer;  // before the first call on it can ask
        ++accepted_;
      }
    }
    if (!admitted) {
      close(connection);
      continue;
    }
    serve_(connection);
  }
}

std::optional<ucred> UnixPeers::PeerOf(absl::string_view peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd) || fd < 0) {
    return std::nullopt;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return std::nullopt;
  kvmem::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end() || it->second.dev != st.st_dev || it->second.ino != st.st_ino) {
    return std::nullopt;
  }
  return it->second.credentials;
}

}  // namespace kvmem::transport
