#pragma once
// An emulated CUDA runtime for testing the CUDA backend's host code on machines without a
// GPU (CI): just the part of the runtime API that server/store/cuda_*.cc use, with "device"
// memory in host memory, copies as memcpy, streams that run their queued work only when it
// is waited for, stream-ordered memory pools whose frees land in stream order, a per-thread
// last-error record, and the kernels' launchers (kernels/cuda_launch.h) queueing their C++
// reference twins (runtime.cc). It checks the orchestration — staging, op lists, offsets,
// waves, leases, waits, frees, error paths — not the kernels: tests/gpu/parity.cc does that
// on a real GPU. Never linked into kvmemd.
#include <cstddef>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;
inline constexpr unsigned int cudaStreamNonBlocking = 0x01;
inline constexpr unsigned int cudaIpcMemLazyEnablePeerAccess = 0x01;

struct cudaUUID_t {
  char bytes[16];
};
struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
};
struct cudaIpcMemHandle_t {
  char reserved[64];
};

enum cudaDeviceAttr {
  cudaDevAttrMemoryPoolsSupported = 115,
  cudaDevAttrHostMemoryPoolsSupported = 144,
};

// Stream-ordered memory pools (the runtime's values and field order).
struct CUmemPoolHandle_st;
using cudaMemPool_t = CUmemPoolHandle_st*;
enum cudaMemPoolAttr {
  cudaMemPoolReuseFollowEventDependencies = 0x1,
  cudaMemPoolReuseAllowOpportunistic = 0x2,
  cudaMemPoolReuseAllowInternalDependencies = 0x3,
  cudaMemPoolAttrReleaseThreshold = 0x4,
  cudaMemPoolAttrReservedMemCurrent = 0x5,
  cudaMemPoolAttrReservedMemHigh = 0x6,
  cudaMemPoolAttrUsedMemCurrent = 0x7,
  cudaMemPoolAttrUsedMemHigh = 0x8,
};
enum cudaMemLocationType {
  cudaMemLocationTypeInvalid = 0,
  cudaMemLocationTypeDevice = 1,
  cudaMemLocationTypeHost = 2,
  cudaMemLocationTypeHostNuma = 3,
  cudaMemLocationTypeHostNumaCurrent = 4,
};
struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
enum cudaMemAllocationType {
  cudaMemAllocationTypeInvalid = 0x0,
  cudaMemAllocationTypePinned = 0x1,
  cudaMemAllocationTypeManaged = 0x2,
};
enum cudaMemAllocationHandleType {
  cudaMemHandleTypeNone = 0x0,
  cudaMemHandleTypePosixFileDescriptor = 0x1,
};
struct cudaMemPoolProps {
  cudaMemAllocationType allocType;
  cudaMemAllocationHandleType handleTypes;
  cudaMemLocation location;
  void* win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
};

const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemset(void* ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr);
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags);
cudaError_t cudaIpcCloseMemHandle(void* ptr);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
// Pools of device memory only (a host location is cudaErrorNotSupported here), no IPC.
cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep);
cudaError_t cudaMallocFromPoolAsync(void** ptr, size_t bytes, cudaMemPool_t pool,
                                    cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);

// The runtime's typed conveniences (cuda_runtime.h has them as templates too).
template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
template <typename T>
cudaError_t cudaMallocHost(T** ptr, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(ptr), bytes);
}
template <typename T>
cudaError_t cudaMallocFromPoolAsync(T** ptr, size_t bytes, cudaMemPool_t pool,
                                    cudaStream_t stream) {
  return cudaMallocFromPoolAsync(reinterpret_cast<void**>(ptr), bytes, pool, stream);
}
// The runtime's C++ spelling of cudaMallocFromPoolAsync.
template <typename T>
cudaError_t cudaMallocAsync(T** ptr, size_t bytes, cudaMemPool_t pool, cudaStream_t stream) {
  return cudaMallocFromPoolAsync(reinterpret_cast<void**>(ptr), bytes, pool, stream);
}

namespace kvmem::cuda_emulation {
// Devices visible (each thread has a current one, 0 to begin with); their UUIDs differ.
inline constexpr int kDevices = 2;
// Allocations larger than this fail as out of memory (the emulated device's size).
inline constexpr size_t kDeviceBytes = size_t{16} << 30;
// Live device and pinned allocations, a pool's among them from cudaMallocFromPoolAsync until
// its cudaFreeAsync is reached in stream order (leak checks in tests).
size_t LiveAllocations();
// Memory pools made and not yet gone (a destroyed pool goes with its last allocation), and
// the bytes they reserve: in use, or cached for reuse up to the release threshold.
size_t LivePools();
size_t PoolReservedBytes();
size_t PoolUsedBytes();
// The n-th allocation from now (1-based; cudaMalloc, cudaMallocHost, cudaMallocFromPoolAsync,
// of any thread) fails as out of memory (cudaErrorMemoryAllocation); 0 disarms. Failures
// injected since the start: InjectedFailures (a sweep stops when its run injected none).
void FailAllocationAt(size_t n);
size_t InjectedFailures();
// The n-th kernel launch from now (1-based, of any thread) is accepted but runs nothing: its
// stream reports cudaErrorLaunchFailure at its next synchronization, once (a kernel that
// faulted after its launch returned); 0 disarms.
void FaultLaunchAt(size_t n);
// Since the start: the host's waits for the device (stream synchronizations, copies into
// pageable memory, synchronous copies, frees), the copies between host and device, and the
// kernel launches.
struct Counts {
  size_t waits, transfers, launches;
};
Counts Count();
}  // namespace kvmem::cuda_emulation
