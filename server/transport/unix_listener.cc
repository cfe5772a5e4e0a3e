#include "server/transport/unix_listener.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvmem/v1/attach.h"
#include "spdlog/spdlog.h"

namespace kvmem::transport {

absl::StatusOr<UnixListener> UnixListener::Listen(const std::string& address, int type, mode_t mode,
                                                  absl::string_view what) {
  auto named = [&](absl::string_view why) {
    return absl::StrCat(what, " \"", address, "\": ", why);
  };
  if (address.size() < 2 || address.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        named(absl::StrCat("2 to ", sizeof(sockaddr_un::sun_path) - 1, " characters")));
  }
  UnixListener listener;
  listener.address_ = address;
  listener.fd_ = ::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener.fd_ < 0) {
    return absl::InternalError(named(absl::StrCat("socket: ", std::strerror(errno))));
  }
  const bool abstract = address[0] == '@';
  sockaddr_un addr;
  const socklen_t length = v1::attach::SocketAddress(address, &addr);
  struct stat st {};
  if (!abstract && lstat(address.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    // Removed only when it is this user's and nothing answers there; a live one, or another
    // user's, is not ours to take.
    const int probe = ::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const bool refused = probe >= 0 &&
                         connect(probe, reinterpret_cast<const sockaddr*>(&addr), length) != 0 &&
                         errno == ECONNREFUSED;
    if (probe >= 0) close(probe);
    if (!refused || st.st_uid != geteuid()) {
      return absl::FailedPreconditionError(named(
          absl::StrCat("in use (another kvmemd, or uid ", st.st_uid, "'s): pick another address")));
    }
    unlink(address.c_str());
  }
  if (bind(listener.fd_, reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    return absl::FailedPreconditionError(named(absl::StrCat("bind: ", std::strerror(errno))));
  }
  if (!abstract) {
    if (lstat(address.c_str(), &st) == 0) {
      listener.made_file_ = true;
      listener.file_dev_ = st.st_dev;
      listener.file_ino_ = st.st_ino;
    }
    // Not through a symlink put there since the bind.
    if (mode != 0) fchmodat(AT_FDCWD, address.c_str(), mode, AT_SYMLINK_NOFOLLOW);
  }
  if (listen(listener.fd_, 128) != 0) {
    return absl::InternalError(named(absl::StrCat("listen: ", std::strerror(errno))));
  }
  return listener;
}

UnixListener& UnixListener::operator=(UnixListener&& other) noexcept {
  if (this != &other) {
    Close();
    address_ = std::move(other.address_);
    fd_ = std::exchange(other.fd_, -1);
    made_file_ = std::exchange(other.made_file_, false);
    file_dev_ = other.file_dev_;
    file_ino_ = other.file_ino_;
  }
  return *this;
}

void UnixListener::set_mode(mode_t mode) const {
  struct stat st {};
  // Only the file this made, and not through a symlink put there since.
  if (made_file_ && lstat(address_.c_str(), &st) == 0 && st.st_dev == file_dev_ &&
      st.st_ino == file_ino_) {
    if (fchmodat(AT_FDCWD, address_.c_str(), mode, AT_SYMLINK_NOFOLLOW) != 0) {
      spdlog::warn("{}: chmod {:o}: {}", address_, mode, std::strerror(errno));
    }
  }
}

void UnixListener::Close() {
  if (fd_ >= 0) close(std::exchange(fd_, -1));
  struct stat st {};
  if (made_file_ && lstat(address_.c_str(), &st) == 0 && st.st_dev == file_dev_ &&
      st.st_ino == file_ino_) {
    unlink(address_.c_str());
  }
  made_file_ = false;
}

}  // namespace kvmem::transport
