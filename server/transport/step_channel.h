#pragma once
// StepChannel: the daemon's side of a same-host step channel (OpenStepChannel in
// kvmem.proto, layout in proto/kvmem/v1/step_channel.h): a shared segment through which
// one client sends StepBatch requests. The daemon reads it as untrusted input: lengths are
// checked against its own copy of the capacity, the request is parsed into the daemon's
// memory before anything runs, and every access to the segment is inside a SegmentGuard,
// so that a client that shrinks the segment gets its channel closed, not the daemon killed.
//
// StepChannelBudget bounds what the open channels hold, daemon-wide: how many there are
// (each keeps one gRPC thread serving it) and their segments' bytes (contract 3).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/transport/shared_segment.h"

namespace kvmem::transport {

class StepChannelBudget {
 public:
  class Lease {
   public:
    Lease(Lease&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) {
      other.budget_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();

   private:
    friend class StepChannelBudget;
    Lease(StepChannelBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
    StepChannelBudget* budget_;
    uint64_t bytes_;
  };

  StepChannelBudget(uint32_t max_channels, uint64_t max_bytes)
      : max_channels_(max_channels), max_bytes_(max_bytes) {}
  // RESOURCE_EXHAUSTED naming --max-step-channels or --step-channel-bytes when a channel
  // of `bytes` would pass either.
  absl::StatusOr<Lease> Open(uint64_t bytes);
  uint32_t open() const;

 private:
  const uint32_t max_channels_;
  const uint64_t max_bytes_;
  mutable absl::Mutex mu_;
  uint32_t channels_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

class StepChannel {
 public:
  // Runs one parsed batch into `response`; its status is the call's.
  using Handler = std::function<grpc::Status(const v1::StepBatchRequest&, v1::StepBatchResponse*)>;
  // kBroken: the segment faulted while a request was read (nothing of it ran);
  // kBrokenAfterRun: while its answer was written (the batch ran; its answer is lost).
  enum class Served { kIdle, kServed, kBroken, kBrokenAfterRun };

  static constexpr uint64_t kDefaultCapacity = 8ull << 20;
  static constexpr uint64_t kMinCapacity = 1ull << 20;
  static uint64_t SegmentBytes(uint64_t capacity);
  // The longest answer a channel sends (past the area's capacity, in chunks): FitAnswer
  // trims a longer one to it.
  // (Below 2 GiB, which protobuf cannot serialize, for the largest capacity.)
  static constexpr uint64_t MaxAnswerBytes(uint64_t capacity) {
    return std::min<uint64_t>(2 * capacity, (2ull << 30) - (1ull << 20));
  }
  // The daemon memory a channel holds: its segment, its copy of a request, the first block
  // of its parse arena, and an answer of MaxAnswerBytes twice (as built, and serialized
  // while its chunks are pending); with a signal area, the area and what a batch may copy
  // out of it (at most three times its size: the service's SignalsFromArea).
  static uint64_t HeldBytes(uint64_t capacity, uint64_t signal_bytes = 0);
  // Trims `response` to at most `limit` serialized bytes, so that what a channel holds stays
  // bounded: table updates go first, from the last entry back (an applied entry without
  // its update makes its client fetch the table); then, from the back, the statuses'
  // details and their messages past kMaxDetailTextBytes. A result then takes at most
  // kMaxTrimmedResultBytes, so that kMaxBatchEntries of them fit any channel's answer.
  // Returns the answer's bytes (its sizes cached for SerializeWithCachedSizes).
  static size_t FitAnswer(v1::StepBatchResponse* response, uint64_t limit);
  static constexpr uint64_t kMaxTrimmedResultBytes = 512;

  // How the channel's own errors (a malformed request) reach its client: the service's
  // mapping of an absl::Status to a gRPC status with its details.
  using ErrorMapper = std::function<grpc::Status(const absl::Status&)>;
  // A fresh segment with its header written; `capacity` bytes per direction; a signal area
  // of `signal_bytes` (0: none) in a segment of its own.
  static absl::StatusOr<std::unique_ptr<StepChannel>> Create(uint64_t capacity, ErrorMapper to_grpc,
                                                             uint64_t signal_bytes = 0);
  static constexpr uint64_t kMaxSignalBytes = 1ull << 30;

  const std::string& nonce() const { return nonce_; }
  uint64_t segment_bytes() const { return segment_->bytes(); }
  uint64_t capacity() const { return capacity_; }
  // The segments, for the attach socket's grants: the channel's and its signal area (null
  // when none).
  std::weak_ptr<const SharedSegment> segment() const { return segment_; }
  std::weak_ptr<const SharedSegment> signal_segment() const { return signals_; }
  // The signal area's size (step_channel.h's signal_area layout; 0: none).
  uint64_t signal_bytes() const { return signals_ ? signals_->bytes() : 0; }
  // Copies [offset, offset + bytes) of the signal area to `out`, inside a SegmentGuard.
  // INVALID_ARGUMENT naming `field` for a range outside the area or no area;
  // FAILED_PRECONDITION once the client has shrunk it (what was read is void; every later
  // read fails too). Safe from any thread that holds no other SegmentGuard.
  absl::Status CopySignals(uint64_t offset, uint64_t bytes, void* out,
                           absl::string_view field) const;
  // The same for `count` values at `offset`, halves (f16) widened to floats as they are read
  // (one pass, nothing staged) or floats copied.
  absl::Status ReadSignalValues(uint64_t offset, uint64_t count, bool f16, float* out,
                                absl::string_view field) const;
  // Whether a read has found the area shrunk. Reads on several threads at once: a fault in
  // one replaces the whole mapping with zeros under the others, whose own sections may not
  // fault, so after them the caller asks this (everything they read is void when true).
  bool signals_broken() const { return signals_broken_.load(std::memory_order_acquire); }
  // An answer larger than the area (up to MaxAnswerBytes) is partly sent: its client will
  // ask for the rest.
  bool chunks_pending() const { return !pending_.empty(); }

  // What one answered request moved, for the daemon's RPC metrics.
  struct Exchange {
    bool batch = false;  // a kBatch request (a StepBatch call); else a chunk asked for
    int code = 0;        // the answer's grpc::StatusCode
    uint64_t bytes_in = 0, bytes_out = 0;  // the request read, this answer's bytes
    double seconds = 0;                    // from the request seen to its answer written
    std::chrono::steady_clock::time_point seen;
  };
  using Recorder = std::function<void(const Exchange&)>;
  // Waits up to `wait` for a request and answers it with `handler` (or, for kMore, with
  // the next chunk of the answer too large for the area). kIdle: none came. After kBroken
  // or kBrokenAfterRun the channel must be closed. `record` (when set) sees every answer
  // before its client can: a client that reads the metrics after its call finds it there.
  Served ServeOne(absl::Duration wait, const Handler& handler, const Recorder& record = nullptr);

 private:
  // Bounds-checks [offset, offset + bytes) and runs read(address) on it inside a
  // SegmentGuard (CopySignals' contract).
  template <typename Read>
  absl::Status ReadSignals(uint64_t offset, uint64_t bytes, absl::string_view field,
                           const Read& read) const;
  StepChannel(std::shared_ptr<SharedSegment> segment, std::shared_ptr<SharedSegment> signals,
              uint64_t capacity, std::string nonce, ErrorMapper to_grpc)
      : to_grpc_(std::move(to_grpc)),
        segment_(std::move(segment)),
        signals_(std::move(signals)),
        capacity_(capacity),
        nonce_(std::move(nonce)),
        request_copy_(new char[capacity]),
        arena_block_(new char[ArenaBlockBytes(capacity)]) {}
  static uint64_t ArenaBlockBytes(uint64_t capacity) { return capacity + (256u << 10); }
  // Writes the next chunk of pending_ as the answer to `seq`.
  void SendChunk(uint32_t seq, Exchange& exchange, const Recorder& record);
  // Publishes the answer to `seq` already in the area, after `record` has seen it.
  void Answer(uint32_t seq, uint32_t code, uint64_t bytes, uint64_t total, Exchange& exchange,
              const Recorder& record);
  const ErrorMapper to_grpc_;
  std::shared_ptr<SharedSegment> segment_;
  std::shared_ptr<SharedSegment> signals_;  // null: no signal area
  mutable std::atomic<bool> signals_broken_{false};
  const uint64_t capacity_;  // the daemon's own copy: the header's may be overwritten
  const std::string nonce_;
  // Each request is copied here before it is parsed: the segment may change under a parse.
  std::unique_ptr<char[]> request_copy_;
  // The first block of each request's arena: parsing and answering a batch that fits it
  // allocates nothing (no malloc of the K/V bytes, no heap growth and trim per step).
  std::unique_ptr<char[]> arena_block_;
  uint32_t served_seq_ = 0;
  // The rest of an answer larger than the area, sent chunk by chunk (kMore); dropped when
  // the next batch comes.
  std::string pending_;
  size_t pending_sent_ = 0;
};

}  // namespace kvmem::transport
