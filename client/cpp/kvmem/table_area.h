#pragma once
// TableReader: the daemon's table area (kvmemd --table-area-bytes) mapped read-only, where
// every sequence's block table lies in shared memory (layout and seqlock:
// proto/kvmem/v1/table_area.h). A client that reads its tables there is told only their
// new version by a StepBatch (Client::AttachTableArea), not sent the update.
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"
#include "kvmem/v1/table_area.h"

namespace kvmem::client {

// A table read where it lies, as a paged-attention kernel reads it: the area's own stream
// regions, good only while TableReader::Unchanged says neither the slot nor the sequence's
// epoch word moved since the view was taken (check after using what was read, and after
// reading the K/V it names: a step frees blocks at its commit, before the area has its
// new table, and only the epoch word says so then; a torn read can hold anything).
struct TableView {
  uint32_t epoch_slot = 0;
  uint64_t version = 0, epoch = 0;
  uint64_t word = 0;  // the slot's seqlock word when the view was taken
  uint32_t streams = 0, capacity = 0;
  const uint32_t* counts = nullptr;
  const v1::table_area::Entry* regions = nullptr;
  // Stream s's blocks (its count clamped to the region, so that a torn count never reads
  // outside the record).
  absl::Span<const v1::table_area::Entry> stream(uint32_t s) const {
    const uint32_t n = counts[s] < capacity ? counts[s] : capacity;
    return {regions + uint64_t{s} * capacity, n};
  }
};

class TableReader {
 public:
  // FAILED_PRECONDITION when the daemon has no table area; UNAVAILABLE when it is not on
  // this host.
  static absl::StatusOr<std::unique_ptr<TableReader>> Attach(const Info& info);
  ~TableReader();
  TableReader(const TableReader&) = delete;
  TableReader& operator=(const TableReader&) = delete;

  // Brings `table` (one of table->sequence_id, attached from a whole table: layout, block
  // sizes and epoch_slot set) to the area's copy when that copy is at `version` or later,
  // and not older than the table itself:
  // its version, epoch and every stream's blocks. FAILED_PRECONDITION, `table` untouched,
  // when the area holds an older version, none, another sequence's, or one that changed
  // under every try (fetch the table instead).
  absl::Status Read(uint64_t version, BlockTable* table) const;

  // A view of sequence `sequence_id`'s table in slot `epoch_slot` when the area holds it at
  // `version` or later and the sequence is still at that table's epoch; FAILED_PRECONDITION
  // otherwise (a step's commit that the area does not have yet: try again), or when it is
  // being rewritten under every try.
  absl::StatusOr<TableView> View(uint32_t epoch_slot, uint64_t sequence_id, uint64_t version) const;
  // Whether what was read through `view`, and the K/V it names, are the table and the data
  // of view.version: the slot did not change, and the epoch word still holds view.epoch.
  bool Unchanged(const TableView& view) const;

 private:
  TableReader() = default;
  // The seqlock's copy of bytes the daemon may be rewriting (discarded when the word moved):
  // the one designed race, kept in this function (tests/tsan.supp).
  static void CopyOut(void* dst, const uint8_t* src, uint64_t bytes);
  // A slot's fields, copied out (under the caller's seqlock check).
  struct SlotFields {
    uint64_t id = 0, version = 0, epoch = 0, offset = 0, bytes = 0;
    uint32_t streams = 0, capacity = 0;
  };
  const uint8_t* SlotAt(uint32_t slot) const;
  static SlotFields CopySlot(const uint8_t* at);
  // Whether the record the fields name lies inside the mapping and has their size.
  bool Fits(const SlotFields& f) const;
  const uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t slots_ = 0;
  std::unique_ptr<EpochReader> epochs_;
};

}  // namespace kvmem::client
