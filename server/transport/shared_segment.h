#pragma once
// SharedSegment: a named POSIX shared-memory mapping (shm_open + mmap) owned by the daemon.
// The daemon maps it read-write; same-host clients map it read-only by name. The name is
// unlinked when the owner is destroyed, so a crashed client never keeps it alive; a
// daemon killed outright leaves it behind, and RemoveStaleSegments clears it at the next
// start.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvmem::transport {

class SharedSegment {
 public:
  // Creates a fresh segment of `bytes` (zero-filled) named "/<prefix>-<pid>-<counter>".
  // Its memory is allocated here, not on first touch: when /dev/shm cannot hold it the
  // result is RESOURCE_EXHAUSTED naming the size and what /dev/shm has free (a mapping
  // sized by ftruncate alone would kill the daemon with SIGBUS later instead).
  static absl::StatusOr<std::unique_ptr<SharedSegment>> Create(const std::string& prefix,
                                                               uint64_t bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_; }
  // Removes the name now (a segment whose one client has mapped it); the mapping stays.
  void Unlink();
  // Maps [offset, offset + bytes) writable now (madvise MADV_POPULATE_WRITE), so that the
  // first writes there do not fault one page at a time: the memory is already allocated
  // (Create), but the kernel zero-fills and maps each page at its first touch. Changes no
  // byte; safe while other threads read and write the range. UNIMPLEMENTED on kernels
  // before 5.14, INVALID_ARGUMENT for a range outside the segment.
  absl::Status Populate(uint64_t offset, uint64_t bytes) const;

 private:
  SharedSegment(std::string name, int fd, uint8_t* data, uint64_t bytes)
      : name_(std::move(name)), fd_(fd), data_(data), bytes_(bytes) {}
  std::string name_;
  int fd_;  // kept open for its shared flock: the mark of a live owner (RemoveStaleSegments)
  uint8_t* data_;
  uint64_t bytes_;
  bool linked_ = true;
};

// Removes the segments that daemons which no longer run left in `dir` (where shm_open
// names live): names "<prefix>-<pid>-<n>" for one of `prefixes` whose pid is no live
// process here and whose owner's lock is not held (the lock also protects the segments of
// a daemon in another pid namespace that shares /dev/shm). Returns the names removed.
std::vector<std::string> RemoveStaleSegments(const std::vector<std::string>& prefixes,
                                             const std::string& dir = "/dev/shm");
// Stops this process from creating segments (Create is UNAVAILABLE from then on), then
// removes the names of its own (for one of `prefixes`), for a daemon that ends without
// destroying them (a stop while it starts): their memory goes with the process's last
// mapping. Returns the names removed.
std::vector<std::string> RemoveOwnSegments(const std::vector<std::string>& prefixes,
                                           const std::string& dir = "/dev/shm");

}  // namespace kvmem::transport
