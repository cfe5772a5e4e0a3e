// The emulated CUDA runtime (cuda_runtime_api.h) and the kernels' launchers on their C++
// reference twins, which report through the last-error record as the real ones do.
//
// Streams are asynchronous here too: the work queued on a stream (copies, launches, frees)
// runs only when something waits for it — cudaStreamSynchronize, cudaFree/cudaFreeHost
// (which wait for the whole device), the stream's destruction — as a GPU may run it late.
// Host code that reads a result before it waits, or reuses a buffer a queued copy still
// reads, sees the wrong bytes here as it would on a GPU. The runtime's own rules for
// pageable host memory are kept: cudaMemcpyAsync from pageable memory takes the bytes when
// called, into pageable memory it returns once the copy is done; only pinned memory
// (cudaMallocHost) is read and written when the stream gets to the copy.
//
// Memory pools: cudaMallocFromPoolAsync hands out a block at once (a cached one of the pool
// when one is large enough); cudaFreeAsync is queued, and when its stream gets there the
// block is filled with 0xdd and goes back to the pool's cache. Queued work that touches a
// block that is back in a pool (or handed back to the system) does not run: its stream
// reports cudaErrorIllegalAddress at its next synchronization, as compute-sanitizer would
// report the use after free on a GPU. After a stream synchronization every pool hands back
// cached blocks down to its release threshold (the runtime does it then too); handed-back
// blocks stay in a short quarantine, still known as freed, before their memory goes.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "cuda_runtime_api.h"
#include "kernels/cuda_launch.h"

// A stream: its queued work, run in order when waited for, and the first fault of that work
// (a use after free), reported by the next synchronization.
struct CUstream_st {
  int device = 0;  // the current device when it was made
  std::mutex mu;
  std::vector<std::function<void()>> work;
  cudaError_t fault = cudaSuccess;

  void Run() {
    std::lock_guard<std::mutex> lock(mu);
    for (std::function<void()>& f : work) f();
    work.clear();
  }
  // Runs the queued work and hands back its fault.
  cudaError_t Drain() {
    Run();
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(fault, cudaSuccess);
  }
};

// A memory pool of one device (guarded by allocations_mu).
struct CUmemPoolHandle_st {
  int device = 0;
  size_t max_bytes = 0;  // cudaMemPoolProps::maxSize; 0: the device's size
  uint64_t release_threshold = 0;
  size_t reserved = 0, reserved_high = 0;  // bytes of its blocks, in use or cached
  size_t used = 0, used_high = 0;          // bytes of its blocks in use
  std::multimap<size_t, void*> cached;     // freed blocks by size, for reuse
  bool destroyed = false;                  // goes when nothing is in use
};

namespace {

std::atomic<size_t> live{0};
std::atomic<size_t> fail_countdown{0};   // FailAllocationAt: allocations until the failing one
std::atomic<size_t> fault_countdown{0};  // FaultLaunchAt: launches until the faulting one
std::atomic<size_t> injected{0};
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

// What the runtime made: live streams, and device and pinned host allocations by start,
// pool blocks among them. Lock order: streams_mu, then a stream's mu, then allocations_mu
// (queued work takes allocations_mu; nothing holding it takes a stream's).
struct Allocation {
  size_t bytes;
  int device;   // the current device when it was made (device memory), the pool's for a block
  bool pinned;  // cudaMallocHost
  CUmemPoolHandle_st* pool = nullptr;  // a block of this pool (cudaMallocFromPoolAsync)
  bool free_queued = false;            // its cudaFreeAsync is queued
  bool freed = false;                  // back in its pool, or handed back: not to be touched
};
std::mutex streams_mu;
std::set<cudaStream_t> streams;
std::mutex allocations_mu;
std::map<uintptr_t, Allocation> allocations;
std::set<CUmemPoolHandle_st*> pools;
std::deque<void*> quarantine;  // handed-back pool blocks, freed for good when pushed out
constexpr size_t kQuarantined = 64;

// The allocation holding `p` (allocations_mu held).
Allocation* FindLocked(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(at);
  if (p == nullptr || it == allocations.begin()) return nullptr;
  --it;
  if (at >= it->first + it->second.bytes) return nullptr;
  return &it->second;
}

// The allocation holding `p`, if the runtime made one (nullptr, pageable memory: none).
std::optional<Allocation> Find(const void* p) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  const Allocation* a = FindLocked(p);
  if (a == nullptr) return std::nullopt;
  return *a;
}

