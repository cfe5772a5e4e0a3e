#pragma once
// What parsing a request may allocate, counted before it is parsed. A protobuf message of
// tiny records parses into many times its wire size (an empty StepBatchEntry is 2 bytes on
// the wire and an object of a few hundred once parsed; a packed position of one byte becomes
// eight), so a limit on wire bytes (gRPC's ResourceQuota, a step channel's capacity) does not
// bound it. ParseCost reads the wire form without building anything and bounds what a parse
// allocates; kvmemd reserves that bound from its ParseBudget (kvmemd --parse-memory-bytes)
// before parsing and holds it while the request lives (service::Parsed).
#include <atomic>
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace kvmem::transport {

// At least the bytes that parsing `wire` as a `type` holds at its peak (objects, strings,
// repeated fields' storage at three times their count — the old array and the new while
// one grows — or four times on an arena, where old arrays stay;
// unknown fields; the allocator's own bytes per block); InvalidArgument when `wire` is not
// a `type` (protobuf would not parse it either) or nests deeper than protobuf's limit.
// On an arena (`on_arena`), strings' bytes still go to the heap: count the whole cost
// against anything but the arena's own blocks.
absl::StatusOr<uint64_t> ParseCost(const google::protobuf::Descriptor* type,
                                   google::protobuf::io::ZeroCopyInputStream* wire,
                                   bool on_arena = false);
absl::StatusOr<uint64_t> ParseCost(const google::protobuf::Descriptor* type, absl::string_view wire,
                                   bool on_arena = false);
// What ParseCost counts for a string or bytes field of `length` bytes (three times the
// length past protobuf's safe string size: it grows by doubling).
uint64_t StringParseBytes(uint64_t length);

// Bytes of parsed requests held at once, in the whole process (kvmemd serves one Server).
class ParseBudget {
 public:
  // The process's budget (1 GiB until SetCapacity).
  static ParseBudget& Process();

  // Holds reserved bytes until destroyed.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept {
      if (this != &other) {
        Release();
        budget_ = std::exchange(other.budget_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
      }
      return *this;
    }
    ~Reservation() { Release(); }
    uint64_t bytes() const { return bytes_; }
    void Release();

   private:
    friend class ParseBudget;
    ParseBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  explicit ParseBudget(uint64_t capacity) : capacity_(capacity) {}
  void SetCapacity(uint64_t bytes) { capacity_.store(bytes, std::memory_order_relaxed); }
  uint64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  uint64_t reserved() const { return reserved_.load(std::memory_order_relaxed); }
  // `bytes` more, or RESOURCE_EXHAUSTED naming `what` (the request), the flag and what is
  // free; nothing is held then.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, absl::string_view what);

 private:
  std::atomic<uint64_t> capacity_;
  std::atomic<uint64_t> reserved_{0};
};

}  // namespace kvmem::transport
