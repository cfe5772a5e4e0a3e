#pragma once
// The binary layout of a step channel's segment (OpenStepChannel in kvmem.proto), shared by
// kvmemd and same-host clients. One request is in flight at a time:
//
//   client: writes a serialized StepBatchRequest at request_offset, its length to
//           request_bytes and kBatch to request_kind, then request_seq + 1 (release), and
//           wakes request_seq's futex;
//   daemon: sees request_seq change (acquire), copies the request out of the segment (and
//           drops it if request_seq moved on meanwhile: a client that gave up on it and
//           posted another), parses and runs the copy, writes the answer at response_offset with
//           response_bytes, response_total and response_code, then sets response_seq to the
//           request_seq it served (release) and wakes its futex.
//
// response_code 0: the area holds a StepBatchResponse, or its first response_bytes when
// response_total is larger: the client then asks for the rest with kMore requests (no
// request bytes), each answered with the next chunk, until it holds response_total bytes.
// Any other code: the call failed as a whole and the area holds a google.rpc.Status.
//
// The client checks `nonce` against OpenStepChannelResponse.nonce: the segment it received
// (by descriptor, kvmem/v1/attach.h) is the channel it opened. Futexes are the shared (not
// private) kind: the two sides are separate processes.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <ctime>

namespace kvmem::v1::step_channel {

inline constexpr uint32_t kMagic = 0x4B565343;  // "KVSC"
inline constexpr uint32_t kLayoutVersion = 2;   // 2: nonce, request kinds, chunked answers
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint32_t kNonceBytes = 16;
enum RequestKind : uint32_t { kBatch = 0, kMore = 1 };

struct Header {
  uint32_t magic;
  uint32_t layout_version;
  uint64_t request_offset;
  uint64_t response_offset;
  uint64_t capacity_bytes;  // of each area
  uint8_t nonce[kNonceBytes];
  alignas(64) std::atomic<uint32_t> request_seq;
  std::atomic<uint32_t> request_bytes;
  std::atomic<uint32_t> request_kind;
  alignas(64) std::atomic<uint32_t> response_seq;
  std::atomic<uint32_t> response_bytes;
  std::atomic<uint32_t> response_code;
  std::atomic<uint64_t> response_total;
};
static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Blocks while *word == expected, for at most `timeout_ns`; returns on a wake, a change,
// a signal or the timeout (the caller re-reads the word).
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000),
              static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace kvmem::v1::step_channel

// A channel's signal area (OpenStepChannelRequest.signal_bytes): a second segment the client
// writes and the daemon reads, each entry's attention rows at the offset its
// StepSignals.attention_offset names:
//
//   RowsHeader, then `rows` RowEntry, then each row's `length` values in entry order
//   (little-endian f32, or IEEE halves when dtype is kF16), packed.
//
// The daemon copies what an entry names out of the area before it checks or uses it (the
// client may write the area at any time), bounded by the area's size: a header, entry or
// row past its end is INVALID_ARGUMENT for that entry alone. Write an entry's rows before
// posting its batch and leave them until the answer comes.
namespace kvmem::v1::signal_area {

enum DType : uint32_t { kF32 = 0, kF16 = 1 };
inline constexpr uint32_t kMaxRows = 1u << 16;

struct RowsHeader {
  uint32_t rows;
  uint32_t dtype;
};

struct RowEntry {
  uint32_t layer;
  uint32_t kv_head;
  uint32_t length;  // values in this row
  uint32_t reserved;
};
static_assert(sizeof(RowsHeader) == 8 && sizeof(RowEntry) == 16);

}  // namespace kvmem::v1::signal_area
