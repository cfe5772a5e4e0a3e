#include "kvmem/shared_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/block_layout.h"
#include "kernels/quantize.h"

namespace kvmem::client {
namespace {

absl::StatusOr<const uint8_t*> MapReadOnly(const std::string& name, uint64_t bytes,
                                           bool writable = false) {
  const int fd = shm_open(name.c_str(), writable ? O_RDWR : O_RDONLY, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shared memory ", name, ": ", std::strerror(errno),
                                               " (is the daemon on this host?)"));
  }
  void* data =
      mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("shared memory ", name, ": mmap: ", std::strerror(err)));
  }
  return static_cast<const uint8_t*>(data);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EpochReader>> EpochReader::Attach(const Info& info) {
  std::unique_ptr<EpochReader> reader(new EpochReader());
  reader->stride_ = info.epoch_stride;
  reader->slots_ = info.epoch_slots;
  reader->board_bytes_ = uint64_t{info.epoch_stride} * info.epoch_slots;
  if (info.epoch_board_name.empty() || reader->board_bytes_ == 0) {
    return absl::FailedPreconditionError("epoch_board: the daemon advertises none");
  }
  absl::StatusOr<const uint8_t*> board = MapReadOnly(info.epoch_board_name, reader->board_bytes_);
  if (!board.ok()) return board.status();
  reader->board_ = *board;
  return reader;
}

EpochReader::~EpochReader() {
  if (board_ != nullptr) munmap(const_cast<uint8_t*>(board_), board_bytes_);
}

uint64_t EpochReader::EpochWord(uint32_t slot) const {
  const auto* word =
      reinterpret_cast<const std::atomic<uint64_t>*>(board_ + uint64_t{slot} * stride_);
  return word->load(std::memory_order_acquire);
}

absl::Status EpochReader::BeginRead(const BlockTable& table) const {
  if (table.epoch_slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.epoch_slot: ", table.epoch_slot, " is outside [0, ", slots_, ")"));
  }
  const uint64_t word = EpochWord(table.epoch_slot);
  if (word != 2 * table.epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("epoch: the table is at epoch ", table.epoch, " but the sequence is ",
                     word & 1 ? "being rewritten or released" : absl::StrCat("at epoch ", word / 2),
                     "; fetch the block table again"));
  }
  return absl::OkStatus();
}

absl::Status EpochReader::EndRead(const BlockTable& table) const {
  std::atomic_thread_fence(std::memory_order_acquire);
  if (EpochWord(table.epoch_slot) != 2 * table.epoch) {
    return absl::FailedPreconditionError(absl::StrCat("epoch: the sequence left epoch ",
                                                      table.epoch, " during the read; discard it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SharedPool>> SharedPool::Attach(const Info& info, bool writable) {
  if (info.shm_name.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("shared_memory: the daemon's ", info.backend,
                                                      " backend does not export its pool"));
  }
  std::unique_ptr<SharedPool> pool(new SharedPool());
  absl::StatusOr<std::unique_ptr<EpochReader>> epochs = EpochReader::Attach(info);
  if (!epochs.ok()) return epochs.status();
  pool->epochs_ = *std::move(epochs);
  absl::StatusOr<const uint8_t*> data = MapReadOnly(info.shm_name, info.shm_bytes, writable);
  if (!data.ok()) return data.status();
  pool->base_ = *data;
  pool->bytes_ = info.shm_bytes;
  if (writable) pool->writable_ = const_cast<uint8_t*>(*data);
  return pool;
}

absl::Status SharedPool::WritePlanned(const WritePlan& plan, const BlockTable& table, uint32_t n,
                                      std::string_view k, std::string_view v) {
  if (writable_ == nullptr) {
    return absl::FailedPreconditionError("WritePlanned: the pool was attached read-only");
  }
  const Layout& layout = table.layout;
  const uint64_t streams = uint64_t{layout.num_layers} * layout.num_kv_heads;
  const uint64_t row = uint64_t{layout.head_dim} * DTypeBytes(layout.dtype);
  if (n == 0 || n > plan.tokens || plan.block_offsets.size() != streams ||
      plan.first_slots.size() != streams || k.size() != streams * n * row || v.size() != k.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WritePlanned: ", n, " tokens of ", k.size(), "+", v.size(), " bytes for a plan of ",
        plan.tokens, " tokens over ", plan.block_offsets.size(), " streams; the layout has ",
        streams, " streams of ", row, "-byte rows"));
  }
  const kernels::LayoutBlock block{table.block_tokens, row};
  for (uint64_t s = 0; s < streams; ++s) {
    const uint64_t at = plan.block_offsets[s];
    if (plan.first_slots[s] + n > table.block_tokens || at > bytes_ ||
        block.bytes() > bytes_ - at) {
      return absl::OutOfRangeError(absl::StrCat("WritePlanned: stream ", s, "'s block at ", at,
                                                " lies outside the pool of ", bytes_, " bytes"));
    }
    const uint64_t src = s * n * row;  // stream s of [L][H][n][D]
    std::memcpy(writable_ + at + block.k_offset(plan.first_slots[s]), k.data() + src, n * row);
    std::memcpy(writable_ + at + block.v_offset(plan.first_slots[s]), v.data() + src, n * row);
  }
  return absl::OkStatus();
}

