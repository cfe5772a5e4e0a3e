#pragma once
// Shared by the CUDA backend's files: CUDA runtime errors as absl::Status (never an abort;
// out of memory is RESOURCE_EXHAUSTED, a missing device or driver FAILED_PRECONDITION,
// anything else INTERNAL, the message naming the operation), the memory a call borrows
// (device scratch from a stream-ordered pool, pinned staging), the slot states' scratch
// pool, and the device SlotState's factory.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/store/slot_state.h"

namespace kvmem::store {

inline absl::Status FromCuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(message);
  }
  return absl::InternalError(message);
}

inline uint64_t Align16(uint64_t n) { return (n + 15) / 16 * 16; }

// What a CudaMemoryPool keeps reserved across synchronizations (its release threshold): all
// of it, the high-water mark, as the grown buffers before it did. Move, Write and Quantize
// run inside a write section, past a mutation's point of no return: scratch taken there
// from the driver could fail for memory the inference engine took meanwhile and poison the
// sequence; kept, only a new peak can.
inline constexpr uint64_t kScratchReleaseThreshold = ~uint64_t{0};

// One allocation from a CudaMemoryPool, owned. Release (or the destructor) frees it on the
// stream it was allocated on (cudaFreeAsync): work queued there before still uses it, the
// host waits for nothing, and the memory goes back to the pool once the stream gets there.
// The stream must outlive it. Move-only.
class StreamOrderedBuffer {
 public:
  StreamOrderedBuffer() = default;
  StreamOrderedBuffer(uint8_t* data, uint64_t bytes, cudaStream_t stream)
      : data_(data), bytes_(bytes), stream_(stream) {}
  StreamOrderedBuffer(StreamOrderedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        stream_(other.stream_) {}
  StreamOrderedBuffer& operator=(StreamOrderedBuffer&& other) noexcept;
  StreamOrderedBuffer(const StreamOrderedBuffer&) = delete;
  StreamOrderedBuffer& operator=(const StreamOrderedBuffer&) = delete;
  ~StreamOrderedBuffer() { Release(); }

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // Frees on the stream now; data() is nullptr after. No work may be queued on it after this.
  void Release();

 private:
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

// A stream-ordered memory pool of one device's memory (cudaMemPoolCreate), for the device
// scratch of calls: cudaMallocFromPoolAsync on the call's stream, cudaFreeAsync on it before
// the call's final wait, so neither waits for the device (cudaMalloc and cudaFree do) and the
// next call reuses the memory. One per backend, shared with its slot states (their streams
// differ; the pool orders reuse across them). Outstanding allocations keep the pool's memory
// alive past its destruction (the runtime releases it with the last one).
class CudaMemoryPool {
 public:
  // FAILED_PRECONDITION where the device has no memory pools, else as FromCuda.
  static absl::StatusOr<std::shared_ptr<CudaMemoryPool>> Create(
      int device, uint64_t release_threshold = kScratchReleaseThreshold);
  ~CudaMemoryPool();
  CudaMemoryPool(const CudaMemoryPool&) = delete;
  CudaMemoryPool& operator=(const CudaMemoryPool&) = delete;

  int device() const { return device_; }
  // `bytes` of the pool's device for work queued on `stream` from now on (whatever device
  // the calling thread has current); 0 bytes is an empty buffer. Out of memory is
  // RESOURCE_EXHAUSTED naming `what`.
  absl::StatusOr<StreamOrderedBuffer> Allocate(uint64_t bytes, cudaStream_t stream,
                                               absl::string_view what) const;

 private:
  CudaMemoryPool(int device, cudaMemPool_t pool) : device_(device), pool_(pool) {}
  const int device_;
  const cudaMemPool_t pool_;
};

// Pinned host memory (cudaMallocHost) for the transfers, grown on demand to a power of two
// and kept. Not a host memory pool (cudaMemPoolCreate with cudaMemLocationTypeHost): its
// allocations are stream-ordered, so the CPU may touch one only after the stream has reached
// it, and every call that fills its staging before the upload (Write, Append, Step, Keep,
// WriteScores) would wait for the device once more; drivers without host pools
// (cudaDevAttrHostMemoryPoolsSupported) would need this path anyway. Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();  // cudaFreeHost waits for the device

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // Makes bytes() at least `bytes`, the contents lost when it grows; out of memory is
  // RESOURCE_EXHAUSTED naming `what` (and leaves the buffer empty).
  absl::Status Reserve(uint64_t bytes, absl::string_view what);

 private:
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Per-call scratch of the slot states (device memory from the backend's CudaMemoryPool and
// pinned host memory), shared by all sequences of a backend: a sequence holds only what
// persists between calls, and pinned memory grows with the calls in flight, not with the
// sequences alive (cuda_slot_state.cc).
class CudaScratchPool;
absl::StatusOr<std::shared_ptr<CudaScratchPool>> MakeCudaScratchPool(
    std::shared_ptr<const CudaMemoryPool> memory);

// A SlotState in device memory on `device` (cuda_slot_state.cc).
absl::StatusOr<std::unique_ptr<SlotState>> MakeCudaSlotState(
    uint32_t num_streams, int device, std::shared_ptr<CudaScratchPool> scratch);

}  // namespace kvmem::store
