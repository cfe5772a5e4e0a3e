#pragma once
// The binary layout of the table area (GetInfoResponse.table_area, kvmemd
// --table-area-bytes), shared by kvmemd and same-host readers: each sequence's block table in
// shared memory, where a paged-attention kernel or a worker reads it in place instead of
// applying the updates of answers.
//
//   Header at 0; then `slots` Slot entries of 64 bytes, slot i for the sequence whose
//   epoch_slot is i; then the heap, which holds the records the slots point at.
//
// A slot is a seqlock: `word` is odd while the daemon rewrites the slot or its record, even
// otherwise, and only grows. A reader loads `word` (acquire), reads the slot's fields and
// copies the record, loads `word` again, and uses the copy only if both loads are the same
// even value, the slot names its sequence, and record_offset/record_bytes lie inside the
// mapping (a torn read can see any value). A slot with record_bytes 0 holds no table: the
// reader fetches it (GetBlockTable) instead.
//
// A record: `streams` uint32 counts, padded to 8 bytes, then `streams` regions of `capacity`
// Entry each: stream s's blocks, in order, are the first counts[s] entries of region s. (A
// region per stream lets the daemon rewrite only what a step changed: a decode step's
// append and eviction touch a stream's two ends.) The table's other fields (layout,
// block_tokens, block bytes, quantization) are fixed for the sequence's life: a reader has
// them from the table it attached with.
#include <atomic>
#include <cstdint>

namespace kvmem::v1::table_area {

inline constexpr uint64_t kMagic = 0x61657261'6c62746bULL;  // "ktblarea"
inline constexpr uint32_t kSlotBytes = 64;

struct Header {
  uint64_t magic;
  uint32_t slots;
  uint32_t reserved;
  uint64_t heap_offset;  // bytes from the area's start
  uint64_t heap_bytes;
  uint8_t pad[32];
};

struct Slot {
  std::atomic<uint64_t> word;
  uint64_t sequence_id;    // 0: none
  uint64_t version;        // BlockTable.version of the record
  uint64_t epoch;          // BlockTable.epoch at that version
  uint64_t record_offset;  // bytes from the area's start
  uint64_t record_bytes;   // 0: no record
  uint32_t streams;
  uint32_t capacity;  // entries per stream region
  uint64_t reserved;
};

struct Entry {
  uint64_t offset;     // the block's bytes into the pool
  uint32_t id;         // the block's id
  uint32_t start;      // first live slot
  uint32_t count;      // live slots
  uint32_t precision;  // Precision enum value of kvmem.proto
};

static_assert(sizeof(Header) == 64 && sizeof(Slot) == kSlotBytes && sizeof(Entry) == 24);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Bytes of the counts before the regions, and of a whole record.
inline uint64_t CountsBytes(uint64_t streams) { return (streams * sizeof(uint32_t) + 7) / 8 * 8; }
inline uint64_t RecordBytes(uint64_t streams, uint64_t capacity) {
  return CountsBytes(streams) + streams * capacity * sizeof(Entry);
}

}  // namespace kvmem::v1::table_area
