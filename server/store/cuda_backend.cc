#include "server/store/cuda_backend.h"

#include <cuda_runtime.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda_launch.h"
#include "server/common/mutex.h"
#include "server/store/cuda_internal.h"

namespace kvmem::store {

StreamOrderedBuffer& StreamOrderedBuffer::operator=(StreamOrderedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = other.stream_;
  }
  return *this;
}

void StreamOrderedBuffer::Release() {
  if (data_ == nullptr) return;
  (void)cudaFreeAsync(data_, stream_);  // fails only for a pointer or stream it never made
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<std::shared_ptr<CudaMemoryPool>> CudaMemoryPool::Create(int device,
                                                                       uint64_t release_threshold) {
  int supported = 0;
  if (absl::Status s =
          FromCuda(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device),
                   "memory pool support");
      !s.ok()) {
    return s;
  }
  if (supported == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda: device ", device,
                     " has no stream-ordered memory pools (cudaMallocAsync), which the CUDA "
                     "backend's scratch needs"));
  }
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;  // device memory that stays where it is
  props.handleTypes = cudaMemHandleTypeNone;      // scratch is never exported
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (absl::Status s = FromCuda(cudaMemPoolCreate(&pool, &props), "memory pool"); !s.ok()) {
    return s;
  }
  std::shared_ptr<CudaMemoryPool> made(new CudaMemoryPool(device, pool));
  uint64_t threshold = release_threshold;  // cuuint64_t, as the attribute takes it
  if (absl::Status s =
          FromCuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
                   "memory pool release threshold");
      !s.ok()) {
    return s;
  }
  return made;
}

CudaMemoryPool::~CudaMemoryPool() { (void)cudaMemPoolDestroy(pool_); }

absl::StatusOr<StreamOrderedBuffer> CudaMemoryPool::Allocate(uint64_t bytes, cudaStream_t stream,
                                                             absl::string_view what) const {
  if (bytes == 0) return StreamOrderedBuffer();
  void* data = nullptr;
  if (absl::Status s = FromCuda(cudaMallocFromPoolAsync(&data, bytes, pool_, stream), what);
      !s.ok()) {
    return s;
  }
  return StreamOrderedBuffer(static_cast<uint8_t*>(data), bytes, stream);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    (void)cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() { (void)cudaFreeHost(data_); }

absl::Status PinnedBuffer::Reserve(uint64_t bytes, absl::string_view what) {
  if (bytes <= bytes_) return absl::OkStatus();
  (void)cudaFreeHost(data_);
  data_ = nullptr;
  bytes_ = 0;
  uint64_t rounded = 4096;  // a power of two, so that the size settles after a few calls
  while (rounded < bytes) rounded *= 2;
  if (absl::Status s = FromCuda(cudaMallocHost(&data_, rounded), what); !s.ok()) {
    data_ = nullptr;
    return s;
  }
  bytes_ = rounded;
  return absl::OkStatus();
}

// The backend's stream and pinned staging, used by one request at a time; a request's device
// memory (staging and op list) comes from the backend's CudaMemoryPool.
struct CudaBackend::Buffers {
  absl::Mutex mu;
  cudaStream_t stream = nullptr;
  PinnedBuffer host_staging;

  ~Buffers() {
    if (stream != nullptr) cudaStreamDestroy(stream);  // its queued frees still run
  }

  // One call's device memory, [staging][op list] in one allocation on `stream`.
  struct Call {
    StreamOrderedBuffer memory;
    uint64_t ops_at = 0;
    uint8_t* staging() const { return memory.data(); }
    uint8_t* ops() const { return memory.data() + ops_at; }
  };
  // Device memory for a call (and `staging` bytes of host_staging where `pinned`).
  absl::StatusOr<Call> Borrow(const CudaMemoryPool& pool, uint64_t staging, uint64_t ops,
                              bool pinned) {
    if (pinned) {
      if (absl::Status s = host_staging.Reserve(staging, "pinned staging"); !s.ok()) return s;
    }
    Call call;
    call.ops_at = Align16(staging);
    absl::StatusOr<StreamOrderedBuffer> memory =
        pool.Allocate(call.ops_at + ops, stream, "staging and op list");
    if (!memory.ok()) return memory.status();
    call.memory = *std::move(memory);
    return call;
  }
  // Uploads an op list (the host vector may go right after: pageable memory is read now).
  template <typename T>
  absl::Status Upload(const Call& call, const std::vector<T>& ops) {
    if (ops.empty()) return absl::OkStatus();
    return FromCuda(cudaMemcpyAsync(call.ops(), ops.data(), ops.size() * sizeof(T),
                                    cudaMemcpyHostToDevice, stream),
                    "op list upload");
  }
  // Frees the call's device memory behind its work, then waits for both.
  absl::Status Finish(Call& call, absl::string_view what) {
    call.memory.Release();
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
  if (absl::Status s = FromCuda(cudaStreamSynchronize(b->buffers_->stream), "pool clear");
      !s.ok()) {
    return s;
  }
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, b->pool_) == cudaSuccess) {
    b->ipc_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
  } else {
    (void)cudaGetLastError();  // no IPC on this platform: the pool is simply not exported
  }
  absl::StatusOr<std::shared_ptr<CudaMemoryPool>> memory = CudaMemoryPool::Create(device);
  if (!memory.ok()) return memory.status();
  b->memory_ = *std::move(memory);
  absl::StatusOr<std::shared_ptr<CudaScratchPool>> scratch = MakeCudaScratchPool(b->memory_);
  if (!scratch.ok()) return scratch.status();
  b->slot_scratch_ = *std::move(scratch);
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
  absl::StatusOr<Buffers::Call> call =
      b.Borrow(*memory_, total, scatter.size() * sizeof(kernels::CopyOp), /*pinned=*/true);
  if (!call.ok()) return call.status();
  uint8_t* host = b.host_staging.data();
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(host + scatter[i].src, ops[i].src, ops[i].bytes);
  }
  absl::Status s = b.Upload(*call, scatter);
  if (s.ok()) {
    s = FromCuda(cudaMemcpyAsync(call->staging(), host, total, cudaMemcpyHostToDevice, b.stream),
                 "write upload");
  }
  if (s.ok()) {
    s = FromCuda(kernels::cuda::CopyBatch(call->staging(), pool_,
                                          reinterpret_cast<const kernels::CopyOp*>(call->ops()),
                                          static_cast<uint32_t>(scatter.size()), b.stream),
                 "write scatter");
  }
  absl::Status waited = b.Finish(*call, "write");
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
  absl::StatusOr<Buffers::Call> call =
      b.Borrow(*memory_, total, gather.size() * sizeof(kernels::CopyOp), /*pinned=*/true);
  if (!call.ok()) return call.status();
  uint8_t* host = b.host_staging.data();
  absl::Status s = b.Upload(*call, gather);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::CopyBatch(pool_, call->staging(),
                                          reinterpret_cast<const kernels::CopyOp*>(call->ops()),
                                          static_cast<uint32_t>(gather.size()), b.stream),
                 "read gather");
  }
  if (s.ok()) {
    s = FromCuda(cudaMemcpyAsync(host, call->staging(), total, cudaMemcpyDeviceToHost, b.stream),
                 "read download");
  }
  absl::Status waited = b.Finish(*call, "read");
  if (!s.ok()) return s;
  if (!waited.ok()) return waited;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(ops[i].dst, host + gather[i].dst, ops[i].bytes);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Move(absl::Span<const MoveOp> ops) {
  return MoveDisjoint(absl::MakeConstSpan(&ops, 1));
}

