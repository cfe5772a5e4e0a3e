#include "server/engine/epoch_board.h"

#include "absl/strings/str_cat.h"

namespace kvmem::engine {

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "epoch words are shared across processes and must be lock-free");

absl::StatusOr<std::unique_ptr<EpochBoard>> EpochBoard::Create(uint32_t slots) {
  absl::StatusOr<std::shared_ptr<transport::SharedSegment>> segment =
      transport::SharedSegment::Create("kvmem-epochs", uint64_t{slots} * kStride);
  if (!segment.ok()) return segment.status();
  // Readers only: a client's descriptor maps it read-only, however it reopens it.
  if (absl::Status s = (*segment)->Seal(/*writers_too=*/true); !s.ok()) return s;
  return std::unique_ptr<EpochBoard>(new EpochBoard(*std::move(segment), slots));
}

EpochBoard::EpochBoard(std::shared_ptr<transport::SharedSegment> segment, uint32_t slots)
    : segment_(std::move(segment)), slots_(slots) {
  for (uint32_t s = slots; s-- > 0;) {
    new (segment_->data() + uint64_t{s} * kStride) std::atomic<uint64_t>(0);
    free_slots_.push_back(s);
  }
}

std::atomic<uint64_t>* EpochBoard::word(uint32_t slot) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(segment_->data() + uint64_t{slot} * kStride);
}

absl::StatusOr<uint32_t> EpochBoard::Acquire(uint64_t epoch) {
  kvmem::MutexLock lock(&mu_);
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequences: all ", slots_, " sequence slots are in use (--max-sequences)"));
  }
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  word(slot)->store(2 * epoch, std::memory_order_release);
  return slot;
}

void EpochBoard::Release(uint32_t slot) {
  // Odd until reused, so a reader still holding a table of the released sequence fails;
  // epochs are unique across sequences, so the next owner never republishes its value.
  word(slot)->fetch_or(1, std::memory_order_acq_rel);
  kvmem::MutexLock lock(&mu_);
  free_slots_.push_back(slot);
}

void EpochBoard::BeginWrite(uint32_t slot, uint64_t epoch) {
  word(slot)->store(2 * epoch + 1, std::memory_order_relaxed);
  // Orders the odd word before any data write that follows.
  std::atomic_thread_fence(std::memory_order_release);
}

void EpochBoard::EndWrite(uint32_t slot, uint64_t epoch) {
  word(slot)->store(2 * epoch, std::memory_order_release);
}

uint64_t EpochBoard::Load(uint32_t slot) const {
  return word(slot)->load(std::memory_order_acquire);
}

}  // namespace kvmem::engine
