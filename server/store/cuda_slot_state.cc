// SlotState in device memory (contract: slot_state.h). One allocation per sequence holds
// every flat array; the host side keeps only SlotBook (lengths, capacity) and a pinned
// buffer for the transfers a step needs: the attention rows up, the keep flags down.
// Every call completes before it returns.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "kernels/cuda_launch.h"
#include "server/store/cuda_status.h"

namespace kvmem::store {
namespace {

// Byte offsets of the flat arrays in one allocation, for S streams of capacity C. The
// attention rows and the slices are adjacent so that one copy uploads both.
struct Regions {
  uint64_t scores, positions, flags, kept_index, attention, slices, stream_max, kept, bytes;

  static Regions For(uint64_t S, uint64_t C) {
    Regions r{};
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) {
      const uint64_t first = at;
      at = Align16(at + bytes);
      return first;
    };
    r.scores = take(S * C * sizeof(float));
    r.positions = take(S * C * sizeof(int64_t));
    r.flags = take(S * C);
    r.kept_index = take(S * C * sizeof(uint32_t));
    r.attention = take(S * C * sizeof(float));  // C is a power of two >= 16: 16-aligned
    r.slices = take(S * sizeof(kernels::StreamSlice));
    r.stream_max = take(S * sizeof(float));
    r.kept = take(S * sizeof(uint32_t));
    r.bytes = at;
    return r;
  }
  // Pinned bytes: the largest transfer (positions down, or attention + slices up).
  static uint64_t HostBytes(uint64_t S, uint64_t C) {
    return std::max(S * C * sizeof(int64_t),
                    S * C * sizeof(float) + S * sizeof(kernels::StreamSlice));
  }
};

class CudaSlotState final : public SlotState {
 public:
  static absl::StatusOr<std::unique_ptr<CudaSlotState>> Create(uint32_t num_streams, int device) {
    std::unique_ptr<CudaSlotState> state(new CudaSlotState(num_streams, device));
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
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    (void)cudaFree(device_);
    (void)cudaFree(upload_);
    (void)cudaFreeHost(host_);
  }

  uint32_t num_streams() const override { return book_.num_streams(); }
  uint32_t length(uint32_t stream) const override { return book_.length(stream); }
  uint64_t bytes() const override { return regions_.bytes + upload_bytes_; }

