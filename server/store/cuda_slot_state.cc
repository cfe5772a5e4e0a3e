// SlotState in device memory (contract: slot_state.h). A sequence owns one device
// allocation with what persists between calls — scores, positions, keep flags, the slices
// of the last step, the scores before it, and a second bank of scores and positions that a
// batched step compacts into (so that its commit only swaps the banks: no round trip) —
// 29 bytes per slot of capacity. What a call needs only while it runs
// (the uploaded attention rows, CompactSlots' index output, pinned host memory for the
// transfers) comes from the backend's CudaScratchPool, its device part allocated and freed
// in the order of the sequence's stream. Every call completes before it returns.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kernels/cuda_launch.h"
#include "server/common/mutex.h"
#include "server/store/cuda_internal.h"

namespace kvmem::store {

class CudaScratchPool final : public SlotStepper {
 public:
  // Device memory of at least the given size from the backend's memory pool, on the stream
  // of the call that took it, and pinned memory from this pool's free list; given back by
  // the Lease.
  class Lease {
   public:
    Lease(CudaScratchPool* pool, StreamOrderedBuffer device, PinnedBuffer host)
        : pool_(pool), device_(std::move(device)), host_(std::move(host)) {}
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          device_(std::move(other.device_)),
          host_(std::move(other.host_)) {}
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease() {
      device_.Release();
      if (pool_ != nullptr) pool_->GiveBack(std::move(host_));
    }
    uint8_t* device() const { return device_.data(); }
    uint8_t* host() const { return host_.data(); }
    uint64_t host_bytes() const { return host_.bytes(); }
    bool Holds(uint64_t device_bytes, uint64_t host_bytes) const {
      return device_.bytes() >= device_bytes && host_.bytes() >= host_bytes;
    }
    // Frees the device memory behind the work queued so far (before the call's final wait,
    // so that the memory is back in the pool when the call returns).
    void ReleaseDevice() { device_.Release(); }

   private:
    CudaScratchPool* pool_;
    StreamOrderedBuffer device_;
    PinnedBuffer host_;
  };

  CudaScratchPool(std::shared_ptr<const CudaMemoryPool> memory, cudaStream_t stream)
      : memory_(std::move(memory)), stream_(stream) {}
  // The deferred leases and the pinned buffers go (free_, after this) with the pool's device
  // current, once the batches' stream has run its work.
  ~CudaScratchPool() override {
    (void)cudaSetDevice(memory_->device());
    (void)cudaStreamSynchronize(stream_);
    std::deque<std::pair<uint64_t, Lease>> leases;
    {
      kvmem::MutexLock lock(&mu_);
      leases.swap(deferred_);
    }
    leases.clear();
    (void)cudaStreamDestroy(stream_);
  }

  // The stream of the batches (AppendAll, StepAll, CommitAll), whatever their states: a
  // batch's appends may then stay queued behind the call that made them (AppendAll does not
  // wait), the step after them running in order on the same stream and its wait covering
  // both.
  cudaStream_t stream() const { return stream_; }
  // Keeps `lease` (its pinned memory read by work queued on stream()) until a wait for
  // stream() has seen that work done; its ticket, which Seen answers for. Drains first
  // when the leases held would pass kMaxDeferred of them or kMaxDeferredBytes (so that
  // they stay bounded). Without host memory to keep it, waits for the work instead: ticket
  // 0, or that wait's error.
  absl::StatusOr<uint64_t> Defer(Lease lease);
  // How the work of `ticket` ended, once a wait for stream() has seen it: OK, or the error
  // of a wait that covered it; nullopt while none has.
  std::optional<absl::Status> Seen(uint64_t ticket) const;
  // Waits for stream(), then gives back the leases deferred before the wait; its status.
  // Allocates nothing once the wait has returned (but for a failure's status).
  absl::Status Drain(absl::string_view what);

  // The Steps of CUDA slot states of this pool's device as one batch (slot_state.h).
  void StepAll(absl::Span<SlotStepCall* const> calls) override;
  void CommitAll(absl::Span<SlotState* const> states) override;
  void AppendAll(absl::Span<SlotAppendCall* const> calls) override;

  // Scratch for work queued on `stream`, a stream of the pool's device.
  absl::StatusOr<Lease> Acquire(uint64_t device_bytes, uint64_t host_bytes, cudaStream_t stream) {
    PinnedBuffer host;
    if (host_bytes > 0) {
      kvmem::MutexLock lock(&mu_);
      // The smallest free buffer that is large enough (a batch's large one stays for the
      // next batch), else the largest one (to be grown).
      auto fits = free_.end();
      for (auto x = free_.begin(); x != free_.end(); ++x) {
        if (x->bytes() >= host_bytes && (fits == free_.end() || x->bytes() < fits->bytes())) {
          fits = x;
        }
      }
      if (fits == free_.end() && !free_.empty()) {
        fits = std::max_element(
            free_.begin(), free_.end(),
            [](const PinnedBuffer& x, const PinnedBuffer& y) { return x.bytes() < y.bytes(); });
      }
      if (fits != free_.end()) {
        host = std::move(*fits);
        free_.erase(fits);
      }
    }
    if (host.bytes() < host_bytes) {
      // On the pool's device, whichever the calling thread has current.
      if (absl::Status s = FromCuda(cudaSetDevice(memory_->device()), "slot state scratch");
          !s.ok()) {
        return s;
      }
      if (absl::Status s = host.Reserve(host_bytes, "slot state pinned scratch"); !s.ok()) {
        return s;
      }
    }
    absl::StatusOr<StreamOrderedBuffer> device =
        memory_->Allocate(device_bytes, stream, "slot state scratch");
    if (!device.ok()) {
      GiveBack(std::move(host));
      return device.status();
    }
    return Lease(this, *std::move(device), std::move(host));
  }

 private:
  void GiveBack(PinnedBuffer host) noexcept {
    if (host.data() == nullptr) return;
    try {
      kvmem::MutexLock lock(&mu_);
      free_.push_back(std::move(host));
    } catch (const std::bad_alloc&) {
      // Not kept: the buffer goes (cudaFreeHost).
    }
  }

  static constexpr size_t kMaxDeferred = 8;
  static constexpr uint64_t kMaxDeferredBytes = 16ull << 20;

