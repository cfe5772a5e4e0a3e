#include "kvmem/cuda_pool.h"

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_launch.h"

namespace kvmem::client {
namespace {

// A failed call's error is returned as a status, and the runtime's per-thread record of it
// is cleared: the worker's own next launch check (cudaGetLastError after a kernel, as
// PyTorch does) would otherwise report this library's failure as its kernel's. (A record
// the worker had left unread before the call goes with it.)
absl::Status Cuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message =
      absl::StrCat("cuda_ipc: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(message);
  }
  return absl::UnavailableError(message);
}

// This process's ordinal of the GPU with `uuid` (hex, as the daemon writes it).
absl::StatusOr<int> DeviceWithUuid(const std::string& uuid) {
  int count = 0;
  if (absl::Status s = Cuda(cudaGetDeviceCount(&count), "device count"); !s.ok()) return s;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (!Cuda(cudaGetDeviceProperties(&prop, d), "device properties").ok()) continue;
    std::string hex;
    for (char c : prop.uuid.bytes) {
      absl::StrAppend(&hex, absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
    if (hex == uuid) return d;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cuda_ipc.device_uuid: none of the ", count, " visible GPUs is ", uuid,
                   " (another host, or hidden by CUDA_VISIBLE_DEVICES)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaPool>> CudaPool::Attach(const Info& info, bool writable) {
  if (info.cuda_ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc: the daemon's ", info.backend, " backend exports no CUDA pool",
                     info.cuda_ipc_handle.empty() ? "" : " (handle of an unexpected size)"));
  }
  absl::StatusOr<int> device = DeviceWithUuid(info.cuda_device_uuid);
  if (!device.ok()) return device.status();
  std::unique_ptr<CudaPool> pool(new CudaPool());
  absl::StatusOr<std::unique_ptr<EpochReader>> epochs = EpochReader::Attach(info);
  if (!epochs.ok()) return epochs.status();
  pool->epochs_ = *std::move(epochs);
  // The handle opens on the pool's GPU, which stays current on this thread (cuda_pool.h).
  if (absl::Status s = Cuda(cudaSetDevice(*device), "set device"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, info.cuda_ipc_handle.data(), sizeof handle);
  void* base = nullptr;
  if (absl::Status s = Cuda(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                            "open the pool's handle");
      !s.ok()) {
    return s;
  }
  pool->device_ = *device;
  pool->writable_ = writable;
  pool->base_ = static_cast<const uint8_t*>(base);
  pool->bytes_ = info.cuda_pool_bytes;
  pool->hi_ = pool->bytes_;
  return pool;
}

CudaPool::~CudaPool() {
  if (ops_ != nullptr) (void)Cuda(cudaFree(ops_), "free the write ops");
  if (base_ != nullptr) {
    (void)Cuda(cudaIpcCloseMemHandle(const_cast<uint8_t*>(base_)), "close the pool's handle");
  }
}

absl::Status CudaPool::WritePlanned(const WritePlan& plan, const BlockTable& table, uint32_t n,
                                    const void* k, const void* v, uint64_t kv_bytes,
                                    cudaStream_t stream) {
  if (!writable_) {
    return absl::FailedPreconditionError("WritePlanned: the pool was attached read-only");
  }
  // The pool's GPU, whichever the calling thread has current.
  if (absl::Status s = Cuda(cudaSetDevice(device_), "set device"); !s.ok()) return s;
  absl::StatusOr<PlannedWrites> writes = PlanWrites(plan, table, n, kv_bytes);
  if (!writes.ok()) return writes.status();
  // The K ops, then the V ops (the same rows a plane further), in one device buffer.
  std::vector<kernels::CopyOp> ops;
  ops.reserve(2 * writes->k.size());
  for (const RowsCopy& op : writes->k) ops.push_back({op.src, op.dst, op.bytes});
  for (const RowsCopy& op : writes->k) {
    ops.push_back({op.src, op.dst + writes->v_plane, op.bytes});
  }
  if (ops.size() > ops_capacity_) {
    if (ops_ != nullptr) (void)Cuda(cudaFree(ops_), "free the write ops");
    ops_ = nullptr;
    ops_capacity_ = 0;
    void* buffer = nullptr;
    if (absl::Status s = Cuda(cudaMalloc(&buffer, ops.size() * sizeof(kernels::CopyOp)),
                              "allocate the write ops");
        !s.ok()) {
      return s;
    }
    ops_ = buffer;
    ops_capacity_ = ops.size();
  }
  const auto half = static_cast<uint32_t>(writes->k.size());
  auto* pool = const_cast<uint8_t*>(base_);
  if (absl::Status s = Cuda(cudaMemcpyAsync(ops_, ops.data(), ops.size() * sizeof(kernels::CopyOp),
                                            cudaMemcpyHostToDevice, stream),
                            "copy the write ops");
      !s.ok()) {
    return s;
  }
  auto* device_ops = static_cast<const kernels::CopyOp*>(ops_);
  if (absl::Status s = Cuda(
          kernels::cuda::CopyBatch(static_cast<const uint8_t*>(k), pool, device_ops, half, stream),
          "write K");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Cuda(kernels::cuda::CopyBatch(static_cast<const uint8_t*>(v), pool,
                                                     device_ops + half, half, stream),
                            "write V");
      !s.ok()) {
    return s;
  }
  // The commit that follows must find the rows there, and `ops` (pageable) goes now.
  return Cuda(cudaStreamSynchronize(stream), "wait for the writes");
}

absl::Status CudaPool::CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const {
  return Cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to the host");
}

}  // namespace kvmem::client
