// CUDA twin of select_ref.cc (contract: select.h): one thread block per stream, all streams
// of a step in one launch. Products and sums use __fmul_rn / __fadd_rn so that nothing is
// fused and every value matches the reference bit for bit. The block-wide steps are cub's:
// the stream maximum (BlockReduce), the radix select's digit search and the compaction's
// ranks (BlockScan over integers). No float is ever summed across threads, so the order cub
// combines in cannot change a bit.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda_launch.h"

namespace kvmem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// max(a, b) by the twin's rule (std::max: b only if a < b), so a NaN never replaces a value
// and a -0 never replaces a +0. Every thread starts from +0, so each partial is a number
// >= +0 (never NaN, never -0) and the block's maximum is the same in any order of combining:
// what select_ref.cc's vector lanes rely on too (MaxLanes).
struct ScoreMax {
  __device__ float operator()(float a, float b) const { return a < b ? b : a; }
};

// Updates one stream's `length` scores with its row; the block's maximum (valid in thread
// 0). `saved` (may be null) gets the scores as they were.
__device__ float UpdateStream(ScoreRule rule, float lambda, uint32_t length, const float* attention,
                              float* scores, float* saved) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const ScoreMax max_of;
  float mx = 0.0f;
  const float keep = 1.0f - lambda;
  for (uint32_t j = threadIdx.x; j < length; j += blockDim.x) {
    const float a = attention[j], s = scores[j];
    if (saved != nullptr) saved[j] = s;
    float e;
    if (rule == ScoreRule::kAccumulate) {
      e = __fadd_rn(s, a);
    } else if (isnan(s)) {
      e = a;
    } else {
      e = __fadd_rn(__fmul_rn(lambda, s), __fmul_rn(keep, a));
    }
    scores[j] = e;
    mx = max_of(mx, e);
  }
  return Reduce(temp).Reduce(mx, max_of);
}

__global__ void UpdateScoresKernel(ScoreRule rule, float lambda, const StreamSlice* streams,
                                   const float* attention, float* scores, float* stream_max) {
  const StreamSlice st = streams[blockIdx.x];
  const float block_max =
      UpdateStream(rule, lambda, st.length, attention + st.offset, scores + st.offset, nullptr);
  if (threadIdx.x == 0) stream_max[blockIdx.x] = block_max;
}

__global__ void UpdateScoresSegmentsKernel(const StepSegment* segments, float* stream_max) {
  const StepSegment g = segments[blockIdx.x];
  const uint32_t at = g.slice.offset;
  const float block_max = UpdateStream(g.op.rule, g.op.lambda, g.slice.length, g.attention,
                                       g.scores + at, g.saved_scores + at);
  if (threadIdx.x == 0) {
    stream_max[blockIdx.x] = block_max;
    *g.slice_out = g.slice;
  }
}

__device__ uint64_t KeyOf(const float* scores, const int64_t* pos, PriorityScale p, uint32_t j) {
  const float a = __fmul_rn(scores[j], p.e_scale);
  const float b = __fmul_rn(__ll2float_rn(pos[j] - pos[0]), p.r_scale);
  return SelectionKey(__fadd_rn(__fadd_rn(a, b), p.r_const), j);
}