  const std::shared_ptr<const CudaMemoryPool> memory_;
  const cudaStream_t stream_;
  mutable absl::Mutex mu_;
  std::vector<PinnedBuffer> free_ ABSL_GUARDED_BY(mu_);
  // Leases whose work is queued on stream_, by ticket (and their pinned bytes); tickets up
  // to done_ are done, those in [fault_from_, fault_upto_] were covered by a wait that
  // failed with fault_ (one range over every failure: it may take a ticket that ran well
  // for one that did not, never the other way).
  std::deque<std::pair<uint64_t, Lease>> deferred_ ABSL_GUARDED_BY(mu_);
  uint64_t deferred_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tickets_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fault_from_ ABSL_GUARDED_BY(mu_) = ~uint64_t{0};
  uint64_t fault_upto_ ABSL_GUARDED_BY(mu_) = 0;
  cudaError_t fault_ ABSL_GUARDED_BY(mu_) = cudaSuccess;
};

absl::StatusOr<uint64_t> CudaScratchPool::Defer(Lease lease) {
  bool full = false;
  {
    kvmem::MutexLock lock(&mu_);
    full = deferred_.size() >= kMaxDeferred ||
           deferred_bytes_ + lease.host_bytes() > kMaxDeferredBytes;
  }
  // Its status is the tickets' it covered (Seen).
  if (full) Drain("slot states: deferred work").IgnoreError();
  try {
    kvmem::MutexLock lock(&mu_);
    const uint64_t bytes = lease.host_bytes();
    deferred_.emplace_back(tickets_ + 1, std::move(lease));  // no effect if it throws
    deferred_bytes_ += bytes;
    return ++tickets_;
  } catch (const std::bad_alloc&) {
    // The lease stays here, given back after the wait.
  }
  if (absl::Status s = Drain("slot states: deferred work"); !s.ok()) return s;
  return 0;
}

std::optional<absl::Status> CudaScratchPool::Seen(uint64_t ticket) const {
  cudaError_t fault = cudaSuccess;
  {
    kvmem::MutexLock lock(&mu_);
    if (ticket > done_) return std::nullopt;
    if (ticket >= fault_from_ && ticket <= fault_upto_) fault = fault_;
  }
  return FromCuda(fault, "slot states: a batched append");
}

absl::Status CudaScratchPool::Drain(absl::string_view what) {
  uint64_t upto = 0;
  {
    kvmem::MutexLock lock(&mu_);
    upto = tickets_;
  }
  const cudaError_t e = cudaStreamSynchronize(stream_);
  {
    kvmem::MutexLock lock(&mu_);
    if (e != cudaSuccess && upto > done_) {
      fault_from_ = std::min(fault_from_, done_ + 1);
      fault_upto_ = std::max(fault_upto_, upto);
      fault_ = e;
    }
    done_ = std::max(done_, upto);
  }
  // The work ran (or failed): its pinned memory is free either way. Given back one lease at
  // a time outside the lock (a Lease's destructor takes it), allocating nothing.
  for (;;) {
    std::optional<Lease> lease;
    {
      kvmem::MutexLock lock(&mu_);
      if (deferred_.empty() || deferred_.front().first > upto) break;  // tickets ascend
      deferred_bytes_ -= deferred_.front().second.host_bytes();
      lease.emplace(std::move(deferred_.front().second));
      deferred_.pop_front();
    }
  }
  return FromCuda(e, what);
}

absl::StatusOr<std::shared_ptr<CudaScratchPool>> MakeCudaScratchPool(
    std::shared_ptr<const CudaMemoryPool> memory) {
  if (absl::Status s = FromCuda(cudaSetDevice(memory->device()), "slot states: set device");
      !s.ok()) {
    return s;
  }
  cudaStream_t stream = nullptr;
  if (absl::Status s = FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                "slot states: stream");
      !s.ok()) {
    return s;
  }
  return std::make_shared<CudaScratchPool>(std::move(memory), stream);
}

namespace {

using kernels::StreamSlice;

// Byte offsets of a sequence's arrays in its allocation, for S streams of capacity C. Two
// banks of [scores][positions]: `scores`/`positions` the live one, `next_*` the other (a
// batched step compacts into it; its commit swaps the offsets).
struct Regions {
  uint64_t scores, positions, flags, slices, stream_max, kept, saved_scores, next_scores,
      next_positions, bytes;

  static Regions For(uint64_t S, uint64_t C) {
    Regions r{};
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) {
      const uint64_t first = at;
      at = Align16(at + bytes);
      return first;
    };
    r.scores = take(S * C * sizeof(float));
    r.positions = take(S * C * sizeof(int64_t));  // right after scores: Clone copies both
    r.flags = take(S * C);
    r.slices = take(S * sizeof(StreamSlice));
    r.stream_max = take(S * sizeof(float));
    r.kept = take(S * sizeof(uint32_t));
    r.saved_scores = take(S * C * sizeof(float));  // the scores before a Step (AbortStep)
    r.next_scores = take(S * C * sizeof(float));
    r.next_positions = take(S * C * sizeof(int64_t));
    r.bytes = at;
    return r;
  }
  // A bank's bytes: its scores and positions lie side by side (one copy moves both).
  static uint64_t BankBytes(uint64_t S, uint64_t C) {
    return Align16(S * C * sizeof(float)) + S * C * sizeof(int64_t);
  }
};

class CudaSlotState final : public BookedSlotState {
 public:
  static absl::StatusOr<std::unique_ptr<CudaSlotState>> Create(
      uint32_t num_streams, int device, std::shared_ptr<CudaScratchPool> scratch) {
    std::unique_ptr<CudaSlotState> state(
        new CudaSlotState(num_streams, device, std::move(scratch)));
    if (absl::Status s = FromCuda(cudaSetDevice(device), "slot state: set device"); !s.ok()) {
      return s;
    }
    if (absl::Status s = FromCuda(cudaStreamCreateWithFlags(&state->stream_, cudaStreamNonBlocking),
                                  "slot state: stream");
        !s.ok()) {
      return s;
    }
    return state;
  }

  ~CudaSlotState() override {
    (void)cudaSetDevice(gpu_);
    // A queued append still writes into device_: done before it goes.
    if (queued_ != 0 && !scratch_->Seen(queued_)) scratch_->Drain("slot state: end").IgnoreError();
    reserved_.reset();  // freed on stream_, so before it goes
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    (void)cudaFree(device_);
  }

  bool in_device_memory() const override { return true; }

  uint64_t BytesAt(uint32_t capacity) const override {
    return capacity == book_.capacity() ? regions_.bytes
                                        : Regions::For(book_.num_streams(), capacity).bytes;
  }

