#pragma once
// SharedPool: same-host, zero-copy access to a CPU-backend daemon's pool (MappedPool is
// what it shares with CudaPool, the same for a CUDA-backend pool).
//
// The pool and the epoch board are mapped read-only. Blocks named by a BlockTable are read
// in place; a read is trustworthy only if the sequence's epoch word equals 2 * table.epoch
// both before and after it (a seqlock). Protocol for a worker:
//   1. table = GetBlockTable(seq)             (after each Step/Compress that changed epoch)
//   2. BeginRead(table)                      (FAILED_PRECONDITION: table stale, refetch)
//   3. read through StreamBlocks(...) pointers
//   4. EndRead(table)                        (FAILED_PRECONDITION: discard what you read)
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kvmem/client.h"

namespace kvmem::client {

namespace internal {
// Moves `value` to the heap and never frees it: buffers a transport may still write into (a
// UCX get left in flight, ucx_pool.h) must never be handed out again.
template <typename T>
void KeepForever(T&& value) {
  (void)new std::decay_t<T>(std::forward<T>(value));
}
}  // namespace internal

// One block of a stream as mapped. For layout precision, k and v point at the first live
// slot's row ([count][head_dim] in the layout dtype each). For quantized blocks, `block`
// points at the whole block (kernels/quantize.h layout) and k/v are null.
struct BlockView {
  const uint8_t* k;
  const uint8_t* v;
  const uint8_t* block;
  uint32_t start;  // first live slot in the block
  uint32_t count;  // live slots
  Precision precision;
};

// Dequantizes the live slots of a quantized block view into `k` and `v` ([count][D] each,
// in `out` dtype), with the geometry the table describes.
void DequantizeBlock(const BlockTable& table, const BlockView& block, DType out, void* k, void* v);

// The daemon's per-sequence epoch words, mapped read-only: the seqlock of in-place reads,
// whichever memory the pool lives in.
class EpochReader {
 public:
  static absl::StatusOr<std::unique_ptr<EpochReader>> Attach(const Info& info);
  ~EpochReader();
  EpochReader(const EpochReader&) = delete;
  EpochReader& operator=(const EpochReader&) = delete;

  // FAILED_PRECONDITION when the table is stale (before) or went stale (after the read).
  absl::Status BeginRead(const BlockTable& table) const;
  absl::Status EndRead(const BlockTable& table) const;
  // Whether slot `slot` is stable at `epoch` now (false for a slot outside the board).
  bool Stable(uint32_t slot, uint64_t epoch) const {
    return slot < slots_ && EpochWord(slot) == 2 * epoch;
  }
  // The two checks on an epoch word however it was read (here, or remotely: ucx_pool.h):
  // before a read, `word` of a board of `slots`; after it.
  static absl::Status CheckBefore(const BlockTable& table, uint32_t slots, uint64_t word);
  static absl::Status CheckAfter(const BlockTable& table, uint64_t word);

 private:
  EpochReader() = default;
  uint64_t EpochWord(uint32_t slot) const;
  const uint8_t* board_ = nullptr;
  uint64_t board_bytes_ = 0;
  uint32_t stride_ = 0;
  uint32_t slots_ = 0;
};

// One read of a daemon's pool by offset, not by table: pool bytes [offset, offset + bytes)
// to `dst` (another kvmemd reading the blocks a sequence's export names: MoveSequence).
struct PoolRead {
  uint64_t offset = 0;
  void* dst = nullptr;
  uint64_t bytes = 0;
};

// A daemon's pool mapped into this process — host memory (SharedPool) or the GPU's
// (CudaPool, cuda_pool.h) — and read in place under the epoch protocol above.
class MappedPool {
 public:
  virtual ~MappedPool() = default;
  MappedPool(const MappedPool&) = delete;
  MappedPool& operator=(const MappedPool&) = delete;