// The take-th largest key among the unprotected slots by an 8-pass radix select (keys are
// unique, so exactly `take` keys are >= it), then the keep flags. Each pass counts the next
// byte (digit) of the keys that match the prefix so far, then finds the digit holding the
// remaining-th largest: thread t owns digit 255 - t, and an exclusive sum over the threads
// gives every digit the count of keys above it.
// One stream's keep flags: `length` slots from sc/pos, written to k (and to `copy`, may
// be null).
__device__ void SelectStream(StreamSlice st, const float* sc, const int64_t* pos, float max_score,
                             float attention_weight, uint8_t* k, uint8_t* copy) {
  if (st.length <= st.budget) {
    for (uint32_t j = threadIdx.x; j < st.length; j += blockDim.x) {
      k[j] = 1;
      if (copy != nullptr) copy[j] = 1;
    }
    return;
  }
  const uint32_t protect = min(st.protect, st.budget);
  const uint32_t unprotected = st.length - protect;
  const uint32_t take = st.budget - protect;
  const PriorityScale p =
      PriorityScaleFor(attention_weight, max_score, pos[st.length - 1] - pos[0]);
  using DigitScan = cub::BlockScan<uint32_t, kThreads>;
  static_assert(kThreads == 256, "one thread per digit value");
  __shared__ typename DigitScan::TempStorage scan_temp;
  __shared__ uint32_t hist[256];
  __shared__ uint64_t prefix_s;
  __shared__ uint32_t remaining_s;
  uint64_t prefix = 0, mask = 0;
  uint32_t remaining = take;
  for (int pass = 0; pass < 8 && take > 0; ++pass) {
    const int shift = 56 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < unprotected; j += blockDim.x) {
      const uint64_t key = KeyOf(sc, pos, p, j);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
    }
    __syncthreads();
    const uint32_t d = 255 - threadIdx.x;
    const uint32_t count = hist[d];
    uint32_t above;  // keys matching the prefix whose digit is above d
    DigitScan(scan_temp).ExclusiveSum(count, above);
    // The one digit where the count from the top first reaches `remaining` (the matching
    // keys number at least `remaining`, so one does; digit 0 as the last resort).
    if (above < remaining && (remaining <= above + count || d == 0)) {
      remaining_s = remaining - above;
      prefix_s = prefix | (uint64_t{d} << shift);
    }
    __syncthreads();
    remaining = remaining_s;
    prefix = prefix_s;
    mask |= uint64_t{0xff} << shift;
  }
  for (uint32_t j = threadIdx.x; j < st.length; j += blockDim.x) {
    const uint8_t kept = j >= unprotected || (take > 0 && KeyOf(sc, pos, p, j) >= prefix);
    k[j] = kept;
    if (copy != nullptr) copy[j] = kept;
  }
}

// The take-th largest key among the unprotected slots by an 8-pass radix select (keys are
// unique, so exactly `take` keys are >= it), then the keep flags. Each pass counts the next
// byte (digit) of the keys that match the prefix so far, then finds the digit holding the
// remaining-th largest: thread t owns digit 255 - t, and an exclusive sum over the threads
// gives every digit the count of keys above it.
__global__ void SelectTopKernel(const StreamSlice* streams, const float* scores,
                                const float* stream_max, const int64_t* positions,
                                float attention_weight, uint8_t* keep) {
  const StreamSlice st = streams[blockIdx.x];
  SelectStream(st, scores + st.offset, positions + st.offset,
               stream_max != nullptr ? stream_max[blockIdx.x] : 1.0f, attention_weight,
               keep + st.offset, nullptr);
}

__global__ void SelectTopSegmentsKernel(const StepSegment* segments, const float* stream_max,
                                        uint8_t* keep_copy) {
  const StepSegment g = segments[blockIdx.x];
  if (!g.op.select) return;
  const uint32_t at = g.slice.offset;
  SelectStream(g.slice, g.scores + at, g.positions + at,
               g.op.normalize ? stream_max[blockIdx.x] : 1.0f, g.op.attention_weight, g.keep + at,
               keep_copy + g.keep_copy);
}

__global__ void SelectThresholdKernel(const StreamSlice* streams, const float* scores,
                                      const float* threshold, uint8_t* keep) {
  const StreamSlice st = streams[blockIdx.x];
  const uint32_t unprotected = st.length - min(st.protect, st.length);
  for (uint32_t j = threadIdx.x; j < st.length; j += blockDim.x) {
    keep[st.offset + j] = j >= unprotected || scores[st.offset + j] >= threshold[blockIdx.x];
  }
}

