#include "kvmem/shared_pool.h"

// TableReader (kvmem/table_area.h) is here too: it maps its segment as the pool's.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/block_layout.h"
#include "kernels/quantize.h"
#include "kvmem/attach.h"
#include "kvmem/table_area.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/table_area.h"

namespace kvmem::client {

absl::StatusOr<std::unique_ptr<EpochReader>> EpochReader::Attach(const Info& info) {
  std::unique_ptr<EpochReader> reader(new EpochReader());
  reader->stride_ = info.epoch_stride;
  reader->slots_ = info.epoch_slots;
  reader->board_bytes_ = uint64_t{info.epoch_stride} * info.epoch_slots;
  if (reader->board_bytes_ == 0) {
    return absl::FailedPreconditionError("epoch_board: the daemon advertises none");
  }
  absl::StatusOr<uint8_t*> board =
      MapSegment(info.attach, v1::attach::kEpochBoard, reader->board_bytes_, false, "epoch_board");
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

absl::Status EpochReader::CheckBefore(const BlockTable& table, uint32_t slots, uint64_t word) {
  if (table.epoch_slot >= slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("table.epoch_slot: ", table.epoch_slot, " is outside [0, ", slots, ")"));
  }
  if (word != 2 * table.epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("epoch: the table is at epoch ", table.epoch, " but the sequence is ",
                     word & 1 ? "being rewritten or released" : absl::StrCat("at epoch ", word / 2),
                     "; fetch the block table again"));
  }
  return absl::OkStatus();
}

absl::Status EpochReader::CheckAfter(const BlockTable& table, uint64_t word) {
  if (word != 2 * table.epoch) {
    return absl::FailedPreconditionError(absl::StrCat("epoch: the sequence left epoch ",
                                                      table.epoch, " during the read; discard it"));
  }
  return absl::OkStatus();
}

absl::Status EpochReader::BeginRead(const BlockTable& table) const {
  if (table.epoch_slot >= slots_) return CheckBefore(table, slots_, 0);
  return CheckBefore(table, slots_, EpochWord(table.epoch_slot));
}

absl::Status EpochReader::EndRead(const BlockTable& table) const {
  std::atomic_thread_fence(std::memory_order_acquire);
  return CheckAfter(table, EpochWord(table.epoch_slot));
}

absl::StatusOr<std::unique_ptr<SharedPool>> SharedPool::Attach(const Info& info, bool writable) {
  if (info.shm_bytes == 0) {
    return absl::FailedPreconditionError(absl::StrCat("shared_memory: the daemon's ", info.backend,
                                                      " backend does not export its pool"));
  }
  std::unique_ptr<SharedPool> pool(new SharedPool());
  absl::StatusOr<std::unique_ptr<EpochReader>> epochs = EpochReader::Attach(info);
  if (!epochs.ok()) return epochs.status();
  pool->epochs_ = *std::move(epochs);
  const uint64_t lo = info.shm_piece_offset;
  const uint64_t piece = info.shm_piece_bytes != 0 ? info.shm_piece_bytes : info.shm_bytes;
  const auto system_page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (lo > info.shm_bytes || piece > info.shm_bytes - lo || lo % system_page != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared_memory: the daemon's piece [", lo, ", +", piece, ") of its pool of ",
                     info.shm_bytes, " bytes cannot be mapped in place"));
  }
  // A piece lies where its offsets say, in a range the size of the pool whose rest maps
  // nothing (PROT_NONE), so that offsets index as they do into a whole pool.
  uint8_t* range = nullptr;
  if (piece != info.shm_bytes) {
    void* reserved = mmap(nullptr, info.shm_bytes, PROT_NONE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reserved == MAP_FAILED) {
      return absl::UnavailableError(absl::StrCat("shared_memory: no room for ", info.shm_bytes,
                                                 " bytes of addresses: ", std::strerror(errno)));
    }
    range = static_cast<uint8_t*>(reserved);
  }
  absl::StatusOr<uint8_t*> data =
      MapSegment(info.attach, v1::attach::kPool, piece, writable, "shared_memory",
                 range != nullptr ? range + lo : nullptr);
  if (!data.ok()) {
    if (range != nullptr) munmap(range, info.shm_bytes);
    return data.status();
  }
  pool->base_ = range != nullptr ? range : *data;
  pool->bytes_ = info.shm_bytes;
  pool->lo_ = lo;
  pool->hi_ = lo + piece;
  if (writable) pool->writable_ = const_cast<uint8_t*>(pool->base_);
  return pool;
}

