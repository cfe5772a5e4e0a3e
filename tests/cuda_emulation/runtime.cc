// The emulated CUDA runtime (cuda_runtime_api.h) and the kernels' launchers on their C++
// reference twins, which report through the last-error record as the real ones do.
//
// Streams are asynchronous here too: the work queued on a stream (copies, launches) runs
// only when something waits for it — cudaStreamSynchronize, cudaFree/cudaFreeHost (which
// wait for the whole device), the stream's destruction — as a GPU may run it late. Host code
// that reads a result before it waits, or reuses a buffer a queued copy still reads, sees the
// wrong bytes here as it would on a GPU. The runtime's own rules for pageable host memory are
// kept: cudaMemcpyAsync from pageable memory takes the bytes when called, into pageable
// memory it returns once the copy is done; only pinned memory (cudaMallocHost) is read and
// written when the stream gets to the copy.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "cuda_runtime_api.h"
#include "kernels/cuda_launch.h"

// A stream: its queued work, run in order when waited for.
struct CUstream_st {
  int device = 0;  // the current device when it was made
  std::mutex mu;
  std::vector<std::function<void()>> work;

  void Run() {
    std::lock_guard<std::mutex> lock(mu);
    for (std::function<void()>& f : work) f();
    work.clear();
  }
};

namespace {

std::atomic<size_t> live{0};
// What a step costs a GPU beyond its work: the times the host waits for the device, the
// copies between them and the kernel launches (kvmem::cuda_emulation::Count).
std::atomic<size_t> waits{0}, transfers{0}, launches{0};

// The runtime's per-thread record of the last failed call: cudaGetLastError returns it and
// clears it, and a launch reports through it (kernels::cuda::Launched).
thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t Record(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

// What the runtime made: live streams, and device and pinned host allocations by start.
struct Allocation {
  size_t bytes;
  int device;   // the current device when it was made (device memory)
  bool pinned;  // cudaMallocHost
};
std::mutex registry_mu;
std::set<cudaStream_t> streams;
std::map<uintptr_t, Allocation> allocations;

// The allocation holding `p`, if the runtime made one (nullptr, pageable memory: none).
std::optional<Allocation> Find(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = allocations.upper_bound(at);
  if (p == nullptr || it == allocations.begin()) return std::nullopt;
  --it;
  if (at >= it->first + it->second.bytes) return std::nullopt;
  return it->second;
}

bool IsPinned(const void* p) {
  const std::optional<Allocation> a = Find(p);
  return a.has_value() && a->pinned;
}

// The legacy default stream (nullptr): as late as the others, run by its own waits and by
// the device-wide ones, never by a wait on a non-blocking stream (the only kind made here).
CUstream_st legacy;
CUstream_st& Of(cudaStream_t stream) { return stream == nullptr ? legacy : *stream; }

// Whether every device pointer of a launch is memory of this thread's current device: a
// kernel on one GPU that reads another's memory faults (the emulation makes that a launch
// error). Pointers it does not know (nullptr, host memory) pass.
bool OnCurrentDevice(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    const std::optional<Allocation> a = Find(p);
    if (a.has_value() && !a->pinned && a->device != current_device) return false;
  }
  return true;
}

// Work on `stream` (nullptr: the legacy default stream).
void Enqueue(cudaStream_t stream, std::function<void()> f) {
  CUstream_st& s = Of(stream);
  std::lock_guard<std::mutex> lock(s.mu);
  s.work.push_back(std::move(f));
}

// A kernel reading and writing `pointers`: refused (a launch error) when one of them, or the
// stream, is another device's, else queued like any other work, and counted.
void Launch(cudaStream_t stream, std::initializer_list<const void*> pointers,
            std::function<void()> f) {
  if (!OnCurrentDevice(pointers) || (stream != nullptr && stream->device != current_device)) {
    Record(cudaErrorInvalidDevice);
    return;
  }
  ++launches;
  Enqueue(stream, std::move(f));
}

// What a device-wide synchronization does: every stream's queued work runs (under the
// registry's lock, so that no stream is destroyed meanwhile; queued work takes no locks).
void RunAllStreams() {
  legacy.Run();
  std::lock_guard<std::mutex> lock(registry_mu);
  for (cudaStream_t s : streams) s->Run();
}

// Fresh "device" memory is not zero on a GPU: fill it with a pattern so that code relying on
// zeros fails here too.
cudaError_t Allocate(void** ptr, size_t bytes, bool pinned) {
  if (bytes > kvmem::cuda_emulation::kDeviceBytes) return Record(cudaErrorMemoryAllocation);
  const size_t held = bytes == 0 ? 1 : bytes;
  *ptr = std::malloc(held);
  if (*ptr == nullptr) return Record(cudaErrorMemoryAllocation);
  std::memset(*ptr, 0xa5, bytes);
  ++live;
  std::lock_guard<std::mutex> lock(registry_mu);
  allocations[reinterpret_cast<uintptr_t>(*ptr)] = {held, current_device, pinned};
  return cudaSuccess;
}

cudaError_t Release(void* ptr) {
  if (ptr != nullptr) {
    ++waits;
    RunAllStreams();  // cudaFree and cudaFreeHost wait for the device
    {
      std::lock_guard<std::mutex> lock(registry_mu);
      allocations.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    std::free(ptr);
    --live;
  }
  return cudaSuccess;
}

}  // namespace

namespace kvmem::cuda_emulation {
size_t LiveAllocations() { return live.load(); }
Counts Count() { return {waits.load(), transfers.load(), launches.load()}; }
}  // namespace kvmem::cuda_emulation

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    default:
      return "cudaErrorInvalidValue";
  }
}
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "emulated CUDA runtime error";
}
cudaError_t cudaGetLastError() { return std::exchange(last_error, cudaSuccess); }
cudaError_t cudaGetDeviceCount(int* count) {
  *count = kvmem::cuda_emulation::kDevices;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kvmem::cuda_emulation::kDevices) {
    return Record(cudaErrorInvalidDevice);
  }
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= kvmem::cuda_emulation::kDevices) {
    return Record(cudaErrorInvalidDevice);
  }
  std::memset(prop, 0, sizeof *prop);
  std::strcpy(prop->name, "emulated CUDA device (host memory)");
  for (int i = 0; i < 16; ++i) prop->uuid.bytes[i] = static_cast<char>(i * 17 + device);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = kvmem::cuda_emulation::kDeviceBytes;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** ptr, size_t bytes) { return Allocate(ptr, bytes, false); }
cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return Allocate(ptr, bytes, true); }
cudaError_t cudaFree(void* ptr) { return Release(ptr); }
cudaError_t cudaFreeHost(void* ptr) { return Release(ptr); }
// Device memory: queued on its stream like a kernel (cudaMemset: the legacy one).
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  Enqueue(stream, [ptr, value, bytes] { std::memset(ptr, value, bytes); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Record(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDeviceToDevice) ++transfers;
  ++waits;
  legacy.Run();  // a copy on the legacy stream, after its earlier work
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Record(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDeviceToDevice) ++transfers;
  if (kind == cudaMemcpyDeviceToHost && !IsPinned(dst)) {  // returns once the copy is done
    ++waits;
    Of(stream).Run();
    std::memcpy(dst, src, bytes);
    return cudaSuccess;
  }
  if (kind == cudaMemcpyHostToDevice && !IsPinned(src)) {  // the bytes are taken now
    auto taken = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src),
                                                        static_cast<const uint8_t*>(src) + bytes);
    Enqueue(stream, [dst, taken] { std::memcpy(dst, taken->data(), taken->size()); });
    return cudaSuccess;
  }
  Enqueue(stream, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = new CUstream_st;
  (*stream)->device = current_device;
  std::lock_guard<std::mutex> lock(registry_mu);
  streams.insert(*stream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  stream->Run();  // the queued work still completes
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    streams.erase(stream);
  }
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ++waits;
  Of(stream).Run();
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle->reserved, &ptr, sizeof ptr);
  return cudaSuccess;
}
// Same process only: the handle carries the pointer; a handle of nothing fails.
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int) {
  std::memcpy(ptr, handle.reserved, sizeof *ptr);
  return *ptr == nullptr ? Record(cudaErrorInvalidValue) : cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void*) { return cudaSuccess; }

namespace kvmem::kernels::cuda {

cudaError_t CopyBatch(const uint8_t* src, uint8_t* dst, const CopyOp* ops, uint32_t n,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {src, dst, ops}, [=] { CopyBatchRef(src, dst, ops, n); });
  });
}

cudaError_t QuantizeBlocks(uint8_t* base, ElemType elem, QuantGeometry g,
                           const QuantizeDeviceOp* ops, uint32_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {base, ops}, [=] {
      for (uint32_t i = 0; i < n; ++i) {
        QuantizeBlockRef(base + ops[i].src, elem, g, ops[i].start, ops[i].count, base + ops[i].dst);
      }
    });
  });
}

cudaError_t DequantizeBlocks(const uint8_t* base, QuantGeometry g, ElemType elem,
                             const DequantizeDeviceOp* ops, uint32_t n, uint8_t* out,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {base, ops, out}, [=] {
      for (uint32_t i = 0; i < n; ++i) {
        DequantizeBlockRef(base + ops[i].src, g, ops[i].start, ops[i].count, elem,
                           out + ops[i].k_out, out + ops[i].v_out);
      }
    });
  });
}

cudaError_t UpdateScores(ScoreRule rule, float lambda, const StreamSlice* streams,
                         uint32_t num_streams, const float* attention, float* scores,
                         float* stream_max, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {streams, attention, scores, stream_max}, [=] {
      UpdateScoresRef(rule, lambda, streams, num_streams, attention, scores, stream_max);
    });
  });
}

cudaError_t SelectTop(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                      const float* stream_max, const int64_t* positions, float attention_weight,
                      uint8_t* keep, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {streams, scores, stream_max, positions, keep}, [=] {
      SelectTopRef(streams, num_streams, scores, stream_max, positions, attention_weight, keep);
    });
  });
}

cudaError_t SelectThreshold(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                            const float* threshold, uint8_t* keep, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {streams, scores, threshold, keep},
           [=] { SelectThresholdRef(streams, num_streams, scores, threshold, keep); });
  });
}

cudaError_t CompactSlots(const StreamSlice* streams, uint32_t num_streams, const uint8_t* keep,
                         float* scores, int64_t* positions, uint32_t* kept_index, uint32_t* kept,
                         cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {streams, keep, scores, positions, kept_index, kept}, [=] {
      CompactSlotsRef(streams, num_streams, keep, scores, positions, kept_index, kept);
    });
  });
}

cudaError_t CompactRows(const StreamSlice* streams, uint32_t num_streams,
                        const uint32_t* kept_index, const uint32_t* kept,
                        const uint64_t* block_offsets, const uint32_t* block_first, RowGeometry g,
                        uint8_t* base, uint32_t* blocks_used, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {streams, kept_index, kept, block_offsets, block_first, base, blocks_used}, [=] {
      CompactRowsRef(streams, num_streams, kept_index, kept, block_offsets, block_first, g, base,
                     blocks_used);
    });
  });
}

}  // namespace kvmem::kernels::cuda