absl::Status CudaBackend::MoveDisjoint(absl::Span<const absl::Span<const MoveOp>> batches) {
  std::vector<std::vector<kernels::CopyOp>> moves(batches.size());
  bool any = false;
  for (size_t b = 0; b < batches.size(); ++b) {
    for (const MoveOp& op : batches[b]) {
      if (absl::Status s = CheckRange(op.src, op.bytes, "move source"); !s.ok()) return s;
      if (absl::Status s = CheckRange(op.dst, op.bytes, "move destination"); !s.ok()) return s;
      moves[b].push_back({op.src, op.dst, op.bytes});
      any = true;
    }
  }
  if (!any) return absl::OkStatus();
  if (absl::Status s = Bind(); !s.ok()) return s;
  // Per wave (copy.h): every source to scratch, then scratch to every destination. Every
  // wave's two op lists go up in one copy: wave w's gathers, then its scatters. The
  // batches' waves run side by side (wave w of each in wave w).
  const std::vector<kernels::MoveWave> waves = kernels::PlanMoveWaves(moves);
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
  absl::StatusOr<Buffers::Call> call =
      b.Borrow(*memory_, scratch, lists.size() * sizeof(kernels::CopyOp), /*pinned=*/false);
  if (!call.ok()) return call.status();
  absl::Status s = b.Upload(*call, lists);
  const auto* list = reinterpret_cast<const kernels::CopyOp*>(call->ops());
  for (size_t w = 0; s.ok() && w < waves.size(); ++w) {
    const auto n = static_cast<uint32_t>(waves[w].gather.size());
    s = FromCuda(kernels::cuda::CopyBatch(pool_, call->staging(), list + first[w], n, b.stream),
                 "move gather");
    if (s.ok()) {
      s = FromCuda(
          kernels::cuda::CopyBatch(call->staging(), pool_, list + first[w] + n, n, b.stream),
          "move scatter");
    }
  }
  absl::Status waited = b.Finish(*call, "move");
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
  absl::StatusOr<Buffers::Call> call =
      b.Borrow(*memory_, 0, list.size() * sizeof(list[0]), /*pinned=*/false);
  if (!call.ok()) return call.status();
  absl::Status s = b.Upload(*call, list);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::QuantizeBlocks(
                     pool_, elem, geometry,
                     reinterpret_cast<const kernels::cuda::QuantizeDeviceOp*>(call->ops()),
                     static_cast<uint32_t>(list.size()), b.stream),
                 "quantize");
  }
  absl::Status waited = b.Finish(*call, "quantize");
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
  absl::StatusOr<Buffers::Call> call =
      b.Borrow(*memory_, total, list.size() * sizeof(list[0]), /*pinned=*/true);
  if (!call.ok()) return call.status();
  uint8_t* host = b.host_staging.data();
  absl::Status s = b.Upload(*call, list);
  if (s.ok()) {
    s = FromCuda(kernels::cuda::DequantizeBlocks(
                     pool_, geometry, elem,
                     reinterpret_cast<const kernels::cuda::DequantizeDeviceOp*>(call->ops()),
                     static_cast<uint32_t>(list.size()), call->staging(), b.stream),
                 "dequantize");
  }
  if (s.ok()) {
    s = FromCuda(cudaMemcpyAsync(host, call->staging(), total, cudaMemcpyDeviceToHost, b.stream),
                 "dequantize download");
  }
  absl::Status waited = b.Finish(*call, "dequantize");
  if (!s.ok()) return s;
  if (!waited.ok()) return waited;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(ops[i].k_dst, host + list[i].k_out, ops[i].count * row);
    std::memcpy(ops[i].v_dst, host + list[i].v_out, ops[i].count * row);
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
