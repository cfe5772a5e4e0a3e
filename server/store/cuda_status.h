#pragma once
// CUDA runtime errors as absl::Status, for the CUDA backend's files (never an abort):
// out of memory is RESOURCE_EXHAUSTED, a missing device or driver FAILED_PRECONDITION,
// anything else INTERNAL; the message names the operation.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
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

// cuda_slot_state.cc: a SlotState in device memory on `device`.
absl::StatusOr<std::unique_ptr<SlotState>> MakeCudaSlotState(uint32_t num_streams, int device);

}  // namespace kvmem::store
