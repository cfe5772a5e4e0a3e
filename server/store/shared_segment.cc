#include "server/store/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvmem::store {

absl::StatusOr<std::unique_ptr<SharedSegment>> SharedSegment::Create(const std::string& prefix,
                                                                     uint64_t bytes) {
  static std::atomic<uint32_t> counter{0};
  const std::string name = absl::StrCat("/", prefix, "-", getpid(), "-", counter++);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", name, ": cannot size to ",
                                                     bytes, " bytes: ", std::strerror(err)));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory ", name, ": mmap of ", bytes, " bytes: ", std::strerror(err)));
  }
  return std::unique_ptr<SharedSegment>(
      new SharedSegment(name, static_cast<uint8_t*>(data), bytes));
}

SharedSegment::~SharedSegment() {
  munmap(data_, bytes_);
  shm_unlink(name_.c_str());
}

}  // namespace kvmem::store
