#pragma once
// TableBoard: every sequence's block table in a shared-memory segment (the table area,
// proto/kvmem/v1/table_area.h), rewritten each time the sequence publishes a new version,
// so that a same-host reader — a paged-attention kernel over the CPU pool, a worker — reads
// it in place under a seqlock instead of applying the delta of every answer.
//
// The area is a view: a table that finds no room in its heap leaves its slot empty, and
// answers carry the update as before (TableVersions::Answer asks Holds first). A slot is
// written only under its sequence's lock; the heap's free list has a lock of its own.
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/kvmem/v1/table_area.h"
#include "server/engine/sequence.h"
#include "server/store/block_pool.h"
#include "server/transport/shared_segment.h"

namespace kvmem::engine {

class TableBoard {
 public:
  // An area of `bytes` (its slots included: at least 64 + 64 * slots + 4 KiB) with one
  // slot per sequence slot (EpochBoard's).
  static absl::StatusOr<std::unique_ptr<TableBoard>> Create(uint32_t slots, uint64_t bytes);
  ~TableBoard();

  // Writes seq's table at its current version and epoch into its slot, after
  // Sequence::Publish: of a stream the record holds at an older published version, only
  // the entries that changed (the untouched run moves as a whole, as in a delta); false
  // (the slot then holds none) when the heap has no room for it. Under seq's lock.
  // Allocates no host memory (the heap's free list has its nodes from Create).
  bool Write(const Sequence& seq, const store::BlockPool& pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Empties slot `slot` (a sequence released or poisoned); allocates nothing.
  void Clear(uint32_t slot);
  // Whether slot `slot` holds sequence `id`'s table at `version`.
  bool Holds(uint32_t slot, uint64_t id, uint64_t version) const;

  std::weak_ptr<const transport::SharedSegment> segment() const { return segment_; }
  uint64_t bytes() const { return segment_->bytes(); }
  uint32_t slots() const { return slots_; }
  uint64_t heap_bytes_in_use() const;
  uint64_t heap_bytes() const { return heap_bytes_; }
  // Writes that found no room for their table (its answers carried updates instead).
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }

  // Heap allocations are multiples of this.
  static constexpr uint64_t kGrain = 64;

 private:
  TableBoard(std::shared_ptr<transport::SharedSegment> segment, uint32_t slots);
  v1::table_area::Slot& slot(uint32_t i) const;
  // A heap range of at least `bytes`, or 0 when none is free (offsets are never 0: the
  // header comes first).
  uint64_t Allocate(uint64_t bytes);
  void Free(uint64_t offset, uint64_t bytes);

  // What the daemon knows of each slot's record: slot i is read and written only under the
  // lock of the sequence that holds epoch slot i (Write, Clear, Holds).
  struct Record {
    uint64_t offset = 0, bytes = 0;      // the heap range it owns (0: none)
    uint32_t streams = 0, capacity = 0;  // its regions (table_area.h)
    uint64_t id = 0, version = 0;        // the table it holds (0: none)
  };
  // Writes stream `s`'s entries [from, to) into region `out`.
  static void WriteEntries(const Stream& st, const store::BlockPool& pool, size_t from, size_t to,
                           v1::table_area::Entry* out);

  const std::shared_ptr<transport::SharedSegment> segment_;
  const uint32_t slots_;
  uint64_t heap_bytes_ = 0;
  std::atomic<uint64_t> misses_{0};
  std::vector<Record> records_;
  mutable absl::Mutex mu_;
  using FreeList = std::map<uint64_t, uint64_t>;  // offset -> bytes
  FreeList free_ ABSL_GUARDED_BY(mu_);
  std::vector<FreeList::node_type> spare_ ABSL_GUARDED_BY(mu_);  // nodes for free_
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::engine