  // The read protocol's two checks (FAILED_PRECONDITION: the table is stale, or the
  // sequence moved during the read).
  virtual absl::Status BeginRead(const BlockTable& table) const {
    return epochs_->BeginRead(table);
  }
  virtual absl::Status EndRead(const BlockTable& table) const { return epochs_->EndRead(table); }
  // Addresses in the mapping for one stream's blocks, in order; OUT_OF_RANGE for a block
  // outside it.
  absl::StatusOr<std::vector<BlockView>> StreamBlocks(const BlockTable& table, uint32_t layer,
                                                      uint32_t kv_head) const;
  // Copies one stream's retained K and V to host memory ([n][D] each, quantized blocks
  // dequantized to the layout dtype) with the full read protocol.
  absl::Status ReadStream(const BlockTable& table, uint32_t layer, uint32_t kv_head, std::string* k,
                          std::string* v) const;
  // Every stream of the table at once (one read protocol, one batch of copies: what a
  // remote pool's round trips make worth it), in layer-major order, as ReadKv gives them
  // (positions from the table; epoch: the table's).
  absl::StatusOr<std::vector<StreamKv>> ReadStreams(const BlockTable& table) const;
  // The mapping's bytes (the pool's size).
  uint64_t bytes() const { return bytes_; }
  // Whether pool bytes [offset, offset + bytes) are mapped (and so may be read): within the
  // pool and within the piece of it this process was given (Info::shm_piece_offset).
  bool Maps(uint64_t offset, uint64_t bytes) const {
    return offset >= lo_ && offset <= hi_ && bytes <= hi_ - offset;
  }

 protected:
  MappedPool() = default;
  // Copies `bytes` at `src`, an address in the mapping, to host memory at `dst`.
  virtual absl::Status CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const = 0;
  struct OutCopy {
    void* dst;
    const uint8_t* src;
    uint64_t bytes;
  };
  // Several CopyOuts, in any order (a remote pool posts them all, then waits once).
  virtual absl::Status CopyOutMany(absl::Span<const OutCopy> copies) const {
    for (const OutCopy& c : copies) {
      if (absl::Status s = CopyOut(c.dst, c.src, c.bytes); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // The copies of an in-place write: `n` tokens of every stream ([L][H][n][D] in the layout
  // dtype, `kv_bytes` each of K and V) to where `plan` says, one op per stream (its rows
  // are contiguous in a block's K plane and in its V plane, `v_plane` bytes further):
  // source offsets into K (or V), destination offsets into the mapping. INVALID_ARGUMENT
  // when the sizes disagree with the table's layout or n passes the plan; OUT_OF_RANGE for
  // a plan offset outside the pool.
  struct RowsCopy {
    uint64_t src, dst, bytes;
  };
  struct PlannedWrites {
    std::vector<RowsCopy> k;  // V: the same with dst + v_plane
    uint64_t v_plane = 0;
  };
  absl::StatusOr<PlannedWrites> PlanWrites(const WritePlan& plan, const BlockTable& table,
                                           uint32_t n, uint64_t kv_bytes) const;
  // The streams' reads under one read protocol, their copies in one CopyOutMany.
  struct StreamRead;
  absl::Status ReadInto(const BlockTable& table, std::vector<StreamRead>& reads) const;

  const uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t lo_ = 0, hi_ = 0;  // the pool bytes mapped: [lo_, hi_) (Maps)
  std::unique_ptr<EpochReader> epochs_;
};

class SharedPool final : public MappedPool {
 public:
  // `writable`: maps the pool read-write too, for in-place writes (Info::in_place_writes).
  static absl::StatusOr<std::unique_ptr<SharedPool>> Attach(const Info& info,
                                                            bool writable = false);
  ~SharedPool() override;

  // Writes `n` tokens' K and V ([L][H][n][D] in the layout dtype each, as an Append
  // carries them) where `plan` says, into a pool attached writable; then commit them with
  // BatchEntry::written_plan. INVALID_ARGUMENT when the sizes disagree with the table's
  // layout or n passes the plan; OUT_OF_RANGE for a plan offset outside the pool.
  absl::Status WritePlanned(const WritePlan& plan, const BlockTable& table, uint32_t n,
                            std::string_view k, std::string_view v);
  // Copies each read's pool bytes to its destination; OUT_OF_RANGE for bytes outside the
  // pool, nothing read. The caller keeps the bytes from changing meanwhile (an export holds
  // its blocks): no epoch is checked.
  absl::Status ReadPool(absl::Span<const PoolRead> reads) const;

 private:
  SharedPool() = default;
  uint8_t* writable_ = nullptr;  // base_, when attached writable
  absl::Status CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const override;
};

}  // namespace kvmem::client
