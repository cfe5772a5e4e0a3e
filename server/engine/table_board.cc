#include "server/engine/table_board.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace kvmem::engine {

namespace area = v1::table_area;

absl::StatusOr<std::unique_ptr<TableBoard>> TableBoard::Create(uint32_t slots, uint64_t bytes) {
  const uint64_t heap_offset = sizeof(area::Header) + uint64_t{slots} * area::kSlotBytes;
  if (bytes < heap_offset + 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("table_area_bytes: ", bytes, " bytes hold no heap; ", slots,
                     " sequence slots need at least ", heap_offset + 4096));
  }
  absl::StatusOr<std::shared_ptr<transport::SharedSegment>> segment =
      transport::SharedSegment::Create("kvmem-tables", bytes);
  if (!segment.ok()) return segment.status();
  if (absl::Status s = (*segment)->Seal(/*writers_too=*/true); !s.ok()) return s;
  return std::unique_ptr<TableBoard>(new TableBoard(*std::move(segment), slots));
}

TableBoard::TableBoard(std::shared_ptr<transport::SharedSegment> segment, uint32_t slots)
    : segment_(std::move(segment)), slots_(slots), records_(slots) {
  uint8_t* base = segment_->data();
  const uint64_t heap_offset =
      (sizeof(area::Header) + uint64_t{slots} * area::kSlotBytes + kGrain - 1) / kGrain * kGrain;
  auto* header = new (base) area::Header{};
  header->magic = area::kMagic;
  header->slots = slots;
  header->heap_offset = heap_offset;
  header->heap_bytes = (segment_->bytes() - heap_offset) / kGrain * kGrain;
  heap_bytes_ = header->heap_bytes;
  for (uint32_t i = 0; i < slots; ++i) {
    new (base + sizeof(area::Header) + uint64_t{i} * area::kSlotBytes) area::Slot{};
  }
  kvmem::MutexLock lock(&mu_);
  // Every node the free list will ever need, made now: past this, freeing and allocating a
  // range never allocates host memory (they run under sequence locks, in a release too).
  // Free ranges lie between records, and each slot holds at most one record, two for a
  // moment while a record moves.
  for (uint64_t n = 0; n < uint64_t{slots} + 3; ++n) {
    free_.emplace(n, 0);
    spare_.push_back(free_.extract(n));
  }
  FreeList::node_type first = std::move(spare_.back());
  spare_.pop_back();
  first.key() = heap_offset;
  first.mapped() = header->heap_bytes;
  free_.insert(std::move(first));
}

TableBoard::~TableBoard() = default;

area::Slot& TableBoard::slot(uint32_t i) const {
  return *reinterpret_cast<area::Slot*>(segment_->data() + sizeof(area::Header) +
                                        uint64_t{i} * area::kSlotBytes);
}

uint64_t TableBoard::Allocate(uint64_t bytes) {
  bytes = (bytes + kGrain - 1) / kGrain * kGrain;
  kvmem::MutexLock lock(&mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - bytes;
    // The range's node is reused for what is left of it, or kept for later: no allocation.
    FreeList::node_type node = free_.extract(it);
    if (rest > 0) {
      node.key() = offset + bytes;
      node.mapped() = rest;
      free_.insert(std::move(node));
    } else {
      spare_.push_back(std::move(node));
    }
    in_use_ += bytes;
    return offset;
  }
  return 0;
}

void TableBoard::Free(uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return;
  kvmem::MutexLock lock(&mu_);
  in_use_ -= bytes;
  // Merges with the free neighbours, so that the heap does not crumble into grains; a
  // range that merges with none takes a spare node (there are more spares than ranges can
  // be: Create made one per slot and two more).
  auto next = free_.lower_bound(offset);
  auto prev = next == free_.begin() ? free_.end() : std::prev(next);
  const bool with_prev = prev != free_.end() && prev->first + prev->second == offset;
  const bool with_next = next != free_.end() && offset + bytes == next->first;
  if (with_prev && with_next) {
    prev->second += bytes + next->second;
    spare_.push_back(free_.extract(next));
  } else if (with_prev) {
    prev->second += bytes;
  } else if (with_next) {
    FreeList::node_type node = free_.extract(next);
    node.key() = offset;
    node.mapped() += bytes;
    free_.insert(std::move(node));
  } else {
    FreeList::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = offset;
    node.mapped() = bytes;
    free_.insert(std::move(node));
  }
}

uint64_t TableBoard::heap_bytes_in_use() const {
  kvmem::MutexLock lock(&mu_);
  return in_use_;
}

bool TableBoard::Holds(uint32_t i, uint64_t id, uint64_t version) const {
  const Record& r = records_[i];
  return r.bytes > 0 && r.id == id && r.version == version;
}

void TableBoard::WriteEntries(const Stream& st, const store::BlockPool& pool, size_t from,
                              size_t to, area::Entry* out) {
  for (size_t j = from; j < to; ++j) {
    const StreamBlock& b = st.blocks()[j];
    // kvmem.proto's Precision: PRECISION_LAYOUT = 1, then INT8, INT4, NF4 in our order.
    out[j] = {pool.offset(b.id), b.id, b.start, b.count, static_cast<uint32_t>(b.precision) + 1};
  }
}