// Stable in-place compaction of one stream: chunk by chunk, every thread reads its slot,
// the block scans the keep flags, then the kept slots are written at or before their old
// index. Returns the kept count (in every thread).
// In place when scores_out == scores and positions_out == positions.
__device__ uint32_t CompactStream(StreamSlice st, const uint8_t* keep, const float* scores,
                                  const int64_t* positions, float* scores_out,
                                  int64_t* positions_out, uint32_t* kept_index) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  uint32_t carry = 0;
  for (uint32_t base = 0; base < st.length; base += kThreads) {
    const uint32_t j = base + threadIdx.x;
    const bool in = j < st.length;
    const uint32_t flag = in ? keep[st.offset + j] : 0;
    const float s = in ? scores[st.offset + j] : 0.0f;
    const int64_t q = in ? positions[st.offset + j] : 0;
    uint32_t rank, total;
    Scan(temp).ExclusiveSum(flag, rank, total);
    __syncthreads();  // every read of this chunk is done before any write
    if (flag) {
      scores_out[st.offset + carry + rank] = s;
      positions_out[st.offset + carry + rank] = q;
      kept_index[st.offset + carry + rank] = j;
    }
    carry += total;
    __syncthreads();  // temp storage reused by the next chunk
  }
  return carry;
}

__global__ void CompactSlotsKernel(const StreamSlice* streams, const uint8_t* keep, float* scores,
                                   int64_t* positions, uint32_t* kept_index, uint32_t* kept) {
  const uint32_t n =
      CompactStream(streams[blockIdx.x], keep, scores, positions, scores, positions, kept_index);
  if (threadIdx.x == 0) kept[blockIdx.x] = n;
}

__global__ void CompactSlotsSegmentsKernel(const CompactSegment* segments, uint32_t* kept) {
  const CompactSegment g = segments[blockIdx.x];
  float* scores_out = g.scores_out != nullptr ? g.scores_out : g.scores;
  int64_t* positions_out = g.positions_out != nullptr ? g.positions_out : g.positions;
  const uint32_t n = CompactStream(g.slice, g.keep, g.scores, g.positions, scores_out,
                                   positions_out, g.kept_index);
  if (threadIdx.x == 0) kept[blockIdx.x] = n;
}

}  // namespace

cudaError_t UpdateScores(ScoreRule rule, float lambda, const StreamSlice* streams,
                         uint32_t num_streams, const float* attention, float* scores,
                         float* stream_max, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;
  return Launched([&] {
    UpdateScoresKernel<<<num_streams, kThreads, 0, stream>>>(rule, lambda, streams, attention,
                                                             scores, stream_max);
  });
}

cudaError_t SelectTop(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                      const float* stream_max, const int64_t* positions, float attention_weight,
                      uint8_t* keep, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;
  return Launched([&] {
    SelectTopKernel<<<num_streams, kThreads, 0, stream>>>(streams, scores, stream_max, positions,
                                                          attention_weight, keep);
  });
}

cudaError_t UpdateScoresSegments(const StepSegment* segments, uint32_t n, float* stream_max,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launched(
      [&] { UpdateScoresSegmentsKernel<<<n, kThreads, 0, stream>>>(segments, stream_max); });
}

cudaError_t SelectTopSegments(const StepSegment* segments, uint32_t n, const float* stream_max,
                              uint8_t* keep_copy, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launched([&] {
    SelectTopSegmentsKernel<<<n, kThreads, 0, stream>>>(segments, stream_max, keep_copy);
  });
}

cudaError_t SelectThreshold(const StreamSlice* streams, uint32_t num_streams, const float* scores,
                            const float* threshold, uint8_t* keep, cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;
  return Launched([&] {
    SelectThresholdKernel<<<num_streams, kThreads, 0, stream>>>(streams, scores, threshold, keep);
  });
}

cudaError_t CompactSlots(const StreamSlice* streams, uint32_t num_streams, const uint8_t* keep,
                         float* scores, int64_t* positions, uint32_t* kept_index, uint32_t* kept,
                         cudaStream_t stream) {
  if (num_streams == 0) return cudaSuccess;
  return Launched([&] {
    CompactSlotsKernel<<<num_streams, kThreads, 0, stream>>>(streams, keep, scores, positions,
                                                             kept_index, kept);
  });
}

cudaError_t CompactSlotsSegments(const CompactSegment* segments, uint32_t n, uint32_t* kept,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launched([&] { CompactSlotsSegmentsKernel<<<n, kThreads, 0, stream>>>(segments, kept); });
}

}  // namespace kvmem::kernels::cuda