  absl::Status Append(absl::Span<const int64_t> positions, float initial_score) override {
    if (absl::Status s = Ready(); !s.ok()) return s;
    const auto count = static_cast<uint32_t>(positions.size());
    if (absl::Status s = EnsureCapacity(count); !s.ok()) return s;
    // [positions][scores][ops] up once, then one scatter into every stream's tail.
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    const uint64_t score_at = Align16(count * sizeof(int64_t));
    const uint64_t ops_at = Align16(score_at + count * sizeof(float));
    std::vector<kernels::CopyOp> ops;
    ops.reserve(2 * S);
    for (uint64_t s = 0; s < S; ++s) {
      const uint64_t slot = s * C + book_.length(static_cast<uint32_t>(s));
      ops.push_back({0, regions_.positions + slot * sizeof(int64_t), count * sizeof(int64_t)});
      ops.push_back({score_at, regions_.scores + slot * sizeof(float), count * sizeof(float)});
    }
    const uint64_t total = ops_at + ops.size() * sizeof(kernels::CopyOp);
    absl::StatusOr<CudaScratchPool::Lease> lease = scratch_->Acquire(total, total, stream_);
    if (!lease.ok()) return lease.status();
    uint8_t* staged = lease->host();
    std::memcpy(staged, positions.data(), count * sizeof(int64_t));
    std::fill_n(reinterpret_cast<float*>(staged + score_at), count, initial_score);
    std::memcpy(staged + ops_at, ops.data(), ops.size() * sizeof(kernels::CopyOp));
    absl::Status s =
        FromCuda(cudaMemcpyAsync(lease->device(), staged, total, cudaMemcpyHostToDevice, stream_),
                 "slot state: append upload");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::CopyBatch(
                       lease->device(), device_,
                       reinterpret_cast<const kernels::CopyOp*>(lease->device() + ops_at),
                       static_cast<uint32_t>(ops.size()), stream_),
                   "slot state: append scatter");
    }
    lease->ReleaseDevice();
    if (absl::Status w = Wait("append"); s.ok()) s = w;
    if (!s.ok()) return s;
    book_.Grow(count);
    pending_ = false;
    compacted_ = false;
    return absl::OkStatus();
  }

  SlotStepper* stepper() override { return scratch_.get(); }

  absl::Status Step(const kernels::ScoreStep& step, absl::Span<const absl::Span<const float>> rows,
                    absl::Span<const uint32_t> budget, uint32_t protect, KeepSets* keep) override {
    const uint32_t S = book_.num_streams();
    pending_ = false;
    compacted_ = false;
    if (absl::Status s = book_.CheckStep(rows, budget); !s.ok()) return s;
    if (absl::Status s = Ready(); !s.ok()) return s;
    const uint64_t C = book_.capacity();
    if (C == 0) {  // nothing appended yet: every stream is empty
      *keep = KeepSets(S);
      return absl::OkStatus();
    }
    // Pinned: the rows packed back to back, the ops that scatter them to s * C in scratch
    // (so that only live slots cross the bus), the compaction's segments (a selecting step
    // compacts into the other bank in the same round trip: CommitStep swaps the banks), then
    // the slices, which go to this sequence's allocation. Scratch: [packed rows][ops]
    // [segments][rows at s * C][kept indices][kept counts].
    uint64_t live = 0;
    std::vector<kernels::CopyOp> scatter(S);
    const uint64_t laid_out_bytes = S * C * sizeof(float);
    for (uint32_t i = 0; i < S; ++i) {
      scatter[i] = {live * sizeof(float), 0, rows[i].size() * sizeof(float)};
      live += rows[i].size();
    }
    const uint64_t ops_at = Align16(live * sizeof(float));
    const uint64_t segments_at = Align16(ops_at + S * sizeof(kernels::CopyOp));
    const uint64_t upload_bytes = segments_at + S * sizeof(kernels::CompactSegment);
    const uint64_t laid_out_at = Align16(upload_bytes);
    const uint64_t index_at = Align16(laid_out_at + laid_out_bytes);
    const uint64_t kept_at = Align16(index_at + S * C * sizeof(uint32_t));
    for (uint32_t i = 0; i < S; ++i) scatter[i].dst = laid_out_at + uint64_t{i} * C * sizeof(float);
    const uint64_t slice_bytes = S * sizeof(StreamSlice);
    const uint64_t slices_at = Align16(upload_bytes);
    absl::StatusOr<CudaScratchPool::Lease> lease = scratch_->Acquire(
        kept_at + S * sizeof(uint32_t), std::max(slices_at + slice_bytes, S * C), stream_);
    if (!lease.ok()) return lease.status();
    uint8_t* host = lease->host();
    for (uint32_t i = 0; i < S; ++i) {
      std::copy(rows[i].begin(), rows[i].end(), reinterpret_cast<float*>(host + scatter[i].src));
    }
    std::memcpy(host + ops_at, scatter.data(), S * sizeof(kernels::CopyOp));
    const std::vector<StreamSlice> slices = book_.Slices(budget, protect);
    std::memcpy(host + slices_at, slices.data(), slice_bytes);
    auto* d_index = reinterpret_cast<uint32_t*>(lease->device() + index_at);
    auto* segment = reinterpret_cast<kernels::CompactSegment*>(host + segments_at);
    for (uint32_t i = 0; i < S; ++i) {
      segment[i] = {slices[i],
                    Ptr<uint8_t>(regions_.flags),
                    Ptr<float>(regions_.scores),
                    Ptr<int64_t>(regions_.positions),
                    d_index,
                    Ptr<float>(regions_.next_scores),
                    Ptr<int64_t>(regions_.next_positions)};
    }
    const auto* d_slices = Ptr<StreamSlice>(regions_.slices);
    // Offsets in the scatter ops are from the scratch's start, for both source and
    // destination: CopyBatch(src = dst = scratch).
    const auto* d_attention = reinterpret_cast<const float*>(lease->device() + laid_out_at);
    // The scores as they were, in case the step is aborted (device to device, in order).
    absl::Status s =
        FromCuda(cudaMemcpyAsync(device_ + regions_.saved_scores, device_ + regions_.scores,
                                 S * C * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                 "slot state: save scores");
    // Only a save that was enqueued can be restored from; without it nothing ran either.
    const bool save_enqueued = s.ok();
    if (s.ok()) {
      s = FromCuda(
          cudaMemcpyAsync(lease->device(), host, upload_bytes, cudaMemcpyHostToDevice, stream_),
          "slot state: attention upload");
    }
    if (s.ok()) {
      s = FromCuda(cudaMemcpyAsync(device_ + regions_.slices, host + slices_at, slice_bytes,
                                   cudaMemcpyHostToDevice, stream_),
                   "slot state: slices upload");
    }
    if (s.ok()) {
      s = FromCuda(
          kernels::cuda::CopyBatch(
              lease->device(), lease->device(),
              reinterpret_cast<const kernels::CopyOp*>(lease->device() + ops_at), S, stream_),
          "slot state: attention scatter");
    }
    if (s.ok()) {
      s = FromCuda(kernels::cuda::UpdateScores(step.rule, step.lambda, d_slices, S, d_attention,
                                               Ptr<float>(regions_.scores),
                                               Ptr<float>(regions_.stream_max), stream_),
                   "slot state: update scores");
    }
    if (s.ok() && step.select) {
      s = FromCuda(
          kernels::cuda::SelectTop(d_slices, S, Ptr<float>(regions_.scores),
                                   step.normalize ? Ptr<float>(regions_.stream_max) : nullptr,
                                   Ptr<int64_t>(regions_.positions), step.attention_weight,
                                   Ptr<uint8_t>(regions_.flags), stream_),
          "slot state: select");
      if (s.ok()) {
        s = FromCuda(
            kernels::cuda::CompactSlotsSegments(
                reinterpret_cast<const kernels::CompactSegment*>(lease->device() + segments_at), S,
                reinterpret_cast<uint32_t*>(lease->device() + kept_at), stream_),
            "slot state: compaction");
      }
      if (s.ok()) {
        s = FromCuda(cudaMemcpyAsync(lease->host(), device_ + regions_.flags, S * C,
                                     cudaMemcpyDeviceToHost, stream_),
                     "slot state: keep flags download");
      }
    }
    saved_ = save_enqueued;  // from the first launch on, the scores may have changed
    lease->ReleaseDevice();
    if (absl::Status w = Wait("step"); s.ok()) s = w;
    if (!s.ok()) return s;
    FinishStep(step.select, lease->host(), keep);
    if (step.select) Compacted(*keep);
    return absl::OkStatus();
  }

  absl::Status Keep(const KeepSets& keep) override {
    pending_ = false;
    compacted_ = false;
    if (absl::Status s = Ready(); !s.ok()) return s;
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    if (C == 0) return book_.FromKeepSets(keep, nullptr);
    // Pinned: the flags at s * C, then the slices.
    const uint64_t slices_at = Align16(S * C);
    const uint64_t slice_bytes = S * sizeof(StreamSlice);
    absl::StatusOr<Scratch> lease = TakeScratch(0, slices_at + slice_bytes);
    if (!lease.ok()) return lease.status();
    if (absl::Status s = book_.FromKeepSets(keep, lease->host()); !s.ok()) return s;
    const std::vector<StreamSlice> slices = book_.Slices({}, 0);
    std::memcpy(lease->host() + slices_at, slices.data(), slice_bytes);
    absl::Status s = FromCuda(cudaMemcpyAsync(device_ + regions_.flags, lease->host(), S * C,
                                              cudaMemcpyHostToDevice, stream_),
                              "slot state: keep flags upload");
    if (s.ok()) {
      s = FromCuda(cudaMemcpyAsync(device_ + regions_.slices, lease->host() + slices_at,
                                   slice_bytes, cudaMemcpyHostToDevice, stream_),
                   "slot state: slices upload");
    }
    if (absl::Status w = Wait("keep"); s.ok()) s = w;
    if (!s.ok()) return s;
    if (absl::Status c = Compact(); !c.ok()) return c;
    FitCapacity();
    return absl::OkStatus();
  }

  absl::Status ReserveCommit() override {
    if (absl::Status s = Ready(); !s.ok()) return s;  // the scratch is allocated on our device
    const uint64_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    const uint64_t keep_host = Align16(S * C) + S * sizeof(StreamSlice);
    const uint64_t scores_host = S * C * sizeof(float);
    return Reserve(CompactDeviceBytes(), std::max({CompactHostBytes(), keep_host, scores_host}));
  }

  void EndCommit() override {
    reserved_.reset();
    compacted_ = false;
  }

  absl::Status ReadScores(std::vector<std::vector<float>>* scores) override {
    return Download(regions_.scores, scores, "scores");
  }

  absl::Status WriteScores(const std::vector<std::vector<float>>& scores) override {
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    if (absl::Status s = book_.CheckScores(scores); !s.ok()) return s;
    if (absl::Status s = Ready(); !s.ok()) return s;
    if (C == 0) return absl::OkStatus();
    const uint64_t bytes = S * C * sizeof(float);
    absl::StatusOr<Scratch> lease = TakeScratch(0, bytes);
    if (!lease.ok()) return lease.status();
    auto* packed = reinterpret_cast<float*>(lease->host());
    for (uint32_t s = 0; s < S; ++s) std::copy(scores[s].begin(), scores[s].end(), packed + s * C);
    absl::Status s = FromCuda(cudaMemcpyAsync(device_ + regions_.scores, lease->host(), bytes,
                                              cudaMemcpyHostToDevice, stream_),
                              "slot state: scores upload");
    if (absl::Status w = Wait("write scores"); s.ok()) s = w;
    return s;
  }

  absl::Status ReadPositions(std::vector<std::vector<int64_t>>* positions) override {
    return Download(regions_.positions, positions, "positions");
  }

  absl::StatusOr<std::unique_ptr<SlotState>> Clone() const override {
    if (absl::Status s = Ready(); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<CudaSlotState>> copy =
        Create(book_.num_streams(), gpu_, scratch_);
    if (!copy.ok()) return copy.status();
    CudaSlotState& c = **copy;
    if (book_.capacity() > 0) {
      if (absl::Status s = c.Allocate(book_.capacity()); !s.ok()) return s;
      // The live bank's scores and positions: one device-to-device copy.
      const uint64_t bytes = Regions::BankBytes(book_.num_streams(), book_.capacity());
      absl::Status s =
          FromCuda(cudaMemcpyAsync(c.device_ + c.regions_.scores, device_ + regions_.scores, bytes,
                                   cudaMemcpyDeviceToDevice, c.stream_),
                   "slot state: clone");
      if (absl::Status w = c.Wait("clone"); s.ok()) s = w;
      if (!s.ok()) return s;
    }
    c.book_ = book_;
    return std::unique_ptr<SlotState>(std::move(*copy));
  }

 private:
  friend class ::kvmem::store::CudaScratchPool;  // StepAll

  CudaSlotState(uint32_t num_streams, int gpu, std::shared_ptr<CudaScratchPool> scratch)
      : BookedSlotState(num_streams), gpu_(gpu), scratch_(std::move(scratch)) {}

  template <typename T>
  T* Ptr(uint64_t offset) const {
    return reinterpret_cast<T*>(device_ + offset);
  }

  // The current device is per thread; requests arrive on any of the server's threads.
  absl::Status Bind() const { return FromCuda(cudaSetDevice(gpu_), "slot state: set device"); }
  // Bind, and the state's deferred work done (Settle): how every call on it starts.
  absl::Status Ready() const {
    if (absl::Status s = Bind(); !s.ok()) return s;
    return Settle();
  }
  // After a selecting step that compacted into the other bank: what it holds, each
  // stream's kept slots (nullopt: all of them); CommitStep swaps it in.
  void Compacted(const KeepSets& keep) {
    kept_after_.resize(book_.num_streams());
    for (uint32_t k = 0; k < book_.num_streams(); ++k) {
      kept_after_[k] = keep[k] ? static_cast<uint32_t>(keep[k]->size()) : book_.length(k);
    }
    compacted_ = true;
  }
  // A batched append of this state left queued on the pool's stream (AppendAll) is done:
  // waited for here unless a wait for that stream saw it done already. Its failure loses
  // the state (lost_). Fails with lost_ once lost.
  absl::Status Settle() const {
    if (!lost_.ok()) return lost_;
    if (queued_ == 0) return absl::OkStatus();
    std::optional<absl::Status> seen = scratch_->Seen(queued_);
    if (!seen) {
      scratch_->Drain("slot state: a batched append").IgnoreError();  // Seen says how it went
      seen = scratch_->Seen(queued_);
    }
    queued_ = 0;
    if (seen && !seen->ok()) lost_ = *seen;
    return lost_;
  }

  absl::Status Wait(absl::string_view what) {
    return FromCuda(cudaStreamSynchronize(stream_), absl::StrCat("slot state: ", what));
  }

  // An empty allocation of the given capacity (the old one is freed).
  absl::Status Allocate(uint32_t capacity) {
    const Regions regions = Regions::For(book_.num_streams(), capacity);
    uint8_t* device = nullptr;
    if (absl::Status s = FromCuda(cudaMalloc(&device, regions.bytes), "slot state: allocation");
        !s.ok()) {
      return s;
    }
    (void)cudaFree(device_);
    device_ = device;
    regions_ = regions;
    book_.set_capacity(capacity);
    compacted_ = false;  // the other bank is gone
    return absl::OkStatus();
  }

  // Moves every stream's live slots to an allocation of the new capacity.
  absl::Status Relayout(uint32_t capacity) override {
    if (absl::Status s = Settle(); !s.ok()) return s;
    const uint32_t S = book_.num_streams();
    const uint64_t old_c = book_.capacity();
    if (old_c == 0) return Allocate(capacity);
    const Regions old = regions_;
    const Regions next = Regions::For(S, capacity);
    std::vector<kernels::CopyOp> ops;
    for (uint64_t s = 0; s < S; ++s) {
      const uint64_t n = book_.length(static_cast<uint32_t>(s));
      ops.push_back({old.scores + s * old_c * sizeof(float),
                     next.scores + s * capacity * sizeof(float), n * sizeof(float)});
      ops.push_back({old.positions + s * old_c * sizeof(int64_t),
                     next.positions + s * capacity * sizeof(int64_t), n * sizeof(int64_t)});
    }
    const uint64_t op_bytes = ops.size() * sizeof(kernels::CopyOp);
    absl::StatusOr<CudaScratchPool::Lease> lease = scratch_->Acquire(op_bytes, op_bytes, stream_);
    if (!lease.ok()) return lease.status();
    std::memcpy(lease->host(), ops.data(), op_bytes);
    uint8_t* fresh = nullptr;
    if (absl::Status s = FromCuda(cudaMalloc(&fresh, next.bytes), "slot state: allocation");
        !s.ok()) {
      return s;
    }
    absl::Status s = FromCuda(
        cudaMemcpyAsync(lease->device(), lease->host(), op_bytes, cudaMemcpyHostToDevice, stream_),
        "slot state: relayout ops");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::CopyBatch(
                       device_, fresh, reinterpret_cast<const kernels::CopyOp*>(lease->device()),
                       static_cast<uint32_t>(ops.size()), stream_),
                   "slot state: relayout");
    }
    lease->ReleaseDevice();
    if (absl::Status w = Wait("relayout"); s.ok()) s = w;
    if (!s.ok()) {
      (void)cudaFree(fresh);
      return s;
    }
    (void)cudaFree(device_);
    device_ = fresh;
    regions_ = next;
    book_.set_capacity(capacity);
    compacted_ = false;  // the other bank is gone
    return absl::OkStatus();
  }

  absl::Status RestoreScores() override {
    if (absl::Status s = Ready(); !s.ok()) return s;
    const uint64_t bytes = uint64_t{book_.num_streams()} * book_.capacity() * sizeof(float);
    absl::Status s =
        FromCuda(cudaMemcpyAsync(device_ + regions_.scores, device_ + regions_.saved_scores, bytes,
                                 cudaMemcpyDeviceToDevice, stream_),
                 "slot state: restore scores");
    if (absl::Status w = Wait("restore scores"); s.ok()) s = w;
    return s;
  }

  // CompactSlots by the flags and slices in this sequence's allocation (a Step's stay there
  // until CommitStep); the kept counts become the lengths. After a batched step, which
  // compacted into the other bank already: the banks swap, nothing runs on the device.
  absl::Status Compact() override {
    if (std::exchange(compacted_, false)) {
      std::swap(regions_.scores, regions_.next_scores);
      std::swap(regions_.positions, regions_.next_positions);
      for (uint32_t i = 0; i < book_.num_streams(); ++i) book_.set_length(i, kept_after_[i]);
      return absl::OkStatus();
    }
    if (absl::Status s = Ready(); !s.ok()) return s;
    const uint32_t S = book_.num_streams();
    absl::StatusOr<Scratch> lease = TakeScratch(CompactDeviceBytes(), CompactHostBytes());
    if (!lease.ok()) return lease.status();
    absl::Status s = FromCuda(
        kernels::cuda::CompactSlots(
            Ptr<StreamSlice>(regions_.slices), S, Ptr<uint8_t>(regions_.flags),
            Ptr<float>(regions_.scores), Ptr<int64_t>(regions_.positions),
            reinterpret_cast<uint32_t*>(lease->device()), Ptr<uint32_t>(regions_.kept), stream_),
        "slot state: compact");
    if (s.ok()) {
      s = FromCuda(cudaMemcpyAsync(lease->host(), device_ + regions_.kept, S * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream_),
                   "slot state: kept download");
    }
    lease->ReleaseDevice();
    if (absl::Status w = Wait("compact"); s.ok()) s = w;
    if (!s.ok()) return s;
    const auto* kept = reinterpret_cast<const uint32_t*>(lease->host());
    for (uint32_t i = 0; i < S; ++i) book_.set_length(i, kept[i]);
    return absl::OkStatus();
  }

  // One region to the host, split per stream.
  template <typename T>
  absl::Status Download(uint64_t region, std::vector<std::vector<T>>* out, absl::string_view what) {
    if (absl::Status s = Ready(); !s.ok()) return s;
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    out->assign(S, {});
    if (C == 0) return absl::OkStatus();
    const uint64_t bytes = S * C * sizeof(T);
    absl::StatusOr<CudaScratchPool::Lease> lease = scratch_->Acquire(0, bytes, stream_);
    if (!lease.ok()) return lease.status();
    absl::Status s = FromCuda(
        cudaMemcpyAsync(lease->host(), device_ + region, bytes, cudaMemcpyDeviceToHost, stream_),
        absl::StrCat("slot state: ", what, " download"));
    if (absl::Status w = Wait(what); s.ok()) s = w;
    if (!s.ok()) return s;
    const auto* flat = reinterpret_cast<const T*>(lease->host());
    for (uint32_t i = 0; i < S; ++i) {
      (*out)[i].assign(flat + i * C, flat + i * C + book_.length(i));
    }
    return absl::OkStatus();
  }

  const int gpu_;
  const std::shared_ptr<CudaScratchPool> scratch_;
  // Scratch taken before a commit's point of no return (a selecting Step; ReserveCommit),
  // used by what runs past it; EndCommit gives it back.
  std::optional<CudaScratchPool::Lease> reserved_;

  // Scratch for one call: a view of the reservation when it is large enough, else a lease
  // of its own.
  class Scratch {
   public:
    explicit Scratch(CudaScratchPool::Lease* reserved) : view_(reserved) {}
    explicit Scratch(CudaScratchPool::Lease own) : own_(std::move(own)), view_(&*own_) {}
    Scratch(Scratch&& other) noexcept
        : own_(std::move(other.own_)), view_(own_ ? &*own_ : other.view_) {}
    uint8_t* device() const { return view_->device(); }
    uint8_t* host() const { return view_->host(); }
    // Frees the device memory behind the work queued so far, a reservation's too: its one
    // user is the commit's compaction.
    void ReleaseDevice() { view_->ReleaseDevice(); }

   private:
    std::optional<CudaScratchPool::Lease> own_;
    CudaScratchPool::Lease* view_;
  };
  absl::StatusOr<Scratch> TakeScratch(uint64_t device_bytes, uint64_t host_bytes) {
    if (reserved_ && reserved_->Holds(device_bytes, host_bytes)) return Scratch(&*reserved_);
    absl::StatusOr<CudaScratchPool::Lease> lease =
        scratch_->Acquire(device_bytes, host_bytes, stream_);
    if (!lease.ok()) return lease.status();
    return Scratch(*std::move(lease));
  }
  absl::Status Reserve(uint64_t device_bytes, uint64_t host_bytes) {
    reserved_.reset();
    absl::StatusOr<CudaScratchPool::Lease> lease =
        scratch_->Acquire(device_bytes, host_bytes, stream_);
    if (!lease.ok()) return lease.status();
    reserved_.emplace(*std::move(lease));
    return absl::OkStatus();
  }
  // CompactSlots' index output (device) and the kept counts (pinned), at the current size.
  uint64_t CompactDeviceBytes() const {
    return uint64_t{book_.num_streams()} * book_.capacity() * sizeof(uint32_t);
  }
  uint64_t CompactHostBytes() const { return uint64_t{book_.num_streams()} * sizeof(uint32_t); }
  // The step pending compacted into the other bank (StepAll), to kept_after_ slots per
  // stream: Compact swaps the banks. Reset by anything that ends or replaces the step.
  bool compacted_ = false;
  std::vector<uint32_t> kept_after_;
  // The ticket of a batched append queued on the pool's stream and not yet seen done
  // (CudaScratchPool::Defer); 0: none.
  mutable uint64_t queued_ = 0;
  cudaStream_t stream_ = nullptr;
  Regions regions_{};
  uint8_t* device_ = nullptr;  // Regions::For(S, capacity).bytes
};

}  // namespace