bool TableBoard::Write(const Sequence& seq, const store::BlockPool& pool) {
  const uint32_t i = seq.epoch_slot();
  Record& r = records_[i];
  if (r.bytes > 0 && r.id == seq.id() && r.version == seq.version()) return true;
  const auto streams = static_cast<uint32_t>(seq.streams().size());
  size_t longest = 0;
  for (const Stream& st : seq.streams()) longest = std::max(longest, st.blocks().size());
  // What the record holds can be brought forward stream by stream: the same sequence, at a
  // version the sequence published (so that its entries' published indexes say where each
  // sits in the record), with room for the longest stream.
  const int which = r.id == seq.id() ? seq.PublishedSlot(r.version) : -1;
  // A record too small moves to a larger one; one more than twice too large (after a
  // compression) to a smaller one, so that it does not crowd out the others.
  const bool resize = r.bytes == 0 || r.streams != streams || longest > r.capacity ||
                      r.capacity > 2 * (longest + 2);
  bool fresh = resize || which < 0;
  uint64_t old_offset = 0, old_bytes = 0;
  if (resize) {
    // Room for a quarter more blocks, so that a growing table does not move at every step.
    const auto capacity = static_cast<uint32_t>(longest + longest / 4 + 2);
    const uint64_t bytes = (area::RecordBytes(streams, capacity) + kGrain - 1) / kGrain * kGrain;
    old_offset = r.offset;
    old_bytes = r.bytes;
    r.offset = Allocate(bytes);
    r.bytes = r.offset == 0 ? 0 : bytes;
    if (r.bytes == 0) misses_.fetch_add(1, std::memory_order_relaxed);
    r.streams = streams;
    r.capacity = capacity;
    fresh = true;
  }
  area::Slot& s = slot(i);
  uint8_t* base = segment_->data();
  const uint64_t word = s.word.load(std::memory_order_relaxed);
  s.word.store(word + 1, std::memory_order_relaxed);
  // Orders the odd word before the writes that follow (a reader that sees any of them sees
  // the word change).
  std::atomic_thread_fence(std::memory_order_release);
  if (r.bytes == 0) {
    r = Record{};
    s.sequence_id = 0;
    s.record_offset = s.record_bytes = 0;
  } else {
    auto* counts = reinterpret_cast<uint32_t*>(base + r.offset);
    auto* regions = reinterpret_cast<area::Entry*>(base + r.offset + area::CountsBytes(streams));
    for (uint32_t st = 0; st < streams; ++st) {
      const Stream& stream = seq.streams()[st];
      const std::vector<StreamBlock>& blocks = stream.blocks();
      area::Entry* out = regions + uint64_t{st} * r.capacity;
      if (!fresh && stream.changed_version() <= r.version) continue;  // as the record has it
      // The run the changes since the record's version left as it was moves as a whole
      // (checked as Engine's deltas check it); the rest is written.
      const Stream::UntouchedRun& run = stream.untouched();
      const bool keep_run = !fresh && run.size() > 0 && run.end <= blocks.size() &&
                            stream.untouched_base() == r.version &&
                            blocks[run.begin].version <= r.version &&
                            blocks[run.end - 1].version <= r.version &&
                            static_cast<ptrdiff_t>(blocks[run.begin].published_index[which]) ==
                                static_cast<ptrdiff_t>(run.begin) - run.shift &&
                            static_cast<ptrdiff_t>(blocks[run.end - 1].published_index[which]) ==
                                static_cast<ptrdiff_t>(run.end - 1) - run.shift;
      if (keep_run) {
        if (run.shift != 0) {
          std::memmove(out + run.begin, out + (static_cast<ptrdiff_t>(run.begin) - run.shift),
                       run.size() * sizeof(area::Entry));
        }
        WriteEntries(stream, pool, 0, run.begin, out);
        WriteEntries(stream, pool, run.end, blocks.size(), out);
      } else {
        WriteEntries(stream, pool, 0, blocks.size(), out);
      }
      counts[st] = static_cast<uint32_t>(blocks.size());
    }
    r.id = seq.id();
    r.version = seq.version();
    s.sequence_id = seq.id();
    s.version = seq.version();
    s.epoch = seq.epoch();
    s.record_offset = r.offset;
    s.record_bytes = area::RecordBytes(streams, r.capacity);
    s.streams = streams;
    s.capacity = r.capacity;
  }
  s.word.store(word + 2, std::memory_order_release);
  // A reader still copying from the old range sees the word moved on and drops the copy.
  Free(old_offset, old_bytes);
  return r.bytes > 0;
}

void TableBoard::Clear(uint32_t i) {
  Record& r = records_[i];
  area::Slot& s = slot(i);
  const uint64_t word = s.word.load(std::memory_order_relaxed);
  s.word.store(word + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.sequence_id = 0;
  s.record_offset = s.record_bytes = 0;
  s.word.store(word + 2, std::memory_order_release);
  Free(r.offset, r.bytes);
  r = Record{};
}

}  // namespace kvmem::engine
