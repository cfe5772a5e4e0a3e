#pragma once
// CudaPool: same-GPU, zero-copy access to a CUDA-backend daemon's pool, opened through the
// CUDA IPC handle GetInfo advertises (built with WITH_CUDA; link kvmem_client_cuda).
//
// The pool is device memory of another process, mapped into this one's address space on
// the GPU with the same UUID. StreamBlocks() gives device pointers a worker's attention
// kernel reads in place, under the same epoch protocol as SharedPool (shared_pool.h):
//   1. table = GetBlockTable(seq)
//   2. BeginRead(table)        (FAILED_PRECONDITION: stale, refetch)
//   3. launch kernels on StreamBlocks(...) pointers, and wait for them
//   4. EndRead(table)          (FAILED_PRECONDITION: discard what they read)
// ReadStream() does all four and copies one stream to the host (dequantized).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"

namespace kvmem::client {

class CudaPool {
 public:
  // FAILED_PRECONDITION when the daemon exports no CUDA pool or no visible GPU has its
  // UUID; UNAVAILABLE when the handle cannot be opened (another host, or no IPC support).
  static absl::StatusOr<std::unique_ptr<CudaPool>> Attach(const Info& info);
  ~CudaPool();
  CudaPool(const CudaPool&) = delete;
  CudaPool& operator=(const CudaPool&) = delete;

  int device() const { return device_; }  // this process's ordinal of the daemon's GPU
  const uint8_t* device_base() const { return base_; }
  uint64_t bytes() const { return bytes_; }

  absl::Status BeginRead(const BlockTable& table) const { return epochs_->BeginRead(table); }
  absl::Status EndRead(const BlockTable& table) const { return epochs_->EndRead(table); }
  // Device pointers for one stream's blocks, in order (BlockView as in shared_pool.h).
  absl::StatusOr<std::vector<BlockView>> StreamBlocks(const BlockTable& table, uint32_t layer,
                                                      uint32_t kv_head) const;
  // Copies one stream's retained K and V to the host ([n][D] each, quantized blocks
  // dequantized to the layout dtype), with the full read protocol.
  absl::Status ReadStream(const BlockTable& table, uint32_t layer, uint32_t kv_head, std::string* k,
                          std::string* v) const;

 private:
  CudaPool() = default;
  int device_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::unique_ptr<EpochReader> epochs_;
};

}  // namespace kvmem::client