void CudaScratchPool::StepAll(absl::Span<SlotStepCall* const> calls) {
  // What each Step checks before its transfers, per call: a call that fails here, or whose
  // state holds no slot yet, is done and stays out of the batch.
  std::vector<SlotStepCall*> batch;
  std::vector<CudaSlotState*> states;
  for (SlotStepCall* call : calls) {
    auto* state = static_cast<CudaSlotState*>(call->state);
    state->pending_ = false;
    state->compacted_ = false;
    call->status = state->book_.CheckStep(call->rows, call->budget);
    // Not Ready(): an append of the state queued on stream() runs before this batch there.
    if (call->status.ok()) call->status = state->Bind();
    if (call->status.ok()) call->status = state->lost_;
    if (!call->status.ok()) continue;
    if (state->book_.capacity() == 0) {  // nothing appended yet: every stream is empty
      *call->keep = KeepSets(state->book_.num_streams());
      continue;
    }
    batch.push_back(call);
    states.push_back(state);
  }
  if (batch.empty()) return;
  // One buffer, up: [step segments][compaction segments][rows packed]; on the device then
  // [stream max][keep flags][kept indices][kept counts], the flags (state by state,
  // capacity per stream, as Step downloads them) coming back. A selecting call's state is
  // compacted to its flags into its other bank in the same round trip, so that its commit
  // has nothing left to run on the device (CudaSlotState::Compact swaps the banks).
  uint64_t segments = 0, compactions = 0, row_values = 0, flag_bytes = 0;
  std::vector<uint64_t> flags_at(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const SlotBook& book = states[i]->book_;
    segments += book.num_streams();
    for (const absl::Span<const float>& row : batch[i]->rows) row_values += row.size();
    flags_at[i] = flag_bytes;
    if (batch[i]->op.select) {
      flag_bytes += book.total_slots();
      compactions += book.num_streams();
    }
  }
  const uint64_t compact_at = Align16(segments * sizeof(kernels::StepSegment));
  const uint64_t rows_at = Align16(compact_at + compactions * sizeof(kernels::CompactSegment));
  const uint64_t upload_bytes = rows_at + row_values * sizeof(float);
  const uint64_t max_at = Align16(upload_bytes);
  const uint64_t flags_device_at = Align16(max_at + segments * sizeof(float));
  const uint64_t index_at = Align16(flags_device_at + flag_bytes);
  const uint64_t kept_at = Align16(index_at + flag_bytes * sizeof(uint32_t));
  const uint64_t device_bytes = kept_at + compactions * sizeof(uint32_t);
  const uint64_t flags_host_at = Align16(upload_bytes);
  cudaStream_t stream = stream_;
  auto fail_all = [&](const absl::Status& why) {
    for (SlotStepCall* call : batch) call->status = why;
  };
  absl::StatusOr<Lease> lease = Acquire(device_bytes, flags_host_at + flag_bytes, stream);
  if (!lease.ok()) {
    // Nothing ran: each steps alone (one entry's large rows must not fail the others).
    for (size_t i = 0; i < batch.size(); ++i) {
      SlotStepCall& c = *batch[i];
      c.status = states[i]->Step(c.op, c.rows, c.budget, c.protect, c.keep);
    }
    return;
  }
  uint8_t* host = lease->host();
  uint8_t* device = lease->device();
  auto* segment = reinterpret_cast<kernels::StepSegment*>(host);
  auto* compaction = reinterpret_cast<kernels::CompactSegment*>(host + compact_at);
  auto* packed = reinterpret_cast<float*>(host + rows_at);
  auto* d_index = reinterpret_cast<uint32_t*>(device + index_at);
  uint64_t row_at = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const CudaSlotState& st = *states[i];
    const uint32_t S = st.book_.num_streams();
    const uint64_t C = st.book_.capacity();
    const std::vector<kernels::StreamSlice> slices =
        st.book_.Slices(batch[i]->budget, batch[i]->protect);
    for (uint32_t s = 0; s < S; ++s, ++segment) {
      const absl::Span<const float> row = batch[i]->rows[s];
      std::copy(row.begin(), row.end(), packed + row_at);
      *segment = kernels::StepSegment{slices[s],
                                      batch[i]->op,
                                      reinterpret_cast<const float*>(device + rows_at) + row_at,
                                      st.Ptr<float>(st.regions_.scores),
                                      st.Ptr<float>(st.regions_.saved_scores),
                                      st.Ptr<int64_t>(st.regions_.positions),
                                      st.Ptr<uint8_t>(st.regions_.flags),
                                      st.Ptr<kernels::StreamSlice>(st.regions_.slices) + s,
                                      flags_at[i] + s * C};
      row_at += row.size();
      if (!batch[i]->op.select) continue;
      *compaction++ = kernels::CompactSegment{slices[s],
                                              st.Ptr<uint8_t>(st.regions_.flags),
                                              st.Ptr<float>(st.regions_.scores),
                                              st.Ptr<int64_t>(st.regions_.positions),
                                              d_index + flags_at[i],
                                              st.Ptr<float>(st.regions_.next_scores),
                                              st.Ptr<int64_t>(st.regions_.next_positions)};
    }
  }
  const auto* d_segments = reinterpret_cast<const kernels::StepSegment*>(device);
  auto* d_max = reinterpret_cast<float*>(device + max_at);
  const auto n = static_cast<uint32_t>(segments);
  absl::Status s =
      FromCuda(cudaMemcpyAsync(device, host, upload_bytes, cudaMemcpyHostToDevice, stream),
               "slot states: batched step upload");
  bool launched = false;  // from the first launch on, the scores may have changed
  if (s.ok()) {
    s = FromCuda(kernels::cuda::UpdateScoresSegments(d_segments, n, d_max, stream),
                 "slot states: batched score update");
    launched = s.ok();
  }
  if (s.ok() && flag_bytes > 0) {
    s = FromCuda(
        kernels::cuda::SelectTopSegments(d_segments, n, d_max, device + flags_device_at, stream),
        "slot states: batched select");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::CompactSlotsSegments(
                       reinterpret_cast<const kernels::CompactSegment*>(device + compact_at),
                       static_cast<uint32_t>(compactions),
                       reinterpret_cast<uint32_t*>(device + kept_at), stream),
                   "slot states: batched compaction");
    }
    if (s.ok()) {
      s = FromCuda(cudaMemcpyAsync(host + flags_host_at, device + flags_device_at, flag_bytes,
                                   cudaMemcpyDeviceToHost, stream),
                   "slot states: keep flags download");
    }
  }
  lease->ReleaseDevice();
  for (CudaSlotState* state : states) state->saved_ = launched;
  const absl::Status waited = Drain("slot states: batched step");
  if (s.ok()) s = waited;
  // Their appends ran before the step: the wait saw them (no wait here).
  for (CudaSlotState* state : states) state->Settle().IgnoreError();
  if (!s.ok()) return fail_all(s);
  for (size_t i = 0; i < batch.size(); ++i) {
    CudaSlotState& st = *states[i];
    try {
      st.FinishStep(batch[i]->op.select, host + flags_host_at + flags_at[i], batch[i]->keep);
      if (batch[i]->op.select) st.Compacted(*batch[i]->keep);
    } catch (const std::bad_alloc&) {
      // The engine aborts the step (AbortStep puts the saved scores back).
      batch[i]->status = absl::ResourceExhaustedError("slot state step: out of host memory");
    }
  }
}

