#include "server/store/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "server/common/client_text.h"
#include "server/store/cpu_backend.h"
#ifdef KVMEM_WITH_CUDA
#include "server/store/cuda_backend.h"
#endif

namespace kvmem::store {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view name, uint64_t pool_bytes,
                                                     int cuda_device,
                                                     std::vector<uint64_t> arena_bytes) {
  if (name == "cpu") {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu =
        CpuBackend::Create(pool_bytes, std::move(arena_bytes));
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<Backend>(*std::move(cpu));
  }
  if (name == "cuda" && !arena_bytes.empty()) {
    return absl::FailedPreconditionError(
        "--tenant-arena: only the CPU backend's pool is cut into arenas so far");
  }
  if (name == "cuda") {
#ifdef KVMEM_WITH_CUDA
    absl::StatusOr<std::unique_ptr<CudaBackend>> cuda =
        CudaBackend::Create(pool_bytes, cuda_device);
    if (!cuda.ok()) return cuda.status();
    return std::unique_ptr<Backend>(*std::move(cuda));
#else
    (void)cuda_device;
    return absl::FailedPreconditionError(
        "--backend=cuda: this kvmemd was built without CUDA (configure with -DWITH_CUDA=ON on "
        "a machine with nvcc); use --backend=cpu");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend: unknown backend \"", EchoClientText(name), "\" (known: cpu, cuda)"));
}

}  // namespace kvmem::store
