#pragma once
// SharedSegment: a named POSIX shared-memory mapping (shm_open + mmap) owned by the daemon.
// The daemon maps it read-write; same-host clients map it read-only by name. The name is
// unlinked when the owner is destroyed, so a crashed client never keeps it alive.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvmem::store {

class SharedSegment {
 public:
  // Creates a fresh segment of `bytes` (zero-filled) named "/<prefix>-<pid>-<counter>".
  static absl::StatusOr<std::unique_ptr<SharedSegment>> Create(const std::string& prefix,
                                                               uint64_t bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_; }

 private:
  SharedSegment(std::string name, uint8_t* data, uint64_t bytes)
      : name_(std::move(name)), data_(data), bytes_(bytes) {}
  std::string name_;
  uint8_t* data_;
  uint64_t bytes_;
};

}  // namespace kvmem::store
