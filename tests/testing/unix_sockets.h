#pragma once
// What the attach tests share: a raw connection to a unix socket address as kvmemd names it
// ("@name" abstract, else a path), and the names POSIX shared memory has in /dev/shm.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "kvmem/v1/attach.h"

namespace kvmem::testing {

// A connection to `address` (SOCK_SEQPACKET: the attach socket's kind; SOCK_STREAM: gRPC's),
// or -1.
inline int ConnectUnix(const std::string& address, int type = SOCK_SEQPACKET) {
  const int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  sockaddr_un addr;
  const socklen_t length = v1::attach::SocketAddress(address, &addr);
  if (fd >= 0 && connect(fd, reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The names in /dev/shm (where POSIX shared memory lives).
inline std::set<std::string> ShmNames() {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    names.insert(entry.path().filename());
  }
  return names;
}

}  // namespace kvmem::testing