void CudaScratchPool::CommitAll(absl::Span<SlotState* const> all) {
  std::vector<CudaSlotState*> states;
  uint64_t segments = 0, slots = 0;
  for (SlotState* s : all) {
    auto* state = static_cast<CudaSlotState*>(s);
    // A batched step's compaction ran with it (its commit swaps the banks).
    if (!state->pending_ || state->compacted_ || !state->Bind().ok() || !state->lost_.ok()) {
      continue;
    }
    states.push_back(state);
    segments += state->book_.num_streams();
    slots += state->book_.total_slots();
  }
  if (states.empty()) return;
  // Up: the segments; on the device then CompactSlots' index output (laid out as each
  // state's scores, state after state) and the kept counts, which come back.
  const uint64_t index_at = Align16(segments * sizeof(kernels::CompactSegment));
  const uint64_t kept_at = Align16(index_at + slots * sizeof(uint32_t));
  const uint64_t kept_host_at = index_at;
  cudaStream_t stream = stream_;
  absl::StatusOr<Lease> lease = Acquire(kept_at + segments * sizeof(uint32_t),
                                        kept_host_at + segments * sizeof(uint32_t), stream);
  if (!lease.ok()) return;  // each compacts in its CommitStep
  uint8_t* host = lease->host();
  uint8_t* device = lease->device();
  auto* segment = reinterpret_cast<kernels::CompactSegment*>(host);
  uint64_t index = 0;
  for (CudaSlotState* st : states) {
    const uint32_t S = st->book_.num_streams();
    const std::vector<kernels::StreamSlice> slices = st->book_.Slices({}, 0);
    for (uint32_t s = 0; s < S; ++s, ++segment) {
      *segment = kernels::CompactSegment{slices[s], st->Ptr<uint8_t>(st->regions_.flags),
                                         st->Ptr<float>(st->regions_.scores),
                                         st->Ptr<int64_t>(st->regions_.positions),
                                         reinterpret_cast<uint32_t*>(device + index_at) + index};
    }
    index += st->book_.total_slots();
  }
  const auto n = static_cast<uint32_t>(segments);
  absl::Status s =
      FromCuda(cudaMemcpyAsync(device, host, segments * sizeof(kernels::CompactSegment),
                               cudaMemcpyHostToDevice, stream),
               "slot states: batched compaction upload");
  bool launched = false;  // from the launch on, the slots may have moved
  if (s.ok()) {
    s = FromCuda(kernels::cuda::CompactSlotsSegments(
                     reinterpret_cast<const kernels::CompactSegment*>(device), n,
                     reinterpret_cast<uint32_t*>(device + kept_at), stream),
                 "slot states: batched compaction");
    launched = s.ok();
  }
  if (s.ok()) {
    s = FromCuda(cudaMemcpyAsync(host + kept_host_at, device + kept_at, n * sizeof(uint32_t),
                                 cudaMemcpyDeviceToHost, stream),
                 "slot states: kept download");
  }
  lease->ReleaseDevice();
  const absl::Status waited = Drain("slot states: batched compaction");
  if (s.ok()) s = waited;
  for (CudaSlotState* st : states) st->Settle().IgnoreError();  // seen by that wait
  // Nothing launched: each compacts in its CommitStep. Launched and failed, the compaction
  // may have run in part and cannot be run again: each CommitStep fails with the error.
  if (!s.ok()) {
    if (launched) {
      for (CudaSlotState* st : states) st->commit_error_ = s;
    }
    return;
  }
  const auto* kept = reinterpret_cast<const uint32_t*>(host + kept_host_at);
  for (CudaSlotState* st : states) {
    for (uint32_t i = 0; i < st->book_.num_streams(); ++i) st->book_.set_length(i, *kept++);
    st->pending_ = false;
  }
}

