#include "server/transport/shared_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "server/common/mutex.h"

namespace kvmem::transport {
namespace {

// Where glibc's shm_open keeps its names.
constexpr char kShmDir[] = "/dev/shm";

// "; /dev/shm has F bytes free of T", or "" when statvfs fails.
std::string ShmSpace() {
  struct statvfs fs {};
  if (statvfs(kShmDir, &fs) != 0) return "";
  return absl::StrCat("; ", kShmDir, " has ", uint64_t{fs.f_bavail} * fs.f_frsize,
                      " bytes free of ", uint64_t{fs.f_blocks} * fs.f_frsize);
}

// posix_fallocate returns its error instead of setting errno, and may be interrupted.
int Allocate(int fd, off_t bytes) {
  int err = 0;
  do {
    err = posix_fallocate(fd, 0, bytes);
  } while (err == EINTR);
  return err;
}

bool AllDigits(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// The pid of "<prefix>-<pid>-<n>", or 0 when `name` is not such a name.
pid_t OwnerPid(absl::string_view name, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&name, prefix) || !absl::ConsumePrefix(&name, "-")) return 0;
  const size_t dash = name.find('-');
  if (dash == absl::string_view::npos) return 0;
  const absl::string_view pid_text = name.substr(0, dash);
  if (!AllDigits(pid_text) || !AllDigits(name.substr(dash + 1))) return 0;
  int32_t pid = 0;
  if (!absl::SimpleAtoi(pid_text, &pid) || pid <= 0) return 0;
  return pid;
}

}  // namespace

namespace {

// Whether this process may still create segments (RemoveOwnSegments stops it): checked and
// the name created under the lock, so that a removal that holds it next sees every name.
absl::Mutex creation_mu(absl::kConstInit);
bool creation_stopped ABSL_GUARDED_BY(creation_mu) = false;

}  // namespace

absl::StatusOr<std::unique_ptr<SharedSegment>> SharedSegment::Create(const std::string& prefix,
                                                                     uint64_t bytes) {
  if (bytes == 0 || bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory ", prefix, ": cannot map a segment of ", bytes, " bytes"));
  }
  // "<prefix>-<pid>-<n>", n a count and 20 random digits: a name nobody can guess, so that
  // no other process can take it first (O_EXCL would then refuse the daemon its segment)
  // or open it before its client maps it.
  static std::atomic<uint32_t> counter{0};
  thread_local absl::BitGen random;
  const std::string name = absl::StrCat("/", prefix, "-", getpid(), "-", counter++,
                                        absl::StrFormat("%020u", absl::Uniform<uint64_t>(random)));
  int fd = -1;
  {
    kvmem::MutexLock lock(&creation_mu);
    if (creation_stopped) {
      return absl::UnavailableError(
          absl::StrCat("shared memory ", prefix, ": kvmemd is stopping; no new segment"));
    }
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  }
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
  }
  // Held while the segment lives; released by the kernel however the daemon ends.
  if (flock(fd, LOCK_SH) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::InternalError(absl::StrCat("flock(", name, "): ", std::strerror(err)));
  }
  if (const int err = Allocate(fd, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("shared memory ", name, ": cannot allocate ",
                                                     bytes, " bytes: ", std::strerror(err),
                                                     ShmSpace()));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory ", name, ": mmap of ", bytes, " bytes: ", std::strerror(err)));
  }
  return std::unique_ptr<SharedSegment>(
      new SharedSegment(name, fd, static_cast<uint8_t*>(data), bytes));
}

SharedSegment::~SharedSegment() {
  munmap(data_, bytes_);
  Unlink();
  close(fd_);
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

void SharedSegment::Unlink() {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

std::vector<std::string> RemoveStaleSegments(const std::vector<std::string>& prefixes,
                                             const std::string& dir) {
  std::vector<std::string> removed;
  DIR* listing = opendir(dir.c_str());
  if (listing == nullptr) return removed;
  while (const dirent* entry = readdir(listing)) {
    const std::string name = entry->d_name;
    pid_t pid = 0;
    for (const std::string& prefix : prefixes) {
      if (pid == 0) pid = OwnerPid(name, prefix);
    }
    // EPERM means a live process of another user: not ours to judge.
    if (pid == 0 || kill(pid, 0) == 0 || errno != ESRCH) continue;
    const std::string path = absl::StrCat(dir, "/", name);
    const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    // A live owner holds a shared lock, whatever pid namespace it runs in.
    if (flock(fd, LOCK_EX | LOCK_NB) == 0 && unlink(path.c_str()) == 0) {
      removed.push_back(name);
    }
    close(fd);
  }
  closedir(listing);
  return removed;
}

std::vector<std::string> RemoveOwnSegments(const std::vector<std::string>& prefixes,
                                           const std::string& dir) {
  {
    kvmem::MutexLock lock(&creation_mu);
    creation_stopped = true;  // from here, every name this process made is in `dir`
  }
  std::vector<std::string> removed;
  DIR* listing = opendir(dir.c_str());
  if (listing == nullptr) return removed;
  const pid_t self = getpid();
  while (const dirent* entry = readdir(listing)) {
    const std::string name = entry->d_name;
    for (const std::string& prefix : prefixes) {
      if (OwnerPid(name, prefix) == self && unlink(absl::StrCat(dir, "/", name).c_str()) == 0) {
        removed.push_back(name);
        break;
      }
    }
  }
  closedir(listing);
  return removed;
}

}  // namespace kvmem::transport