absl::StatusOr<MappedPool::PlannedWrites> MappedPool::PlanWrites(const WritePlan& plan,
                                                                 const BlockTable& table,
                                                                 uint32_t n,
                                                                 uint64_t kv_bytes) const {
  const Layout& layout = table.layout;
  const uint64_t streams = uint64_t{layout.num_layers} * layout.num_kv_heads;
  const uint64_t row = uint64_t{layout.head_dim} * DTypeBytes(layout.dtype);
  if (n == 0 || n > plan.tokens || plan.block_offsets.size() != streams ||
      plan.first_slots.size() != streams || kv_bytes != streams * n * row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WritePlanned: ", n, " tokens of ", kv_bytes, " bytes each of K and V for a plan of ",
        plan.tokens, " tokens over ", plan.block_offsets.size(), " streams; the layout has ",
        streams, " streams of ", row, "-byte rows"));
  }
  const kernels::LayoutBlock block{table.block_tokens, row};
  PlannedWrites out;
  out.v_plane = block.v_offset(0) - block.k_offset(0);
  out.k.reserve(streams);
  for (uint64_t s = 0; s < streams; ++s) {
    const uint64_t at = plan.block_offsets[s];
    if (uint64_t{plan.first_slots[s]} + n > table.block_tokens || !Maps(at, block.bytes())) {
      return absl::OutOfRangeError(absl::StrCat("WritePlanned: stream ", s, "'s block at ", at,
                                                " lies outside the mapped pool bytes [", lo_, ", ",
                                                hi_, ")"));
    }
    out.k.push_back({s * n * row, at + block.k_offset(plan.first_slots[s]), n * row});
  }
  return out;
}