  absl::Status Append(absl::Span<const int64_t> positions, float initial_score) override {
    const auto count = static_cast<uint32_t>(positions.size());
    absl::StatusOr<uint32_t> capacity = book_.CapacityFor(count);
    if (!capacity.ok()) return capacity.status();
    if (*capacity != book_.capacity()) {
      if (absl::Status s = Relayout(*capacity); !s.ok()) return s;
    }
    // Upload [positions][scores][ops] once, then one scatter into every stream's tail.
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
    if (absl::Status s = ReserveUpload(total); !s.ok()) return s;
    std::vector<uint8_t> staged(total);
    std::memcpy(staged.data(), positions.data(), count * sizeof(int64_t));
    std::fill_n(reinterpret_cast<float*>(staged.data() + score_at), count, initial_score);
    std::memcpy(staged.data() + ops_at, ops.data(), ops.size() * sizeof(kernels::CopyOp));
    absl::Status s =
        FromCuda(cudaMemcpyAsync(upload_, staged.data(), total, cudaMemcpyHostToDevice, stream_),
                 "slot state: append upload");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::CopyBatch(
                       upload_, device_, reinterpret_cast<const kernels::CopyOp*>(upload_ + ops_at),
                       static_cast<uint32_t>(ops.size()), stream_),
                   "slot state: append scatter");
    }
    if (absl::Status w = Wait("append"); s.ok()) s = w;
    if (!s.ok()) return s;
    book_.Grow(count);
    pending_ = false;
    return absl::OkStatus();
  }

  void DropNewest(uint32_t count) override {
    book_.Shrink(count);
    pending_ = false;
  }

  absl::Status Step(const kernels::ScoreStep& step, absl::Span<const absl::Span<const float>> rows,
                    absl::Span<const uint32_t> budget, uint32_t protect, KeepSets* keep) override {
    const uint32_t S = book_.num_streams();
    if (rows.size() != S || budget.size() != S) {
      return absl::InternalError("slot state: step needs one row and one budget per stream");
    }
    const uint64_t C = book_.capacity();
    if (C == 0) {  // nothing appended yet: every stream is empty
      *keep = KeepSets(S);
      pending_ = false;
      return absl::OkStatus();
    }
    auto* attention = reinterpret_cast<float*>(host_);
    for (uint32_t s = 0; s < S; ++s) {
      if (rows[s].size() != book_.length(s)) {
        return absl::InternalError(absl::StrCat("slot state: row of stream ", s, " has ",
                                                rows[s].size(), " values for ", book_.length(s),
                                                " slots"));
      }
      std::copy(rows[s].begin(), rows[s].end(), attention + s * C);
    }
    const std::vector<kernels::StreamSlice> slices = book_.Slices(budget, protect);
    std::memcpy(host_ + S * C * sizeof(float), slices.data(), S * sizeof(kernels::StreamSlice));
    const auto* d_slices = Ptr<kernels::StreamSlice>(regions_.slices);
    absl::Status s =
        FromCuda(cudaMemcpyAsync(device_ + regions_.attention, host_,
                                 S * C * sizeof(float) + S * sizeof(kernels::StreamSlice),
                                 cudaMemcpyHostToDevice, stream_),
                 "slot state: attention upload");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::UpdateScores(
                       step.rule, step.lambda, d_slices, S, Ptr<float>(regions_.attention),
                       Ptr<float>(regions_.scores), Ptr<float>(regions_.stream_max), stream_),
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
        s = FromCuda(cudaMemcpyAsync(host_, device_ + regions_.flags, S * C, cudaMemcpyDeviceToHost,
                                     stream_),
                     "slot state: keep flags download");
      }
    }
    if (absl::Status w = Wait("step"); s.ok()) s = w;
    if (!s.ok()) return s;
    if (!step.select) {
      *keep = KeepSets(S);
      pending_ = false;
      return absl::OkStatus();
    }
    *keep = book_.ToKeepSets(host_);
    pending_ = true;
    return absl::OkStatus();
  }

  absl::Status CommitStep() override {
    if (!pending_) return absl::OkStatus();
    pending_ = false;
    return Compact();  // the slices and flags of the step are still on the device
  }

  absl::Status Keep(const KeepSets& keep) override {
    pending_ = false;
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    if (C == 0) return book_.FromKeepSets(keep, nullptr);
    if (absl::Status s = book_.FromKeepSets(keep, host_); !s.ok()) return s;
    // Flags, then the slices, both from the pinned buffer.
    const std::vector<kernels::StreamSlice> slices = book_.Slices({}, 0);
    const uint64_t slices_at = Align16(S * C);
    std::memcpy(host_ + slices_at, slices.data(), S * sizeof(kernels::StreamSlice));
    absl::Status s = FromCuda(
        cudaMemcpyAsync(device_ + regions_.flags, host_, S * C, cudaMemcpyHostToDevice, stream_),
        "slot state: keep flags upload");
    if (s.ok()) {
      s = FromCuda(
          cudaMemcpyAsync(device_ + regions_.slices, host_ + slices_at,
                          S * sizeof(kernels::StreamSlice), cudaMemcpyHostToDevice, stream_),
          "slot state: slices upload");
    }
    if (absl::Status w = Wait("keep"); s.ok()) s = w;
    if (!s.ok()) return s;
    return Compact();
  }

  absl::Status ReadScores(std::vector<std::vector<float>>* scores) override {
    if (absl::Status s = Download(regions_.scores, sizeof(float), "scores"); !s.ok()) return s;
    Split(reinterpret_cast<const float*>(host_), scores);
    return absl::OkStatus();
  }

  absl::Status WriteScores(const std::vector<std::vector<float>>& scores) override {
    const uint32_t S = book_.num_streams();
    const uint64_t C = book_.capacity();
    if (scores.size() != S) {
      return absl::InternalError("slot state: one score vector per stream expected");
    }
    if (C == 0) return absl::OkStatus();
    auto* packed = reinterpret_cast<float*>(host_);
    for (uint32_t s = 0; s < S; ++s) {
      if (scores[s].size() != book_.length(s)) {
        return absl::InternalError(absl::StrCat("slot state: ", scores[s].size(),
                                                " scores for stream ", s, " of ", book_.length(s)));
      }
      std::copy(scores[s].begin(), scores[s].end(), packed + s * C);
    }
    absl::Status s =
        FromCuda(cudaMemcpyAsync(device_ + regions_.scores, host_, S * C * sizeof(float),
                                 cudaMemcpyHostToDevice, stream_),
                 "slot state: scores upload");
    if (absl::Status w = Wait("write scores"); s.ok()) s = w;
    return s;
  }

  absl::Status ReadPositions(std::vector<std::vector<int64_t>>* positions) override {
    if (absl::Status s = Download(regions_.positions, sizeof(int64_t), "positions"); !s.ok()) {
      return s;
    }
    Split(reinterpret_cast<const int64_t*>(host_), positions);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<SlotState>> Clone() const override {
    absl::StatusOr<std::unique_ptr<CudaSlotState>> copy = Create(book_.num_streams(), gpu_);
    if (!copy.ok()) return copy.status();
    CudaSlotState& c = **copy;
    if (book_.capacity() > 0) {
      if (absl::Status s = c.Allocate(book_.capacity()); !s.ok()) return s;
      // The scores and positions regions are adjacent: one device-to-device copy.
      const uint64_t bytes = regions_.flags - regions_.scores;
      absl::Status s =
          FromCuda(cudaMemcpyAsync(c.device_, device_, bytes, cudaMemcpyDeviceToDevice, c.stream_),
                   "slot state: clone");
      if (absl::Status w = c.Wait("clone"); s.ok()) s = w;
      if (!s.ok()) return s;
    }
    c.book_ = book_;
    return std::unique_ptr<SlotState>(std::move(*copy));
  }

 private:
  CudaSlotState(uint32_t num_streams, int gpu) : gpu_(gpu), book_(num_streams) {}

  template <typename T>
  T* Ptr(uint64_t offset) const {
    return reinterpret_cast<T*>(device_ + offset);
  }

  absl::Status Wait(absl::string_view what) {
    return FromCuda(cudaStreamSynchronize(stream_), absl::StrCat("slot state: ", what));
  }

  // A fresh allocation (and pinned buffer) for capacity C; the old ones are freed.
  absl::Status Allocate(uint32_t capacity) {
    const uint32_t S = book_.num_streams();
    const Regions regions = Regions::For(S, capacity);
    uint8_t* device = nullptr;
    uint8_t* host = nullptr;
    absl::Status s = FromCuda(cudaMalloc(&device, regions.bytes), "slot state: allocation");
    if (s.ok()) {
      s = FromCuda(cudaMallocHost(&host, Regions::HostBytes(S, capacity)),
                   "slot state: pinned buffer");
    }
    if (!s.ok()) {
      (void)cudaFree(device);
      return s;
    }
    (void)cudaFree(device_);
    (void)cudaFreeHost(host_);
    device_ = device;
    host_ = host;
    regions_ = regions;
    book_.set_capacity(capacity);
    return absl::OkStatus();
  }

  // Moves every stream's live slots to an allocation of the new capacity.
  absl::Status Relayout(uint32_t capacity) {
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
    if (absl::Status s = ReserveUpload(op_bytes); !s.ok()) return s;
    uint8_t* fresh = nullptr;
    if (absl::Status s = FromCuda(cudaMalloc(&fresh, next.bytes), "slot state: allocation");
        !s.ok()) {
      return s;
    }
    absl::Status s =
        FromCuda(cudaMemcpyAsync(upload_, ops.data(), op_bytes, cudaMemcpyHostToDevice, stream_),
                 "slot state: relayout ops");
    if (s.ok()) {
      s = FromCuda(kernels::cuda::CopyBatch(device_, fresh,
                                            reinterpret_cast<const kernels::CopyOp*>(upload_),
                                            static_cast<uint32_t>(ops.size()), stream_),
                   "slot state: relayout");
    }
    if (absl::Status w = Wait("relayout"); s.ok()) s = w;
    uint8_t* host = nullptr;
    if (s.ok()) {
      s = FromCuda(cudaMallocHost(&host, Regions::HostBytes(S, capacity)),
                   "slot state: pinned buffer");
    }
    if (!s.ok()) {
      (void)cudaFree(fresh);
      return s;
    }
    (void)cudaFree(device_);
    (void)cudaFreeHost(host_);
    device_ = fresh;
    host_ = host;
    regions_ = next;
    book_.set_capacity(capacity);
    return absl::OkStatus();
  }

  absl::Status ReserveUpload(uint64_t bytes) {
    if (bytes <= upload_bytes_) return absl::OkStatus();
    (void)cudaFree(upload_);
    upload_ = nullptr;
    upload_bytes_ = 0;
    const uint64_t want = std::max<uint64_t>(bytes, 4096);
    absl::Status s = FromCuda(cudaMalloc(&upload_, want), "slot state: upload buffer");
    if (s.ok()) upload_bytes_ = want;
    return s;
  }

  // CompactSlots by the flags and slices on the device; the kept counts become the lengths.
  absl::Status Compact() {
    const uint32_t S = book_.num_streams();
    absl::Status s =
        FromCuda(kernels::cuda::CompactSlots(
                     Ptr<kernels::StreamSlice>(regions_.slices), S, Ptr<uint8_t>(regions_.flags),
                     Ptr<float>(regions_.scores), Ptr<int64_t>(regions_.positions),
                     Ptr<uint32_t>(regions_.kept_index), Ptr<uint32_t>(regions_.kept), stream_),
                 "slot state: compact");
    if (s.ok()) {
      s = FromCuda(cudaMemcpyAsync(host_, device_ + regions_.kept, S * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream_),
                   "slot state: kept download");
    }
    if (absl::Status w = Wait("compact"); s.ok()) s = w;
    if (!s.ok()) return s;
    const auto* kept = reinterpret_cast<const uint32_t*>(host_);
    for (uint32_t i = 0; i < S; ++i) book_.set_length(i, kept[i]);
    return absl::OkStatus();
  }

  absl::Status Download(uint64_t region, uint64_t elem_bytes, absl::string_view what) {
    const uint64_t bytes = uint64_t{book_.num_streams()} * book_.capacity() * elem_bytes;
    if (bytes == 0) return absl::OkStatus();
    absl::Status s =
        FromCuda(cudaMemcpyAsync(host_, device_ + region, bytes, cudaMemcpyDeviceToHost, stream_),
                 absl::StrCat("slot state: ", what, " download"));
    if (absl::Status w = Wait(what); s.ok()) s = w;
    return s;
  }

  template <typename T>
  void Split(const T* flat, std::vector<std::vector<T>>* out) const {
    out->resize(book_.num_streams());
    for (uint32_t s = 0; s < book_.num_streams(); ++s) {
      const T* first = flat + uint64_t{s} * book_.capacity();
      (*out)[s].assign(first, first + book_.length(s));
    }
  }

  const int gpu_;
  SlotBook book_;
  cudaStream_t stream_ = nullptr;
  Regions regions_{};
  uint8_t* device_ = nullptr;  // Regions::For(S, capacity).bytes
  uint8_t* host_ = nullptr;    // pinned, Regions::HostBytes
  uint8_t* upload_ = nullptr;  // device staging for appends and op lists
  uint64_t upload_bytes_ = 0;
  bool pending_ = false;  // the device flags hold the last Step's keep-sets
};

}  // namespace

absl::StatusOr<std::unique_ptr<SlotState>> MakeCudaSlotState(uint32_t num_streams, int device) {
  absl::StatusOr<std::unique_ptr<CudaSlotState>> state = CudaSlotState::Create(num_streams, device);
  if (!state.ok()) return state.status();
  return std::unique_ptr<SlotState>(std::move(*state));
}

}  // namespace kvmem::store