void CudaScratchPool::AppendAll(absl::Span<SlotAppendCall* const> calls) {
  // Room first, as each Append makes it (a relayout is rare: capacity doubles).
  std::vector<SlotAppendCall*> batch;
  std::vector<CudaSlotState*> states;
  uint64_t staged = 0, num_ops = 0;
  for (SlotAppendCall* call : calls) {
    auto* state = static_cast<CudaSlotState*>(call->state);
    const auto count = static_cast<uint32_t>(call->positions.size());
    call->status = state->Bind();
    if (call->status.ok()) call->status = state->lost_;
    // A relayout settles what the state has queued first.
    if (call->status.ok()) call->status = state->EnsureCapacity(count);
    if (!call->status.ok()) continue;
    batch.push_back(call);
    states.push_back(state);
    staged += Align16(count * sizeof(int64_t)) + Align16(count * sizeof(float));
    num_ops += 2 * state->book_.num_streams();
  }
  if (batch.empty()) return;
  // Up: every call's [positions][scores], then the ops that scatter them into every
  // stream's tail of its state.
  const uint64_t ops_at = staged;
  const uint64_t total = ops_at + num_ops * sizeof(kernels::ScatterOp);
  cudaStream_t stream = stream_;
  // A failure appends each alone: nothing a length covers has changed (a copy that ran
  // wrote past every length), so each Append may run again.
  auto each_alone = [&] {
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i]->status = states[i]->Append(batch[i]->positions, batch[i]->initial_score);
    }
  };
  absl::StatusOr<Lease> lease = Acquire(total, total, stream);
  if (!lease.ok()) return each_alone();
  uint8_t* host = lease->host();
  auto* op = reinterpret_cast<kernels::ScatterOp*>(host + ops_at);
  uint64_t at = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const CudaSlotState& st = *states[i];
    const absl::Span<const int64_t> positions = batch[i]->positions;
    const uint64_t count = positions.size();
    const uint64_t score_at = at + Align16(count * sizeof(int64_t));
    std::memcpy(host + at, positions.data(), count * sizeof(int64_t));
    std::fill_n(reinterpret_cast<float*>(host + score_at), count, batch[i]->initial_score);
    const uint64_t C = st.book_.capacity();
    for (uint32_t s = 0; s < st.book_.num_streams(); ++s) {
      const uint64_t slot = s * C + st.book_.length(s);
      *op++ = {at, st.Ptr<uint8_t>(st.regions_.positions + slot * sizeof(int64_t)),
               count * sizeof(int64_t)};
      *op++ = {score_at, st.Ptr<uint8_t>(st.regions_.scores + slot * sizeof(float)),
               count * sizeof(float)};
    }
    at = score_at + Align16(count * sizeof(float));
  }
  uint8_t* device = lease->device();
  absl::Status s = FromCuda(cudaMemcpyAsync(device, host, total, cudaMemcpyHostToDevice, stream),
                            "slot states: batched append upload");
  if (s.ok()) {
    s = FromCuda(kernels::cuda::ScatterBatch(
                     device, reinterpret_cast<const kernels::ScatterOp*>(device + ops_at),
                     static_cast<uint32_t>(num_ops), stream),
                 "slot states: batched append scatter");
  }
  lease->ReleaseDevice();
  if (!s.ok()) {
    // What was queued ran (or failed) before the pinned memory goes back.
    Drain("slot states: batched append").IgnoreError();
    return each_alone();
  }
  // No wait: the appends stay queued on stream(), where the batch's step runs after them
  // and waits for both; a state settles them before any call of its own (Ready).
  const absl::StatusOr<uint64_t> ticket = Defer(*std::move(lease));
  if (!ticket.ok()) return each_alone();  // lengths not grown yet: each may run again
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->status = absl::OkStatus();
    states[i]->book_.Grow(static_cast<uint32_t>(batch[i]->positions.size()));
    states[i]->pending_ = false;
    states[i]->compacted_ = false;
    states[i]->queued_ = *ticket;
  }
}

absl::StatusOr<std::unique_ptr<SlotState>> MakeCudaSlotState(
    uint32_t num_streams, int device, std::shared_ptr<CudaScratchPool> scratch) {
  absl::StatusOr<std::unique_ptr<CudaSlotState>> state =
      CudaSlotState::Create(num_streams, device, std::move(scratch));
  if (!state.ok()) return state.status();
  return std::unique_ptr<SlotState>(std::move(*state));
}

}  // namespace kvmem::store
