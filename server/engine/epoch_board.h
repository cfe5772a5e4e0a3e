#pragma once
// EpochBoard: one seqlock word per sequence slot in a small shared-memory segment, so that
// same-host readers that map the pool can tell whether the blocks they read were stable.
//
// Word value: 2*epoch while the sequence's blocks are stable; 2*epoch+1 while the daemon
// moves data in them. A reader loads the word (acquire), reads blocks named by a table of
// that epoch, loads it again, and trusts the data only if both loads equal 2*table_epoch.
// Blocks a sequence stops referencing are freed only inside a write section, so a reader
// holding an older table always sees the word change.
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/mutex.h"
#include "server/transport/shared_segment.h"

namespace kvmem::engine {

class EpochBoard {
 public:
  static constexpr uint32_t kStride = 64;  // one cache line per word

  static absl::StatusOr<std::unique_ptr<EpochBoard>> Create(uint32_t slots);

  // Claims a free slot and publishes `epoch` in it; RESOURCE_EXHAUSTED when none is free.
  absl::StatusOr<uint32_t> Acquire(uint64_t epoch);
  void Release(uint32_t slot);

  void BeginWrite(uint32_t slot, uint64_t epoch);  // word = 2*epoch+1
  void EndWrite(uint32_t slot, uint64_t epoch);    // word = 2*epoch
  uint64_t Load(uint32_t slot) const;

  std::weak_ptr<const transport::SharedSegment> segment() const { return segment_; }
  uint32_t slots() const { return slots_; }

 private:
  EpochBoard(std::shared_ptr<transport::SharedSegment> segment, uint32_t slots);
  std::atomic<uint64_t>* word(uint32_t slot) const;

  std::shared_ptr<transport::SharedSegment> segment_;
  const uint32_t slots_;
  absl::Mutex mu_;
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::engine