SharedPool::~SharedPool() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), bytes_);
}

absl::Status SharedPool::CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

namespace {
kernels::ElemType ToElem(DType d) {
  return d == DType::kF32
             ? kernels::ElemType::kF32
             : (d == DType::kBF16 ? kernels::ElemType::kBF16 : kernels::ElemType::kF16);
}
kernels::QuantGeometry Geometry(const BlockTable& table) {
  const kernels::QuantType type = table.quantization == Precision::kInt4 ? kernels::QuantType::kInt4
                                  : table.quantization == Precision::kNF4
                                      ? kernels::QuantType::kNF4
                                      : kernels::QuantType::kInt8;
  return {type, table.block_tokens, table.layout.head_dim};
}
}  // namespace

void DequantizeBlock(const BlockTable& table, const BlockView& block, DType out, void* k, void* v) {
  kernels::DequantizeBlockRef(block.block, Geometry(table), block.start, block.count, ToElem(out),
                              k, v);
}

absl::StatusOr<std::vector<BlockView>> MappedPool::StreamBlocks(const BlockTable& table,
                                                                uint32_t layer,
                                                                uint32_t kv_head) const {
  const uint8_t* pool = base_;
  const uint64_t pool_bytes = bytes_;
  const Layout& layout = table.layout;
  if (layer >= layout.num_layers || kv_head >= layout.num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream (", layer, ", ", kv_head, ") is outside the layout"));
  }
  const StreamTable& st = table.streams[size_t{layer} * layout.num_kv_heads + kv_head];
  const uint64_t row = uint64_t{layout.head_dim} * DTypeBytes(layout.dtype);
  std::vector<BlockView> views;
  views.reserve(st.blocks.size());
  for (size_t b = 0; b < st.blocks.size(); ++b) {
    const TableBlock& block = st.blocks[b];
    const uint64_t bytes =
        block.precision == Precision::kLayout ? table.block_bytes : table.quantized_block_bytes;
    if (block.offset > pool_bytes || bytes > pool_bytes - block.offset ||
        block.start + block.count > table.block_tokens) {
      return absl::OutOfRangeError(
          absl::StrCat("blocks[", b, "]: offset ", block.offset, " slots [", block.start, ", ",
                       block.start + block.count, ") is outside the mapped pool or block"));
    }
    const uint8_t* base = pool + block.offset;
    if (block.precision == Precision::kLayout) {
      const kernels::LayoutBlock plane{table.block_tokens, row};
      views.push_back({base + plane.k_offset(block.start), base + plane.v_offset(block.start), base,
                       block.start, block.count, block.precision});
    } else {
      views.push_back({nullptr, nullptr, base, block.start, block.count, block.precision});
    }
  }
  return views;
}

absl::Status MappedPool::ReadStream(const BlockTable& table, uint32_t layer, uint32_t kv_head,
                                    std::string* k, std::string* v) const {
  absl::StatusOr<std::vector<BlockView>> blocks = StreamBlocks(table, layer, kv_head);
  if (!blocks.ok()) return blocks.status();
  if (absl::Status s = BeginRead(table); !s.ok()) return s;
  const uint64_t row = uint64_t{table.layout.head_dim} * DTypeBytes(table.layout.dtype);
  uint64_t n = 0;
  for (const BlockView& b : *blocks) n += b.count;
  k->resize(n * row);
  v->resize(n * row);
  std::string quantized;  // a quantized block, copied out whole and dequantized here
  uint64_t first = 0;
  for (const BlockView& b : *blocks) {
    absl::Status s;
    if (b.precision == Precision::kLayout) {
      s = CopyOut(k->data() + first * row, b.k, b.count * row);
      if (s.ok()) s = CopyOut(v->data() + first * row, b.v, b.count * row);
    } else {
      quantized.resize(table.quantized_block_bytes);
      s = CopyOut(quantized.data(), b.block, quantized.size());
      if (s.ok()) {
        BlockView host = b;
        host.block = reinterpret_cast<const uint8_t*>(quantized.data());
        DequantizeBlock(table, host, table.layout.dtype, k->data() + first * row,
                        v->data() + first * row);
      }
    }
    if (!s.ok()) return s;
    first += b.count;
  }
  return EndRead(table);
}

}  // namespace kvmem::client
