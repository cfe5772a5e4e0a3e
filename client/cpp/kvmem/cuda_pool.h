#pragma once
// CudaPool: same-GPU, zero-copy access to a CUDA-backend daemon's pool, opened through the
// CUDA IPC handle GetInfo advertises (built with WITH_CUDA; link kvmem_client_cuda).
//
// The pool is device memory of another process, mapped into this one's address space on
// the GPU with the same UUID. StreamBlocks() (MappedPool, shared_pool.h) gives device
// pointers a worker's attention kernel reads in place, under the epoch protocol:
//   1. table = GetBlockTable(seq)
//   2. BeginRead(table)        (FAILED_PRECONDITION: stale, refetch)
//   3. launch kernels on StreamBlocks(...) pointers, and wait for them
//   4. EndRead(table)          (FAILED_PRECONDITION: discard what they read)
// ReadStream() does all four and copies one stream to the host (dequantized).
//
// In place (kvmemd --in_place_writes; attached `writable`): WritePlanned copies a step's
// K/V from the worker's own device buffers into the pool where a write plan says — two
// batched copy launches and one wait — and the StepBatch entry then commits them with
// BatchEntry::written_plan, as over a SharedPool.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"

namespace kvmem::client {

class CudaPool final : public MappedPool {
 public:
  // FAILED_PRECONDITION when the daemon exports no CUDA pool or no visible GPU has its
  // UUID; UNAVAILABLE when the handle cannot be opened (another host, or no IPC support).
  // The pool's GPU is made current on the calling thread and stays so (restoring another
  // device could create a context on a GPU the worker never uses); a CUDA call that fails
  // here leaves no error record behind for the worker's own launch checks.
  // `writable`: for WritePlanned (an IPC mapping is writable; the flag says the caller
  // means to, as SharedPool's does).
  static absl::StatusOr<std::unique_ptr<CudaPool>> Attach(const Info& info, bool writable = false);
  ~CudaPool() override;

  // Writes `n` tokens' K and V ([L][H][n][D] in the layout dtype each, device memory of the
  // pool's GPU, `kv_bytes` each) where `plan` says, and waits for the copies; then commit
  // them with BatchEntry::written_plan. The copies go on `stream`, the one the worker's
  // kernels made K and V on (ordered after them; the legacy default stream when null).
  // FAILED_PRECONDITION when attached read-only; the checks of SharedPool::WritePlanned;
  // INTERNAL (the CUDA error) when a copy fails. Not for concurrent use: the copies' op list
  // has one device buffer.
  absl::Status WritePlanned(const WritePlan& plan, const BlockTable& table, uint32_t n,
                            const void* k, const void* v, uint64_t kv_bytes,
                            cudaStream_t stream = nullptr);

  int device() const { return device_; }  // this process's ordinal of the daemon's GPU
  const uint8_t* device_base() const { return base_; }
  uint64_t bytes() const { return bytes_; }

 private:
  CudaPool() = default;
  absl::Status CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const override;
  int device_ = -1;
  bool writable_ = false;
  void* ops_ = nullptr;  // device memory for WritePlanned's copy ops, ops_capacity_ of them
  uint64_t ops_capacity_ = 0;
};

}  // namespace kvmem::client
