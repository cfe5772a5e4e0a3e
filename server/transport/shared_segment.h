#pragma once
// SharedSegment: an anonymous shared-memory mapping (memfd) owned by the daemon. It has no
// name anywhere (nothing under /dev/shm for another process to open or list); a same-host
// client receives its descriptor over the attach socket (attach_socket.h) after an
// authenticated call handed it a ticket. Its size is sealed: no holder of the descriptor can
// shrink it (which would fault the daemon's reads) or grow it; Seal() closes the seals,
// against new writable mappings too for a segment no client may write. Its memory goes with the
// last descriptor and mapping, however the daemon ends: nothing is left behind to clean.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvmem::transport {

class SharedSegment {
 public:
  // Creates a fresh segment of `bytes` (zero-filled) labelled `label` (memfd's name: it shows
  // in /proc/<pid>/maps, it opens nothing). Its memory is allocated here, not on first touch:
  // when shared memory cannot hold it the result is RESOURCE_EXHAUSTED naming the size (a
  // mapping sized by ftruncate alone would kill the daemon with SIGBUS later instead).
  // `at`: mapped there (MAP_FIXED), over address space the caller reserved for it (its
  // pages must be the caller's to replace); the segment unmaps it when it goes.
  static absl::StatusOr<std::shared_ptr<SharedSegment>> Create(const std::string& label,
                                                               uint64_t bytes,
                                                               uint8_t* at = nullptr);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  const std::string& label() const { return label_; }
  uint64_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_; }
  // The read-write descriptor; it stays open (and valid) while the segment lives.
  int fd() const { return fd_; }
  // Adds the last seals: with `writers_too`, no new writable mapping or write(2) (the
  // daemon's own mapping stays writable): a client given the descriptor, read-only or
  // reopened through /proc, can only read. Then no seal can be added or removed. Once.
  absl::Status Seal(bool writers_too) const;
  // Maps [offset, offset + bytes) writable now (madvise MADV_POPULATE_WRITE), so that the
  // first writes there do not fault one page at a time: the memory is already allocated
  // (Create), but the kernel zero-fills and maps each page at its first touch. Changes no
  // byte; safe while other threads read and write the range. UNIMPLEMENTED on kernels
  // before 5.14, INVALID_ARGUMENT for a range outside the segment.
  absl::Status Populate(uint64_t offset, uint64_t bytes) const;

 private:
  SharedSegment(std::string label, int fd, uint8_t* data, uint64_t bytes)
      : label_(std::move(label)), fd_(fd), data_(data), bytes_(bytes) {}
  std::string label_;
  int fd_;
  uint8_t* data_;
  uint64_t bytes_;
};

}  // namespace kvmem::transport
