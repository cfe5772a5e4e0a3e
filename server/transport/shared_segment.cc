#include "server/transport/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvmem::transport {
namespace {

// MemAvailable of /proc/meminfo in bytes, or 0 when it cannot be read. memfd's memory is
// bounded by no mount's size: a segment larger than this would be allocated into swap or
// the OOM killer.
uint64_t MemAvailable() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// posix_fallocate returns its error instead of setting errno, and may be interrupted.
int Allocate(int fd, off_t bytes) {
  int err = 0;
  do {
    err = posix_fallocate(fd, 0, bytes);
  } while (err == EINTR);
  return err;
}

}  // namespace

absl::StatusOr<std::shared_ptr<SharedSegment>> SharedSegment::Create(const std::string& label,
                                                                     uint64_t bytes, uint8_t* at) {
  if (bytes == 0 || bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory ", label, ": cannot map a segment of ", bytes, " bytes"));
  }
  if (const uint64_t available = MemAvailable(); available != 0 && bytes > available) {
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", label, ": cannot allocate ",
                                                     bytes, " bytes: the machine has ", available,
                                                     " bytes available (MemAvailable)"));
  }
  const int fd = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("memfd_create(", label, "): ", std::strerror(errno)));
  }
  auto fail = [&](absl::StatusCode code, absl::string_view what, int err) {
    close(fd);
    return absl::Status(
        code, absl::StrCat("shared memory ", label, ": ", what, ": ", std::strerror(err)));
  };
  // A descriptor handed out read-only cannot be reopened writable through /proc by another
  // user (memfd's inodes start at 0777).
  if (fchmod(fd, 0600) != 0) return fail(absl::StatusCode::kInternal, "fchmod", errno);
  if (const int err = Allocate(fd, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", label, ": cannot allocate ",
                                                     bytes, " bytes: ", std::strerror(err)));
  }
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return fail(absl::StatusCode::kInternal, "sealing its size", errno);
  }
  void* data =
      mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (at != nullptr ? MAP_FIXED : 0), fd, 0);
  if (data == MAP_FAILED) {
    return fail(absl::StatusCode::kResourceExhausted, absl::StrCat("mmap of ", bytes, " bytes"),
                errno);
  }
  return std::shared_ptr<SharedSegment>(
      new SharedSegment(label, fd, static_cast<uint8_t*>(data), bytes));
}

SharedSegment::~SharedSegment() {
  munmap(data_, bytes_);
  close(fd_);
}

absl::Status SharedSegment::Seal(bool writers_too) const {
  const int seals = F_SEAL_SEAL | (writers_too ? F_SEAL_FUTURE_WRITE : 0);
  if (fcntl(fd_, F_ADD_SEALS, seals) != 0) {
    return absl::InternalError(absl::StrCat("shared memory ", label_, ": sealing",
                                            writers_too ? " against writers" : "", ": ",
                                            std::strerror(errno), " (Linux 5.1 or later)"));
  }
  return absl::OkStatus();
}

absl::Status SharedSegment::Populate(uint64_t offset, uint64_t bytes) const {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("populate: ", bytes, " bytes at ", offset, " pass the segment's ", bytes_));
  }
  if (bytes == 0) return absl::OkStatus();
  // madvise wants a page-aligned start; the range grows to whole pages, inside the mapping.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  if (madvise(data_ + begin, offset + bytes - begin, MADV_POPULATE_WRITE) != 0) {
    const int err = errno;
    if (err == EINVAL) {
      return absl::UnimplementedError("populate: madvise(MADV_POPULATE_WRITE) needs Linux 5.14");
    }
    return absl::InternalError(
        absl::StrCat("populate: madvise(MADV_POPULATE_WRITE): ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace kvmem::transport
