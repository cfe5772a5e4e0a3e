#pragma once
// CudaBackend: the pool in one plain device allocation (cudaMalloc, never managed memory),
// sized by --pool-bytes, exported to same-GPU processes through a CUDA IPC handle. Every
// operation is one batch for all streams of a request: one upload of the op list, one or a
// few kernel launches (kernels/cuda_launch.h), staging through pinned host memory for the
// host <-> device halves, device scratch from a stream-ordered memory pool of the backend's
// device (cuda_internal.h). Calls complete before they return (Synchronize is then free), so
// host buffers need not outlive a call. CUDA errors become absl::Status (out of memory:
// RESOURCE_EXHAUSTED), never an abort.
#include <memory>

#include "absl/status/statusor.h"
#include "server/store/backend.h"

namespace kvmem::store {

class CudaMemoryPool;   // cuda_internal.h
class CudaScratchPool;  // cuda_internal.h

class CudaBackend final : public Backend {
 public:
  // FAILED_PRECONDITION when no CUDA device is visible, RESOURCE_EXHAUSTED when the pool
  // does not fit in device memory.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(uint64_t pool_bytes, int device = 0);
  ~CudaBackend() override;

  absl::string_view kind() const override { return "cuda"; }
  bool prefers_device_step() const override { return true; }
  bool steps_slot_states_together() const override { return true; }
  std::string device_name() const override { return device_name_; }
  uint64_t pool_bytes() const override { return pool_bytes_; }

  absl::Status Write(absl::Span<const WriteOp> ops) override;
  absl::Status Read(absl::Span<const ReadOp> ops) override;
  absl::Status Move(absl::Span<const MoveOp> ops) override;
  absl::Status MoveDisjoint(absl::Span<const absl::Span<const MoveOp>> batches) override;
  absl::Status Quantize(kernels::ElemType elem, const kernels::QuantGeometry& geometry,
                        absl::Span<const QuantizeOp> ops) override;
  absl::Status Dequantize(const kernels::QuantGeometry& geometry, kernels::ElemType elem,
                          absl::Span<const DequantizeOp> ops) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<SlotState>> CreateSlotState(uint32_t num_streams) override;
  std::optional<PoolExport> pool_export() const override;

 private:
  struct Buffers;  // the stream and pinned staging (cuda_backend.cc)
  CudaBackend() = default;
  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const char* what) const;
  absl::Status Bind() const;  // makes this backend's device current in the calling thread

  int device_ = 0;
  std::string device_name_;
  std::string device_uuid_;
  uint64_t pool_bytes_ = 0;
  uint8_t* pool_ = nullptr;                 // device
  std::string ipc_handle_;                  // cudaIpcMemHandle_t bytes
  std::shared_ptr<CudaMemoryPool> memory_;  // every call's device scratch
  std::unique_ptr<Buffers> buffers_;
  std::shared_ptr<CudaScratchPool> slot_scratch_;  // shared by the sequences' slot states
};

}  // namespace kvmem::store
