#include "server/store/cuda_backend.h"

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda_launch.h"
#include "server/common/mutex.h"
#include "server/store/cuda_internal.h"

namespace kvmem::store {
// Staging and op-list buffers, grown on demand and reused; one request at a time uses them.
struct CudaBackend::Buffers {
  absl::Mutex mu;
  cudaStream_t stream = nullptr;
  uint8_t* device_staging = nullptr;
  uint64_t device_staging_bytes = 0;
  uint8_t* host_staging = nullptr;  // pinned
  uint64_t host_staging_bytes = 0;
  uint8_t* device_ops = nullptr;
  uint64_t device_ops_bytes = 0;

  ~Buffers() {
    cudaFree(device_staging);
    cudaFreeHost(host_staging);
    cudaFree(device_ops);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  absl::Status Reserve(uint64_t staging, uint64_t ops) {
    absl::Status s = Grow(&device_staging, &device_staging_bytes, staging, false, "staging");
    if (s.ok()) s = Grow(&host_staging, &host_staging_bytes, staging, true, "pinned staging");
    if (s.ok()) s = Grow(&device_ops, &device_ops_bytes, ops, false, "op list");
    return s;
  }
  // Replaces *buffer with one of at least `needed` bytes (device, or pinned host memory).
  static absl::Status Grow(uint8_t** buffer, uint64_t* bytes, uint64_t needed, bool pinned,
                           absl::string_view what) {
    if (needed <= *bytes) return absl::OkStatus();
    (void)(pinned ? cudaFreeHost(*buffer) : cudaFree(*buffer));
    *buffer = nullptr;
    *bytes = 0;
    const cudaError_t e = pinned ? cudaMallocHost(buffer, needed) : cudaMalloc(buffer, needed);
    if (e == cudaSuccess) *bytes = needed;
    return FromCuda(e, what);
  }
  // Uploads an op list (synchronous: the host vector may go right after).
  template <typename T>
  absl::Status Upload(const std::vector<T>& ops, uint64_t at = 0) {
    if (ops.empty()) return absl::OkStatus();
    return FromCuda(cudaMemcpyAsync(device_ops + at, ops.data(), ops.size() * sizeof(T),
                                    cudaMemcpyHostToDevice, stream),
                    "op list upload");
  }
  absl::Status Wait(absl::string_view what) {
    return FromCuda(cudaStreamSynchronize(stream), what);
  }
};

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(uint64_t pool_bytes, int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--backend=cuda: no CUDA device is visible (",
        e == cudaSuccess ? "0 devices" : cudaGetErrorString(e), "); use --backend=cpu"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda-device: ", device, " is outside [0, ",
                                                   count, "), the devices visible"));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->device_ = device;
  b->pool_bytes_ = pool_bytes;
  if (absl::Status s = FromCuda(cudaSetDevice(device), "set device"); !s.ok()) return s;
  cudaDeviceProp prop{};
  if (absl::Status s = FromCuda(cudaGetDeviceProperties(&prop, device), "device properties");
      !s.ok()) {
    return s;
  }
  b->device_name_ = prop.name;
  for (char c : prop.uuid.bytes) {
    absl::StrAppend(&b->device_uuid_, absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
  }
  size_t free_bytes = 0, total_bytes = 0;
  (void)cudaMemGetInfo(&free_bytes, &total_bytes);
  const cudaError_t alloc = cudaMalloc(&b->pool_, pool_bytes);
  if (alloc == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(
        absl::StrCat("--pool-bytes: ", pool_bytes, " bytes do not fit on ", b->device_name_, " (",
                     free_bytes, " of ", total_bytes, " bytes free)"));
  }
  if (absl::Status s = FromCuda(alloc, "pool allocation"); !s.ok()) return s;
  b->buffers_ = std::make_unique<Buffers>();
  if (absl::Status s = FromCuda(
          cudaStreamCreateWithFlags(&b->buffers_->stream, cudaStreamNonBlocking), "stream");
      !s.ok()) {
    return s;
  }
  // On the backend's own stream, and waited for: a clear on the legacy default stream is
  // not ordered before work on a non-blocking stream, and could zero the first writes.
  if (absl::Status s =
          FromCuda(cudaMemsetAsync(b->pool_, 0, pool_bytes, b->buffers_->stream), "pool clear");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = b->buffers_->Wait("pool clear"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, b->pool_) == cudaSuccess) {
    b->ipc_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
  } else {
    (void)cudaGetLastError();  // no IPC on this platform: the pool is simply not exported
  }
  b->slot_scratch_ = MakeCudaScratchPool(device);
  return b;
}

CudaBackend::~CudaBackend() {
  (void)cudaSetDevice(device_);  // its memory is freed on its own device
  buffers_.reset();
  if (pool_ != nullptr) cudaFree(pool_);
}

absl::Status CudaBackend::Bind() const {
  // The current device is per thread, and requests arrive on any of the server's threads.
  return FromCuda(cudaSetDevice(device_), "set device");
}

absl::Status CudaBackend::CheckRange(uint64_t offset, uint64_t bytes, const char* what) const {
  if (offset > pool_bytes_ || bytes > pool_bytes_ - offset) {
    return absl::InternalError(absl::StrCat(what, ": range [", offset, ", ", offset + bytes,
                                            ") outside the pool of ", pool_bytes_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Write(absl::Span<const WriteOp> ops) {
  if (ops.empty()) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  std::vector<kernels::CopyOp> scatter;
  uint64_t total = 0;
  for (const WriteOp& op : ops) {
    if (absl::Status s = CheckRange(op.dst, op.bytes, "write"); !s.ok()) return s;
    scatter.push_back({total, op.dst, op.bytes});
    total = Align16(total + op.bytes);
  }
  Buffers& b = *buffers_;
  kvmem::MutexLock lock(&b.mu);
  if (absl::Status s = b.Reserve(total, scatter.size() * sizeof(kernels::CopyOp)); !s.ok()) {
    return s;
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(b.host_staging + scatter[i].src, ops[i].src, ops[i].bytes);
  }
  if (absl::Status s = b.Upload(scatter); !s.ok()) return s;
  absl::Status s = FromCuda(
      cudaMemcpyAsync(b.device_staging, b.host_staging, total, cudaMemcpyHostToDevice, b.stream),
      "write upload");
  if (s.ok()) {
    s = FromCuda(kernels::cuda::CopyBatch(b.device_staging, pool_,
                                          reinterpret_cast<kernels::CopyOp*>(b.device_ops),
                                          static_cast<uint32_t>(scatter.size()), b.stream),
                 "write scatter");
  }
  absl::Status waited = b.Wait("write");
  return s.ok() ? waited : s;
}

absl::Status CudaBackend::Read(absl::Span<const ReadOp> ops) {
  if (ops.empty()) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  std::vector<kernels::CopyOp> gather;
  uint64_t total = 0;
  for (const ReadOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "read"); !s.ok()) return s;
    gather.push_back({op.src, total, op.bytes});
    total = Align16(total + op.bytes);
  }
  Buffers& b = *buffers_;
  kvmem::MutexLock lock(&b.mu);
  if (absl::Status s = b.Reserve(total, gather.size() * sizeof(kernels::CopyOp)); !s.ok()) {
    return s;
  }
  absl::Status s = b.Upload(gather);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::CopyBatch(pool_, b.device_staging,
                                          reinterpret_cast<kernels::CopyOp*>(b.device_ops),
                                          static_cast<uint32_t>(gather.size()), b.stream),
                 "read gather");
  }
  if (s.ok()) {
    s = FromCuda(
        cudaMemcpyAsync(b.host_staging, b.device_staging, total, cudaMemcpyDeviceToHost, b.stream),
        "read download");
  }
  absl::Status waited = b.Wait("read");
  if (!s.ok()) return s;
  if (!waited.ok()) return waited;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(ops[i].dst, b.host_staging + gather[i].dst, ops[i].bytes);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Move(absl::Span<const MoveOp> ops) {
  if (ops.empty()) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  std::vector<kernels::CopyOp> moves;
  for (const MoveOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "move source"); !s.ok()) return s;
    if (absl::Status s = CheckRange(op.dst, op.bytes, "move destination"); !s.ok()) return s;
    moves.push_back({op.src, op.dst, op.bytes});
  }
  // Per wave (copy.h): every source to scratch, then scratch to every destination. Every
  // wave's two op lists go up in one copy: wave w's gathers, then its scatters.
  const std::vector<kernels::MoveWave> waves = kernels::PlanMoveWaves(moves.data(), moves.size());
  std::vector<kernels::CopyOp> lists;
  std::vector<size_t> first;  // index in `lists` of each wave's gathers
  uint64_t scratch = 0;
  for (const kernels::MoveWave& wave : waves) {
    first.push_back(lists.size());
    lists.insert(lists.end(), wave.gather.begin(), wave.gather.end());
    lists.insert(lists.end(), wave.scatter.begin(), wave.scatter.end());
    scratch = std::max(scratch, wave.scratch_bytes);
  }
  Buffers& b = *buffers_;
  kvmem::MutexLock lock(&b.mu);
  if (absl::Status s = b.Reserve(scratch, lists.size() * sizeof(kernels::CopyOp)); !s.ok()) {
    return s;
  }
  absl::Status s = b.Upload(lists);
  const auto* list = reinterpret_cast<const kernels::CopyOp*>(b.device_ops);
  for (size_t w = 0; s.ok() && w < waves.size(); ++w) {
    const auto n = static_cast<uint32_t>(waves[w].gather.size());
    s = FromCuda(kernels::cuda::CopyBatch(pool_, b.device_staging, list + first[w], n, b.stream),
                 "move gather");
    if (s.ok()) {
      s = FromCuda(
          kernels::cuda::CopyBatch(b.device_staging, pool_, list + first[w] + n, n, b.stream),
          "move scatter");
    }
  }
  absl::Status waited = b.Wait("move");
  return s.ok() ? waited : s;
}

absl::Status CudaBackend::Quantize(kernels::ElemType elem, const kernels::QuantGeometry& geometry,
                                   absl::Span<const QuantizeOp> ops) {
  if (ops.empty()) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  const uint64_t layout_bytes =
      2ull * geometry.block_tokens * geometry.head_dim * kernels::ElemBytes(elem);
  std::vector<kernels::cuda::QuantizeDeviceOp> list;
  for (const QuantizeOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, layout_bytes, "quantize source"); !s.ok()) return s;
    if (absl::Status s = CheckRange(op.dst, geometry.block_bytes(), "quantize destination");
        !s.ok()) {
      return s;
    }
    list.push_back({op.src, op.dst, op.start, op.count});
  }
  Buffers& b = *buffers_;
  kvmem::MutexLock lock(&b.mu);
  if (absl::Status s = b.Reserve(0, list.size() * sizeof(list[0])); !s.ok()) return s;
  absl::Status s = b.Upload(list);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::QuantizeBlocks(
                     pool_, elem, geometry,
                     reinterpret_cast<const kernels::cuda::QuantizeDeviceOp*>(b.device_ops),
                     static_cast<uint32_t>(list.size()), b.stream),
                 "quantize");
  }
  absl::Status waited = b.Wait("quantize");
  return s.ok() ? waited : s;
}

