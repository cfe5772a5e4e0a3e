#pragma once
// UnixListener: a listening unix socket at an address as kvmemd names one: "@name" in the
// abstract namespace (nothing on disk), anything else a socket file at that path. A socket
// file already at the path is taken over only when it is this user's and nothing answers
// there (left by a daemon that died); a live one, another user's, or a file of another
// kind is refused. The file it made is removed when the listener goes, and only if it is
// still that file.
#include <sys/stat.h>
#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmem::transport {

class UnixListener {
 public:
  // `type`: SOCK_STREAM or SOCK_SEQPACKET (the socket is non-blocking and close-on-exec);
  // `mode`: the socket file's permissions, 0 to leave what the umask gave; `what`: how
  // errors name the address (a flag).
  static absl::StatusOr<UnixListener> Listen(const std::string& address, int type, mode_t mode,
                                             absl::string_view what);
  UnixListener(UnixListener&& other) noexcept { *this = std::move(other); }
  UnixListener& operator=(UnixListener&& other) noexcept;
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  ~UnixListener() { Close(); }

  int fd() const { return fd_; }
  // Sets the socket file's permissions (nothing for an abstract name).
  void set_mode(mode_t mode) const;
  const std::string& address() const { return address_; }

 private:
  UnixListener() = default;
  void Close();

  std::string address_;
  int fd_ = -1;
  // The socket file this made (device and inode), removed at the end only if still it.
  bool made_file_ = false;
  dev_t file_dev_ = 0;
  ino_t file_ino_ = 0;
};

}  // namespace kvmem::transport