bool IsPinned(const void* p) {
  const std::optional<Allocation> a = Find(p);
  return a.has_value() && a->pinned;
}

// Whether one of `pointers` lies in a pool block that is no longer allocated.
bool TouchesFreedMemory(const std::vector<const void*>& pointers) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  for (const void* p : pointers) {
    const Allocation* a = FindLocked(p);
    if (a != nullptr && a->freed) return true;
  }
  return false;
}

bool IsStream(cudaStream_t stream) {
  if (stream == nullptr) return true;
  std::lock_guard<std::mutex> lock(streams_mu);
  return streams.count(stream) > 0;
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

// Work on `stream` (nullptr: the legacy default stream) that touches `pointers`: when the
// stream gets to it and one of them is freed pool memory, it does not run and the stream
// reports the fault.
void Enqueue(cudaStream_t stream, std::initializer_list<const void*> pointers,
             std::function<void()> f) {
  CUstream_st& s = Of(stream);
  std::lock_guard<std::mutex> lock(s.mu);
  s.work.push_back([&s, touched = std::vector<const void*>(pointers), f = std::move(f)] {
    if (TouchesFreedMemory(touched)) {
      if (s.fault == cudaSuccess) s.fault = cudaErrorIllegalAddress;  // s.mu held by Run
      return;
    }
    f();
  });
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
  size_t n = fault_countdown.load();
  while (n > 0 && !fault_countdown.compare_exchange_weak(n, n - 1)) {
  }
  if (n == 1) {  // runs nothing and faults, as a kernel that trapped
    CUstream_st& s = Of(stream);
    std::lock_guard<std::mutex> lock(s.mu);
    s.work.push_back([&s] {
      if (s.fault == cudaSuccess) s.fault = cudaErrorLaunchFailure;  // s.mu held by Run
    });
    return;
  }
  Enqueue(stream, pointers, std::move(f));
}

// What a device-wide synchronization does: every stream's queued work runs (under the
// streams' lock, so that no stream is destroyed meanwhile).
void RunAllStreams() {
  legacy.Run();
  std::lock_guard<std::mutex> lock(streams_mu);
  for (cudaStream_t s : streams) s->Run();
}

// Whether this allocation is the one FailAllocationAt asked to fail.
bool InjectedFailure() {
  size_t n = fail_countdown.load();
  while (n > 0 && !fail_countdown.compare_exchange_weak(n, n - 1)) {
  }
  if (n != 1) return false;
  ++injected;
  return true;
}

// Fresh "device" memory is not zero on a GPU: fill it with a pattern so that code relying on
// zeros fails here too.
cudaError_t Allocate(void** ptr, size_t bytes, bool pinned) {
  if (bytes > kvmem::cuda_emulation::kDeviceBytes || InjectedFailure()) {
    return Record(cudaErrorMemoryAllocation);
  }
  const size_t held = bytes == 0 ? 1 : bytes;
  *ptr = std::malloc(held);
  if (*ptr == nullptr) return Record(cudaErrorMemoryAllocation);
  std::memset(*ptr, 0xa5, bytes);
  ++live;
  std::lock_guard<std::mutex> lock(allocations_mu);
  allocations[reinterpret_cast<uintptr_t>(*ptr)] = {held, current_device, pinned};
  return cudaSuccess;
}

cudaError_t Release(void* ptr) {
  if (ptr != nullptr) {
    {
      // A pool's block goes back with cudaFreeAsync (the runtime would take cudaFree without
      // waiting for its users; the backend never does, so here it is an error that shows).
      const std::optional<Allocation> a = Find(ptr);
      if (a.has_value() && (a->pool != nullptr || a->freed)) {
        return Record(cudaErrorInvalidValue);
      }
    }
    ++waits;
    RunAllStreams();  // cudaFree and cudaFreeHost wait for the device
    {
      std::lock_guard<std::mutex> lock(allocations_mu);
      allocations.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    std::free(ptr);
    --live;
  }
  return cudaSuccess;
}

// Hands a cached block back to the system (allocations_mu held): still known as freed for a
// while, so that a late use shows as one.
void HandBack(CUmemPoolHandle_st* pool, std::multimap<size_t, void*>::iterator block) {
  pool->reserved -= block->first;
  Allocation* a = FindLocked(block->second);
  a->pool = nullptr;
  quarantine.push_back(block->second);
  pool->cached.erase(block);
  while (quarantine.size() > kQuarantined) {
    allocations.erase(reinterpret_cast<uintptr_t>(quarantine.front()));
    std::free(quarantine.front());
    quarantine.pop_front();
  }
}

// Hands back cached blocks, the largest first, while more than `keep` bytes are reserved
// (allocations_mu held); blocks in use stay.
void TrimLocked(CUmemPoolHandle_st* pool, size_t keep) {
  while (pool->reserved > keep && !pool->cached.empty())
    HandBack(pool, std::prev(pool->cached.end()));
}

// A destroyed pool goes once nothing of it is in use (allocations_mu held).
void CollectLocked(CUmemPoolHandle_st* pool) {
  if (!pool->destroyed || pool->used > 0) return;
  TrimLocked(pool, 0);
  pools.erase(pool);
  delete pool;
}

// What a synchronization does to the pools: each hands back what it caches past its release
// threshold.
void ApplyReleaseThresholds() {
  std::lock_guard<std::mutex> lock(allocations_mu);
  for (CUmemPoolHandle_st* pool : pools) TrimLocked(pool, pool->release_threshold);
}

}  // namespace

namespace kvmem::cuda_emulation {
size_t LiveAllocations() { return live.load(); }
size_t LivePools() {
  std::lock_guard<std::mutex> lock(allocations_mu);
  return pools.size();
}
size_t PoolReservedBytes() {
  std::lock_guard<std::mutex> lock(allocations_mu);
  size_t bytes = 0;
  for (const CUmemPoolHandle_st* pool : pools) bytes += pool->reserved;
  return bytes;
}
size_t PoolUsedBytes() {
  std::lock_guard<std::mutex> lock(allocations_mu);
  size_t bytes = 0;
  for (const CUmemPoolHandle_st* pool : pools) bytes += pool->used;
  return bytes;
}
void FailAllocationAt(size_t n) { fail_countdown.store(n); }
void FaultLaunchAt(size_t n) { fault_countdown.store(n); }
size_t InjectedFailures() { return injected.load(); }
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
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
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
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= kvmem::cuda_emulation::kDevices) {
    return Record(cudaErrorInvalidDevice);
  }
  switch (attr) {
    case cudaDevAttrMemoryPoolsSupported:
      *value = 1;
      return cudaSuccess;
    case cudaDevAttrHostMemoryPoolsSupported:
      *value = 0;  // not emulated
      return cudaSuccess;
  }
  return Record(cudaErrorInvalidValue);
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
  Enqueue(stream, {ptr}, [ptr, value, bytes] { std::memset(ptr, value, bytes); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Record(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDeviceToDevice) ++transfers;
  ++waits;
  if (const cudaError_t e = legacy.Drain(); e != cudaSuccess) return Record(e);
  if (TouchesFreedMemory({dst, src})) return Record(cudaErrorIllegalAddress);
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Record(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDeviceToDevice) ++transfers;
  if (kind == cudaMemcpyDeviceToHost && !IsPinned(dst)) {  // returns once the copy is done
    ++waits;
    if (const cudaError_t e = Of(stream).Drain(); e != cudaSuccess) return Record(e);
    if (TouchesFreedMemory({src})) return Record(cudaErrorIllegalAddress);
    std::memcpy(dst, src, bytes);
    return cudaSuccess;
  }
  if (kind == cudaMemcpyHostToDevice && !IsPinned(src)) {  // the bytes are taken now
    auto taken = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src),
                                                        static_cast<const uint8_t*>(src) + bytes);
    Enqueue(stream, {dst}, [dst, taken] { std::memcpy(dst, taken->data(), taken->size()); });
    return cudaSuccess;
  }
  Enqueue(stream, {dst, src}, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = new CUstream_st;
  (*stream)->device = current_device;
  std::lock_guard<std::mutex> lock(streams_mu);
  streams.insert(*stream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  stream->Run();  // the queued work still completes
  {
    std::lock_guard<std::mutex> lock(streams_mu);
    streams.erase(stream);
  }
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ++waits;
  const cudaError_t e = Of(stream).Drain();
  ApplyReleaseThresholds();
  return Record(e);
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

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  if (pool == nullptr || props == nullptr || props->allocType != cudaMemAllocationTypePinned) {
    return Record(cudaErrorInvalidValue);
  }
  if (props->location.type != cudaMemLocationTypeDevice ||
      props->handleTypes != cudaMemHandleTypeNone) {
    return Record(cudaErrorNotSupported);  // host pools and exportable ones: not emulated
  }
  if (props->location.id < 0 || props->location.id >= kvmem::cuda_emulation::kDevices) {
    return Record(cudaErrorInvalidDevice);
  }
  auto* made = new CUmemPoolHandle_st;
  made->device = props->location.id;
  made->max_bytes = props->maxSize;
  std::lock_guard<std::mutex> lock(allocations_mu);
  pools.insert(made);
  *pool = made;
  return cudaSuccess;
}
// As the runtime: the call returns at once; blocks still in use (their frees not reached)
// keep the pool until the last of them goes back.
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  if (pools.count(pool) == 0 || pool->destroyed) return Record(cudaErrorInvalidValue);
  pool->destroyed = true;
  CollectLocked(pool);
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  if (pools.count(pool) == 0 || pool->destroyed || value == nullptr) {
    return Record(cudaErrorInvalidValue);
  }
  switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
      pool->release_threshold = *static_cast<const uint64_t*>(value);
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      if (*static_cast<const uint64_t*>(value) != 0) break;  // only reset to zero
      (attr == cudaMemPoolAttrUsedMemHigh ? pool->used_high : pool->reserved_high) = 0;
      return cudaSuccess;
    case cudaMemPoolReuseFollowEventDependencies:
    case cudaMemPoolReuseAllowOpportunistic:
    case cudaMemPoolReuseAllowInternalDependencies:
      return cudaSuccess;  // reuse here waits for the free to be reached in any case
    case cudaMemPoolAttrReservedMemCurrent:
    case cudaMemPoolAttrUsedMemCurrent:
      break;  // read only
  }
  return Record(cudaErrorInvalidValue);
}
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  if (pools.count(pool) == 0 || pool->destroyed || value == nullptr) {
    return Record(cudaErrorInvalidValue);
  }
  uint64_t v = 0;
  switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
      v = pool->release_threshold;
      break;
    case cudaMemPoolAttrReservedMemCurrent:
      v = pool->reserved;
      break;
    case cudaMemPoolAttrReservedMemHigh:
      v = pool->reserved_high;
      break;
    case cudaMemPoolAttrUsedMemCurrent:
      v = pool->used;
      break;
    case cudaMemPoolAttrUsedMemHigh:
      v = pool->used_high;
      break;
    case cudaMemPoolReuseFollowEventDependencies:
    case cudaMemPoolReuseAllowOpportunistic:
    case cudaMemPoolReuseAllowInternalDependencies:
      *static_cast<int*>(value) = 1;
      return cudaSuccess;
  }
  *static_cast<uint64_t*>(value) = v;
  return cudaSuccess;
}
// Only cached blocks go; a block whose free has not been reached is still in use.
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep) {
  std::lock_guard<std::mutex> lock(allocations_mu);
  if (pools.count(pool) == 0 || pool->destroyed) return Record(cudaErrorInvalidValue);
  TrimLocked(pool, min_bytes_to_keep);
  return cudaSuccess;
}
// A block on the pool's device, whatever device is current. Its bytes are a pattern, as
// they may be anything on a GPU (a reused block holds its last user's bytes there).
cudaError_t cudaMallocFromPoolAsync(void** ptr, size_t bytes, cudaMemPool_t pool,
                                    cudaStream_t stream) {
  if (ptr == nullptr || bytes == 0) return Record(cudaErrorInvalidValue);
  if (!IsStream(stream)) return Record(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(allocations_mu);
  if (pools.count(pool) == 0 || pool->destroyed) return Record(cudaErrorInvalidValue);
  if (InjectedFailure()) return Record(cudaErrorMemoryAllocation);
  auto fit = pool->cached.lower_bound(bytes);
  void* block = nullptr;
  if (fit != pool->cached.end()) {
    block = fit->second;
    bytes = fit->first;
    pool->cached.erase(fit);
    Allocation* a = FindLocked(block);
    a->freed = false;
    a->free_queued = false;
  } else {
    const size_t limit = std::min(pool->max_bytes > 0 ? pool->max_bytes : SIZE_MAX,
                                  kvmem::cuda_emulation::kDeviceBytes);
    if (bytes > limit - std::min(limit, pool->reserved)) return Record(cudaErrorMemoryAllocation);
    block = std::malloc(bytes);
    if (block == nullptr) return Record(cudaErrorMemoryAllocation);
    allocations[reinterpret_cast<uintptr_t>(block)] = {bytes, pool->device, false, pool};
    pool->reserved += bytes;
    pool->reserved_high = std::max(pool->reserved_high, pool->reserved);
  }
  std::memset(block, 0xa5, bytes);
  pool->used += bytes;
  pool->used_high = std::max(pool->used_high, pool->used);
  ++live;
  *ptr = block;
  return cudaSuccess;
}
// Queued: the block goes back to its pool when the stream gets here, after the work queued
// before (which still may use it), before the work queued after (which may not).
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return cudaSuccess;
  if (!IsStream(stream)) return Record(cudaErrorInvalidResourceHandle);
  {
    std::lock_guard<std::mutex> lock(allocations_mu);
    Allocation* a = FindLocked(ptr);
    // Only a block's start, once: a second free (or one of memory from elsewhere) is an error.
    if (a == nullptr || a->pool == nullptr || a->freed || a->free_queued ||
        allocations.find(reinterpret_cast<uintptr_t>(ptr)) == allocations.end()) {
      return Record(cudaErrorInvalidValue);
    }
    a->free_queued = true;
  }
  CUstream_st& s = Of(stream);
  std::lock_guard<std::mutex> lock(s.mu);
  s.work.push_back([ptr] {
    std::lock_guard<std::mutex> lock(allocations_mu);
    Allocation* a = FindLocked(ptr);
    std::memset(ptr, 0xdd, a->bytes);
    a->freed = true;
    a->free_queued = false;
    CUmemPoolHandle_st* pool = a->pool;
    pool->used -= a->bytes;
    pool->cached.emplace(a->bytes, ptr);
    --live;
    CollectLocked(pool);
  });
  return cudaSuccess;
}

namespace kvmem::kernels::cuda {

cudaError_t CopyBatch(const uint8_t* src, uint8_t* dst, const CopyOp* ops, uint32_t n,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {src, dst, ops}, [=] { CopyBatchRef(src, dst, ops, n); });
  });
}

cudaError_t ScatterBatch(const uint8_t* src, const ScatterOp* ops, uint32_t n,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] { Launch(stream, {src, ops}, [=] { ScatterBatchRef(src, ops, n); }); });
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

cudaError_t UpdateScoresSegments(const StepSegment* segments, uint32_t n, float* stream_max,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {segments, stream_max},
           [=] { UpdateScoresSegmentsRef(segments, n, stream_max); });
  });
}

cudaError_t SelectTopSegments(const StepSegment* segments, uint32_t n, const float* stream_max,
                              uint8_t* keep_copy, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {segments, stream_max, keep_copy},
           [=] { SelectTopSegmentsRef(segments, n, stream_max, keep_copy); });
  });
}

cudaError_t CompactSlotsSegments(const CompactSegment* segments, uint32_t n, uint32_t* kept,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // as the real launcher: nothing launched
  return Launched([&] {
    Launch(stream, {segments, kept}, [=] { CompactSlotsSegmentsRef(segments, n, kept); });
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