absl::Status CudaBackend::Dequantize(const kernels::QuantGeometry& geometry, kernels::ElemType elem,
                                     absl::Span<const DequantizeOp> ops) {
  if (ops.empty()) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  const uint64_t row = uint64_t{geometry.head_dim} * kernels::ElemBytes(elem);
  std::vector<kernels::cuda::DequantizeDeviceOp> list;
  uint64_t total = 0;
  for (const DequantizeOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, geometry.block_bytes(), "dequantize"); !s.ok()) {
      return s;
    }
    const uint64_t k_out = total, v_out = Align16(total + op.count * row);
    list.push_back({op.src, k_out, v_out, op.start, op.count});
    total = Align16(v_out + op.count * row);
  }
  Buffers& b = *buffers_;
  kvmem::MutexLock lock(&b.mu);
  if (absl::Status s = b.Reserve(total, list.size() * sizeof(list[0])); !s.ok()) return s;
  absl::Status s = b.Upload(list);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::DequantizeBlocks(
                     pool_, geometry, elem,
                     reinterpret_cast<const kernels::cuda::DequantizeDeviceOp*>(b.device_ops),
                     static_cast<uint32_t>(list.size()), b.device_staging, b.stream),
                 "dequantize");
  }
  if (s.ok()) {
    s = FromCuda(
        cudaMemcpyAsync(b.host_staging, b.device_staging, total, cudaMemcpyDeviceToHost, b.stream),
        "dequantize download");
  }
  absl::Status waited = b.Wait("dequantize");
  if (!s.ok()) return s;
  if (!waited.ok()) return waited;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(ops[i].k_dst, b.host_staging + list[i].k_out, ops[i].count * row);
    std::memcpy(ops[i].v_dst, b.host_staging + list[i].v_out, ops[i].count * row);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotState>> CudaBackend::CreateSlotState(uint32_t num_streams) {
  return MakeCudaSlotState(num_streams, device_, slot_scratch_);
}

std::optional<PoolExport> CudaBackend::pool_export() const {
  if (ipc_handle_.empty()) return std::nullopt;
  return CudaIpcExport{ipc_handle_, pool_bytes_, device_, device_uuid_};
}

}  // namespace kvmem::store
