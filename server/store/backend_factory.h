#pragma once
// MakeBackend: the backend named by --backend ("cpu", or "cuda" when this build has CUDA).
// The only place outside a backend's own files that names one: core headers never do.
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/store/backend.h"

namespace kvmem::store {

// Builds the backend named by `name` (on GPU `cuda_device` for cuda); a clear error, naming
// --backend, for an unknown name or one this build does not include.
// `arena_bytes`: the pool's arenas (CpuBackend::Create); the CPU backend's only.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view name, uint64_t pool_bytes,
                                                     int cuda_device = 0,
                                                     std::vector<uint64_t> arena_bytes = {});

}  // namespace kvmem::store
