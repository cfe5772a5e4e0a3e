#pragma once
// SegmentGuard: lets a daemon thread read and write a shared mapping that another process
// may shrink (ftruncate) under it. Touching a page past the end of a shrunken file raises
// SIGBUS, which would kill the daemon; inside a guarded section a SIGBUS at an address of
// the guarded mapping instead replaces the whole mapping with private zero pages (the
// faulting access then completes on zeros) and marks the section faulted, so that the
// caller throws away what it read and stops using the segment. A SIGBUS anywhere else
// (or one sent by kill) keeps the effect it had before: the handler installed before ours,
// or the default. This is what Wayland compositors do for clients' wl_shm pools.
#include <csignal>
#include <cstddef>
#include <cstdint>

namespace kvmem::transport {

namespace segment_guard_internal {
struct Range {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  volatile sig_atomic_t faulted = 0;
};
}  // namespace segment_guard_internal

class SegmentGuard {
 public:
  // Installs the process's SIGBUS handler (the first guard does too); the daemon calls it
  // at startup, so that a handler installed later by something else is the one replaced.
  static void Install();
  // Guards [data, data + bytes), a MAP_SHARED mapping of this process, for the calling
  // thread until destroyed. Sections do not nest.
  SegmentGuard(uint8_t* data, size_t bytes);
  ~SegmentGuard();
  SegmentGuard(const SegmentGuard&) = delete;
  SegmentGuard& operator=(const SegmentGuard&) = delete;

  // True when an access since the section began faulted: everything read is void, and
  // the mapping now holds private zero pages (still safe to unmap).
  bool faulted() const;

 private:
  segment_guard_internal::Range range_;
};

}  // namespace kvmem::transport
