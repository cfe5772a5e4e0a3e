#pragma once
// Shared by the CUDA backend's files: CUDA runtime errors as absl::Status (never an abort;
// out of memory is RESOURCE_EXHAUSTED, a missing device or driver FAILED_PRECONDITION,
// anything else INTERNAL, the message naming the operation), the scratch pool, and the
// device SlotState's factory.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

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

// Per-call scratch of the slot states (device memory and pinned host memory), shared by all
// sequences of a backend: a sequence holds only what persists between calls, and pinned
// memory grows with the calls in flight, not with the sequences alive. Buffers are reused
// and grown on demand, always on `device` (cuda_slot_state.cc).
class CudaScratchPool;
std::shared_ptr<CudaScratchPool> MakeCudaScratchPool(int device);

// A SlotState in device memory on `device` (cuda_slot_state.cc).
absl::StatusOr<std::unique_ptr<SlotState>> MakeCudaSlotState(
    uint32_t num_streams, int device, std::shared_ptr<CudaScratchPool> scratch);

}  // namespace kvmem::store