absl::Status SharedPool::WritePlanned(const WritePlan& plan, const BlockTable& table, uint32_t n,
                                      std::string_view k, std::string_view v) {
  if (writable_ == nullptr) {
    return absl::FailedPreconditionError("WritePlanned: the pool was attached read-only");
  }
  if (v.size() != k.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("WritePlanned: ", k.size(), " bytes of K and ", v.size(), " of V"));
  }
  absl::StatusOr<PlannedWrites> writes = PlanWrites(plan, table, n, k.size());
  if (!writes.ok()) return writes.status();
  for (const RowsCopy& op : writes->k) {
    std::memcpy(writable_ + op.dst, k.data() + op.src, op.bytes);
    std::memcpy(writable_ + op.dst + writes->v_plane, v.data() + op.src, op.bytes);
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

absl::Status SharedPool::ReadPool(absl::Span<const PoolRead> reads) const {
  for (const PoolRead& r : reads) {
    if (!Maps(r.offset, r.bytes)) {
      return absl::OutOfRangeError(absl::StrCat("pool bytes [", r.offset, ", +", r.bytes,
                                                ") lie outside the mapped [", lo_, ", ", hi_, ")"));
    }
  }
  // In the pool's order, reads that follow each other there and at their destinations are
  // one copy (a prefilled sequence's blocks lie side by side, every stream's block in turn,
  // and a move lands them so): a few large copies, which glibc streams past the cache,
  // instead of one per block.
  std::vector<const PoolRead*> order(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) order[i] = &reads[i];
  std::sort(order.begin(), order.end(),
            [](const PoolRead* a, const PoolRead* b) { return a->offset < b->offset; });
  for (size_t i = 0; i < order.size();) {
    const PoolRead& first = *order[i];
    uint64_t bytes = first.bytes;
    for (++i; i < order.size() && order[i]->offset == first.offset + bytes &&
              order[i]->dst == static_cast<uint8_t*>(first.dst) + bytes;
         ++i) {
      bytes += order[i]->bytes;
    }
    std::memcpy(first.dst, base_ + first.offset, bytes);
  }
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
    if (!Maps(block.offset, bytes) || block.start + block.count > table.block_tokens) {
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

// One stream's read: where its blocks lie and where their bytes go.
struct MappedPool::StreamRead {
  std::vector<BlockView> blocks;
  std::string* k;
  std::string* v;
};

absl::Status MappedPool::ReadInto(const BlockTable& table, std::vector<StreamRead>& reads) const {
  if (absl::Status s = BeginRead(table); !s.ok()) return s;
  const uint64_t row = uint64_t{table.layout.head_dim} * DTypeBytes(table.layout.dtype);
  std::vector<OutCopy> copies;
  // Quantized blocks are copied out whole, then dequantized here.
  std::vector<std::string> quantized;
  for (StreamRead& read : reads) {
    uint64_t n = 0;
    for (const BlockView& b : read.blocks) {
      n += b.count;
      if (b.precision != Precision::kLayout)
        quantized.emplace_back(table.quantized_block_bytes, '\0');
    }
    read.k->resize(n * row);
    read.v->resize(n * row);
  }
  size_t next = 0;
  for (StreamRead& read : reads) {
    uint64_t first = 0;
    for (const BlockView& b : read.blocks) {
      if (b.precision == Precision::kLayout) {
        copies.push_back({read.k->data() + first * row, b.k, b.count * row});
        copies.push_back({read.v->data() + first * row, b.v, b.count * row});
      } else {
        copies.push_back({quantized[next].data(), b.block, quantized[next].size()});
        ++next;
      }
      first += b.count;
    }
  }
  if (absl::Status s = CopyOutMany(copies); !s.ok()) {
    if (absl::IsAborted(s)) {
      // Gets left in flight (ucx_pool.h) may still write into the destinations: their
      // buffers are never freed or reused.
      internal::KeepForever(std::move(quantized));
      for (StreamRead& read : reads) {
        internal::KeepForever(std::move(*read.k));
        internal::KeepForever(std::move(*read.v));
      }
    }
    return s;
  }
  next = 0;
  for (StreamRead& read : reads) {
    uint64_t first = 0;
    for (const BlockView& b : read.blocks) {
      if (b.precision != Precision::kLayout) {
        BlockView host = b;
        host.block = reinterpret_cast<const uint8_t*>(quantized[next++].data());
        DequantizeBlock(table, host, table.layout.dtype, read.k->data() + first * row,
                        read.v->data() + first * row);
      }
      first += b.count;
    }
  }
  return EndRead(table);
}

absl::Status MappedPool::ReadStream(const BlockTable& table, uint32_t layer, uint32_t kv_head,
                                    std::string* k, std::string* v) const {
  absl::StatusOr<std::vector<BlockView>> blocks = StreamBlocks(table, layer, kv_head);
  if (!blocks.ok()) return blocks.status();
  std::vector<StreamRead> reads = {{*std::move(blocks), k, v}};
  return ReadInto(table, reads);
}

absl::StatusOr<std::vector<StreamKv>> MappedPool::ReadStreams(const BlockTable& table) const {
  std::vector<StreamKv> out(table.streams.size());
  std::vector<StreamRead> reads;
  reads.reserve(out.size());
  for (size_t s = 0; s < out.size(); ++s) {
    out[s].layer = table.streams[s].layer;
    out[s].kv_head = table.streams[s].kv_head;
    out[s].epoch = table.epoch;
    out[s].positions = table.streams[s].positions;
    absl::StatusOr<std::vector<BlockView>> blocks =
        StreamBlocks(table, out[s].layer, out[s].kv_head);
    if (!blocks.ok()) return blocks.status();
    reads.push_back({*std::move(blocks), &out[s].k, &out[s].v});
  }
  if (absl::Status s = ReadInto(table, reads); !s.ok()) return s;
  return out;
}

namespace area = v1::table_area;

absl::StatusOr<std::unique_ptr<TableReader>> TableReader::Attach(const Info& info) {
  if (info.table_area_bytes == 0) {
    return absl::FailedPreconditionError("table_area: the daemon keeps none (--table_area_bytes)");
  }
  const uint64_t least = sizeof(area::Header) + uint64_t{info.table_area_slots} * area::kSlotBytes;
  if (info.table_area_bytes < least) {
    return absl::FailedPreconditionError(absl::StrCat("table_area: ", info.table_area_bytes,
                                                      " bytes cannot hold ", info.table_area_slots,
                                                      " slots"));
  }
  std::unique_ptr<TableReader> reader(new TableReader());
  absl::StatusOr<std::unique_ptr<EpochReader>> epochs = EpochReader::Attach(info);
  if (!epochs.ok()) return epochs.status();
  reader->epochs_ = *std::move(epochs);
  absl::StatusOr<uint8_t*> data =
      MapSegment(info.attach, v1::attach::kTableArea, info.table_area_bytes, false, "table_area");
  if (!data.ok()) return data.status();
  reader->base_ = *data;
  reader->bytes_ = info.table_area_bytes;
  reader->slots_ = info.table_area_slots;
  const auto* header = reinterpret_cast<const area::Header*>(reader->base_);
  if (header->magic != area::kMagic || header->slots != reader->slots_) {
    return absl::FailedPreconditionError(
        absl::StrCat("table_area: the segment holds no table area of ", reader->slots_, " slots"));
  }
  return reader;
}

TableReader::~TableReader() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), bytes_);
}

absl::StatusOr<TableView> TableReader::View(uint32_t epoch_slot, uint64_t sequence_id,
                                            uint64_t version) const {
  if (epoch_slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("epoch_slot: ", epoch_slot, " is outside [0, ", slots_, ")"));
  }
  const uint8_t* at = SlotAt(epoch_slot);
  const auto& word = reinterpret_cast<const area::Slot*>(at)->word;
  constexpr int kTries = 64;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    TableView view;
    view.epoch_slot = epoch_slot;
    view.word = word.load(std::memory_order_acquire);
    if (view.word % 2 == 1) continue;
    const SlotFields f = CopySlot(at);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (word.load(std::memory_order_relaxed) != view.word) continue;
    // The fields are a clean copy now; the record they name is checked to lie inside the
    // mapping, so that reading through the view stays inside it whatever happens next.
    view.version = f.version;
    view.epoch = f.epoch;
    view.streams = f.streams;
    view.capacity = f.capacity;
    if (!Fits(f) || f.id != sequence_id || view.version < version) {
      return absl::FailedPreconditionError(absl::StrCat("table area: slot ", epoch_slot,
                                                        " holds no table of sequence ", sequence_id,
                                                        " at version ", version, " or later"));
    }
    if (!epochs_->Stable(epoch_slot, view.epoch)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "table area: sequence ", sequence_id, " left epoch ", view.epoch,
          " after the area's version ", view.version, " (a commit not published yet: retry)"));
    }
    view.counts = reinterpret_cast<const uint32_t*>(base_ + f.offset);
    view.regions =
        reinterpret_cast<const area::Entry*>(base_ + f.offset + area::CountsBytes(view.streams));
    return view;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("table area: slot ", epoch_slot, " changed under ", kTries, " reads"));
}

bool TableReader::Unchanged(const TableView& view) const {
  if (view.epoch_slot >= slots_) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  const auto& slot = *reinterpret_cast<const area::Slot*>(SlotAt(view.epoch_slot));
  return slot.word.load(std::memory_order_relaxed) == view.word &&
         epochs_->Stable(view.epoch_slot, view.epoch);
}

void TableReader::CopyOut(void* dst, const uint8_t* src, uint64_t bytes) {
  std::memcpy(dst, src, bytes);
}

const uint8_t* TableReader::SlotAt(uint32_t slot) const {
  return base_ + sizeof(area::Header) + uint64_t{slot} * area::kSlotBytes;
}

TableReader::SlotFields TableReader::CopySlot(const uint8_t* at) {
  alignas(8) uint8_t bytes[area::kSlotBytes];
  CopyOut(bytes, at, sizeof(bytes));
  SlotFields f;
  std::memcpy(&f.id, bytes + offsetof(area::Slot, sequence_id), 8);
  std::memcpy(&f.version, bytes + offsetof(area::Slot, version), 8);
  std::memcpy(&f.epoch, bytes + offsetof(area::Slot, epoch), 8);
  std::memcpy(&f.offset, bytes + offsetof(area::Slot, record_offset), 8);
  std::memcpy(&f.bytes, bytes + offsetof(area::Slot, record_bytes), 8);
  std::memcpy(&f.streams, bytes + offsetof(area::Slot, streams), 4);
  std::memcpy(&f.capacity, bytes + offsetof(area::Slot, capacity), 4);
  return f;
}

bool TableReader::Fits(const SlotFields& f) const {
  return f.bytes > 0 && f.offset <= bytes_ && f.bytes <= bytes_ - f.offset &&
         f.bytes == area::RecordBytes(f.streams, f.capacity);
}

absl::Status TableReader::Read(uint64_t version, BlockTable* table) const {
  if (table->epoch_slot >= slots_ || table->version == 0) {
    return absl::InvalidArgumentError(absl::StrCat("table: epoch_slot ", table->epoch_slot, " of ",
                                                   slots_, " slots, version ", table->version,
                                                   " (attach with a whole table first)"));
  }
  const uint8_t* at = SlotAt(table->epoch_slot);
  const auto& word = reinterpret_cast<const area::Slot*>(at)->word;
  // The slot, its record's counts and each stream's entries in use are copied out under the
  // seqlock, then checked and decoded from the copy: a torn copy can hold anything, and
  // `table` changes only after a clean one.
  thread_local std::vector<uint32_t> counts;
  thread_local std::vector<area::Entry> entries;
  constexpr int kTries = 64;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    const uint64_t before = word.load(std::memory_order_acquire);
    if (before % 2 == 1) continue;  // being rewritten
    const SlotFields f = CopySlot(at);
    const uint64_t id = f.id, held = f.version, epoch = f.epoch, offset = f.offset;
    const uint64_t bytes = f.bytes;
    const uint32_t streams = f.streams, capacity = f.capacity;
    const bool fits = Fits(f) && streams == table->streams.size();
    bool counted = true;  // every count within its region
    if (fits) {
      counts.resize(streams);
      CopyOut(counts.data(), base_ + offset, uint64_t{streams} * sizeof(uint32_t));
      uint64_t total = 0;
      for (uint32_t n : counts) {
        counted = counted && n <= capacity;
        total += n;
      }
      if (counted) {
        entries.resize(total);
        const uint8_t* regions = base_ + offset + area::CountsBytes(streams);
        uint64_t next = 0;
        for (uint32_t s = 0; s < streams; ++s) {
          CopyOut(entries.data() + next, regions + uint64_t{s} * capacity * sizeof(area::Entry),
                  uint64_t{counts[s]} * sizeof(area::Entry));
          next += counts[s];
        }
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (word.load(std::memory_order_relaxed) != before) continue;
    if (!fits || id != table->sequence_id || held < std::max(version, table->version)) {
      return absl::FailedPreconditionError(
          absl::StrCat("table area: slot ", table->epoch_slot, " holds ",
                       id == table->sequence_id && bytes > 0 ? absl::StrCat("version ", held)
                                                             : std::string("no table"),
                       " of sequence ", table->sequence_id, ", not version ",
                       std::max(version, table->version), " or later"));
    }
    if (!counted) {
      return absl::DataLossError(absl::StrCat("table area: slot ", table->epoch_slot,
                                              " counts more blocks than its regions hold"));
    }
    uint64_t next = 0;
    for (uint32_t s = 0; s < streams; ++s) {
      std::vector<TableBlock>& blocks = table->streams[s].blocks;
      blocks.resize(counts[s]);
      for (TableBlock& b : blocks) {
        const area::Entry& e = entries[next++];
        b = {e.id, e.offset, e.start, e.count, static_cast<Precision>(e.precision)};
      }
    }
    table->version = held;
    table->epoch = epoch;
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("table area: slot ", table->epoch_slot, " changed under ", kTries, " reads"));
}

}  // namespace kvmem::client
