// GPU parity: every CUDA kernel against its C++ reference on random inputs. Needs CUDA and
// CMake only (no GoogleTest here: tests/gpu/run.sh builds on bare GPU machines). Exits 0
// when all checks pass, 1 on a mismatch, 77 (skipped) when no CUDA device is present.
// Arguments name the groups to run (move, quant, select, compact, segments); none runs them all
// (tests/gpu/run.sh runs select and compact again under racecheck).
//
// Tolerances: none. Every kernel is specified bit for bit (copies, compaction, selection
// keys with unfused f32 arithmetic, quantization with IEEE division and round-half-even),
// so each comparison is byte-exact.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda_launch.h"
#include "tests/gpu/cuda_check.h"

namespace kvmem::kernels {
namespace {

int checks = 0, failures = 0;

void Check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    if (failures <= 20) std::printf("MISMATCH: %s\n", what.c_str());
  }
}

// A device copy of a host vector, freed with the object.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    CUDA_OK(cudaMalloc(&ptr_, std::max<size_t>(1, n_) * sizeof(T)));
    if (n_ > 0) CUDA_OK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() { return ptr_; }
  std::vector<T> Host() const {
    std::vector<T> out(n_);
    CUDA_OK(cudaDeviceSynchronize());
    if (n_ > 0) CUDA_OK(cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

std::mt19937 rng(2024);

void MoveBatches() {
  for (int trial = 0; trial < 300; ++trial) {
    const uint64_t size = 1 << 16;
    std::vector<uint8_t> pool(size);
    for (auto& b : pool) b = static_cast<uint8_t>(rng());
    std::vector<CopyOp> ops(1 + rng() % 64);
    for (CopyOp& op : ops) {
      const bool aligned = rng() % 2;
      op.bytes = aligned ? 16 * (rng() % 64) : rng() % 700;
      op.src = rng() % (size - op.bytes + 1);
      op.dst = rng() % (size - op.bytes + 1);
      if (aligned) op.src &= ~15ull, op.dst &= ~15ull;
    }
    DeviceArray<uint8_t> d_pool(pool);
    MoveBatchRef(pool.data(), ops.data(), ops.size());
    // The CUDA backend's way: per wave, pool -> scratch, then scratch -> pool.
    for (const MoveWave& wave : PlanMoveWaves(ops.data(), ops.size())) {
      DeviceArray<uint8_t> scratch(std::vector<uint8_t>(wave.scratch_bytes + 16));
      DeviceArray<CopyOp> g(wave.gather), s(wave.scatter);
      CUDA_OK(cuda::CopyBatch(d_pool.get(), scratch.get(), g.get(), wave.gather.size(), nullptr));
      CUDA_OK(cuda::CopyBatch(scratch.get(), d_pool.get(), s.get(), wave.scatter.size(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
    }
    Check(d_pool.Host() == pool, "move batch, trial " + std::to_string(trial));
  }
}

void Quantization() {
  const ElemType elems[] = {ElemType::kF16, ElemType::kBF16, ElemType::kF32};
  const QuantType types[] = {QuantType::kInt8, QuantType::kInt4, QuantType::kNF4};
  const uint32_t dims[] = {64, 128, 96, 80, 7};
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (ElemType elem : elems) {
    for (QuantType type : types) {
      for (uint32_t D : dims) {
        const QuantGeometry g{type, 16, D};
        const uint32_t blocks = 40;
        const uint64_t layout = 2ull * g.block_tokens * D * ElemBytes(elem);
        const uint64_t qbytes = g.block_bytes();
        // Pool: `blocks` layout blocks, then `blocks` quantized blocks (zeroed).
        std::vector<uint8_t> pool(blocks * (layout + qbytes), 0);
        for (uint64_t i = 0; i < uint64_t{blocks} * 2 * g.block_tokens * D; ++i) {
          float x = normal(rng);
          if (i % 97 == 0) x = 0;
          if (i % 1013 == 0) x *= 1000;
          // Non-finite values (quantize.h's rule): NaN, +Inf, -Inf now and then.
          if (i % 331 == 0) x = std::nanf("");
          if (i % 577 == 0) x = std::copysign(INFINITY, x);
          StoreElem(pool.data(), i, elem, x);
        }
        // A zero channel in block 0 (scale 0 decodes to 0).
        for (uint32_t t = 0; t < g.block_tokens; ++t) StoreElem(pool.data(), t * D, elem, 0.0f);
        std::vector<cuda::QuantizeDeviceOp> ops;
        for (uint32_t b = 0; b < blocks; ++b) {
          const uint32_t start = rng() % g.block_tokens;
          const uint32_t count = 1 + rng() % (g.block_tokens - start);
          ops.push_back({b * layout, blocks * layout + b * qbytes, start, count});
        }
        DeviceArray<uint8_t> d_pool(pool);
        DeviceArray<cuda::QuantizeDeviceOp> d_ops(ops);
        for (const auto& op : ops) {
          QuantizeBlockRef(pool.data() + op.src, elem, g, op.start, op.count, pool.data() + op.dst);
        }
        CUDA_OK(cuda::QuantizeBlocks(d_pool.get(), elem, g, d_ops.get(), ops.size(), nullptr));
        const std::string what = "quantize elem " + std::to_string(int(elem)) + " type " +
                                 std::to_string(int(type)) + " D " + std::to_string(D);
        Check(d_pool.Host() == pool, what);
        // Dequantize every op's live rows into a staging buffer.
        std::vector<cuda::DequantizeDeviceOp> dops;
        uint64_t at = 0;
        const uint64_t row = uint64_t{D} * ElemBytes(elem);
        std::vector<uint8_t> want;
        for (const auto& op : ops) {
          dops.push_back({op.dst, at, at + op.count * row, op.start, op.count});
          at += 2 * op.count * row;
        }
        want.resize(at);
        for (size_t i = 0; i < ops.size(); ++i) {
          DequantizeBlockRef(pool.data() + ops[i].dst, g, ops[i].start, ops[i].count, elem,
                             want.data() + dops[i].k_out, want.data() + dops[i].v_out);
        }
        DeviceArray<uint8_t> out(std::vector<uint8_t>(at, 0));
        DeviceArray<cuda::DequantizeDeviceOp> d_dops(dops);
        CUDA_OK(cuda::DequantizeBlocks(d_pool.get(), g, elem, d_dops.get(), dops.size(), out.get(),
                                       nullptr));
        Check(out.Host() == want, "de" + what);
      }
    }
  }
}

struct Streams {
  std::vector<StreamSlice> slices;
  std::vector<float> scores, attention, mx;
  std::vector<int64_t> positions;
};

Streams RandomStreams(uint32_t num, uint32_t max_len) {
  Streams s;
  for (uint32_t i = 0; i < num; ++i) {
    const uint32_t n = rng() % max_len;
    s.slices.push_back({static_cast<uint32_t>(s.scores.size()), n,
                        static_cast<uint32_t>(1 + rng() % (max_len / 2 + 1)),
                        static_cast<uint32_t>(rng() % 64)});
    int64_t at = rng() % 10;
    for (uint32_t j = 0; j < n; ++j) {
      const uint32_t kind = rng() % 10;
      s.scores.push_back(kind == 0 ? std::nanf("") : static_cast<float>(rng() % 16) / 16);
      s.attention.push_back(static_cast<float>(rng() % 1000) / 1000);
      s.positions.push_back(at += 1 + rng() % 3);
    }
  }
  s.mx.assign(num, 0);
  return s;
}

template <typename T>
bool BitEqual(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void Selection() {
  for (int trial = 0; trial < 60; ++trial) {
    const uint32_t num = 1 + rng() % 300;
    Streams s = RandomStreams(num, trial % 10 == 0 ? 6000 : 600);
    const ScoreRule rule = trial % 2 ? ScoreRule::kEma : ScoreRule::kAccumulate;
    if (rule == ScoreRule::kAccumulate) {
      for (float& x : s.scores) x = std::isnan(x) ? 0.0f : x;
    }
    DeviceArray<StreamSlice> d_slices(s.slices);
    DeviceArray<float> d_scores(s.scores), d_att(s.attention), d_mx(s.mx);
    DeviceArray<int64_t> d_pos(s.positions);
    UpdateScoresRef(rule, 0.9f, s.slices.data(), num, s.attention.data(), s.scores.data(),
                    s.mx.data());
    CUDA_OK(cuda::UpdateScores(rule, 0.9f, d_slices.get(), num, d_att.get(), d_scores.get(),
                               d_mx.get(), nullptr));
    const std::string t = " trial " + std::to_string(trial);
    Check(BitEqual(d_scores.Host(), s.scores), "update scores" + t);
    Check(BitEqual(d_mx.Host(), s.mx), "stream max" + t);
    for (float w : {0.65f, 1.0f, 0.0f}) {
      std::vector<uint8_t> keep(s.scores.size(), 9);
      DeviceArray<uint8_t> d_keep(keep);
      SelectTopRef(s.slices.data(), num, s.scores.data(), s.mx.data(), s.positions.data(), w,
                   keep.data());
      CUDA_OK(cuda::SelectTop(d_slices.get(), num, d_scores.get(), d_mx.get(), d_pos.get(), w,
                              d_keep.get(), nullptr));
      Check(d_keep.Host() == keep, "select top w=" + std::to_string(w) + t);
    }
    {  // raw scores (H2O): no normalizer
      std::vector<uint8_t> keep(s.scores.size(), 9);
      DeviceArray<uint8_t> d_keep(keep);
      SelectTopRef(s.slices.data(), num, s.scores.data(), nullptr, s.positions.data(), 1.0f,
                   keep.data());
      CUDA_OK(cuda::SelectTop(d_slices.get(), num, d_scores.get(), nullptr, d_pos.get(), 1.0f,
                              d_keep.get(), nullptr));
      Check(d_keep.Host() == keep, "select top raw" + t);
    }
    std::vector<float> threshold(num);
    for (float& x : threshold) x = static_cast<float>(rng() % 16) / 16;
    std::vector<uint8_t> keep(s.scores.size(), 9);
    DeviceArray<uint8_t> d_keep(keep);
    DeviceArray<float> d_thr(threshold);
    SelectThresholdRef(s.slices.data(), num, s.scores.data(), threshold.data(), keep.data());
    CUDA_OK(cuda::SelectThreshold(d_slices.get(), num, d_scores.get(), d_thr.get(), d_keep.get(),
                                  nullptr));
    Check(d_keep.Host() == keep, "select threshold" + t);
    // Compaction of the metadata to the threshold's keep-set.
    std::vector<uint32_t> index(s.scores.size(), 0), kept(num, 0);
    DeviceArray<uint32_t> d_index(index), d_kept(kept);
    CompactSlotsRef(s.slices.data(), num, keep.data(), s.scores.data(), s.positions.data(),
                    index.data(), kept.data());
    CUDA_OK(cuda::CompactSlots(d_slices.get(), num, d_keep.get(), d_scores.get(), d_pos.get(),
                               d_index.get(), d_kept.get(), nullptr));
    const std::vector<uint32_t> got_kept = d_kept.Host(), got_index = d_index.Host();
    const std::vector<float> got_scores = d_scores.Host();
    const std::vector<int64_t> got_pos = d_pos.Host();
    bool same = got_kept == kept;
    for (uint32_t i = 0; same && i < num; ++i) {
      for (uint32_t r = 0; r < kept[i]; ++r) {
        const uint32_t at = s.slices[i].offset + r;
        same = same && got_index[at] == index[at] && got_pos[at] == s.positions[at] &&
               std::memcmp(&got_scores[at], &s.scores[at], 4) == 0;
      }
    }
    Check(same, "compact slots" + t);
  }
}

void RowCompaction() {
  for (int trial = 0; trial < 40; ++trial) {
    const RowGeometry g{16, static_cast<uint32_t>(4 * (1 + rng() % 64))};
    const uint64_t block_bytes = 2ull * g.block_tokens * g.row_bytes;
    const uint32_t num = 1 + rng() % 64;
    std::vector<StreamSlice> slices;
    std::vector<uint32_t> first;
    std::vector<uint8_t> keep;
    uint32_t blocks = 0;
    for (uint32_t s = 0; s < num; ++s) {
      const uint32_t n = rng() % 300;
      slices.push_back({static_cast<uint32_t>(keep.size()), n, 0, 0});
      first.push_back(blocks);
      blocks += (n + g.block_tokens - 1) / g.block_tokens;
      for (uint32_t j = 0; j < n; ++j) keep.push_back(rng() % 4 != 0);
    }
    std::vector<uint64_t> offsets(blocks);
    for (uint32_t i = 0; i < blocks; ++i) offsets[i] = i * block_bytes;
    std::shuffle(offsets.begin(), offsets.end(), rng);
    std::vector<uint8_t> pool(std::max<uint64_t>(1, blocks * block_bytes));
    for (auto& b : pool) b = static_cast<uint8_t>(rng());
    std::vector<float> scores(keep.size(), 0);
    std::vector<int64_t> positions(keep.size(), 0);
    std::vector<uint32_t> index(keep.size()), kept(num), used(num, 0);
    CompactSlotsRef(slices.data(), num, keep.data(), scores.data(), positions.data(), index.data(),
                    kept.data());
    DeviceArray<uint8_t> d_pool(pool);
    DeviceArray<StreamSlice> d_slices(slices);
    DeviceArray<uint32_t> d_index(index), d_kept(kept), d_first(first), d_used(used);
    DeviceArray<uint64_t> d_offsets(offsets);
    CompactRowsRef(slices.data(), num, index.data(), kept.data(), offsets.data(), first.data(), g,
                   pool.data(), used.data());
    CUDA_OK(cuda::CompactRows(d_slices.get(), num, d_index.get(), d_kept.get(), d_offsets.get(),
                              d_first.get(), g, d_pool.get(), d_used.get(), nullptr));
    Check(d_pool.Host() == pool, "compact rows trial " + std::to_string(trial));
    Check(d_used.Host() == used, "blocks used trial " + std::to_string(trial));
  }
}

// The batched step's kernels (one launch over the streams of several sequences, each in
// its own allocation): UpdateScoresSegments, SelectTopSegments, CompactSlotsSegments and
// ScatterBatch against their references, which run the per-stream ones.
void Segments() {
  for (int trial = 0; trial < 30; ++trial) {
    const std::string t = " trial " + std::to_string(trial);
    const uint32_t states = 1 + rng() % 8;
    std::vector<Streams> host(states);
    std::vector<std::unique_ptr<DeviceArray<float>>> d_scores, d_saved;
    std::vector<std::unique_ptr<DeviceArray<int64_t>>> d_pos;
    std::vector<std::unique_ptr<DeviceArray<uint8_t>>> d_keep;
    std::vector<std::unique_ptr<DeviceArray<StreamSlice>>> d_slice_out;
    std::vector<std::vector<float>> saved(states);
    std::vector<std::vector<uint8_t>> keep(states);
    std::vector<std::vector<StreamSlice>> slice_out(states);
    std::vector<float> rows;
    std::vector<StepSegment> h_seg, d_seg_host;
    std::vector<uint64_t> row_at;
    uint64_t copy_bytes = 0;
    const ScoreStep ops[] = {{ScoreRule::kEma, 0.9f, 0.65f, true, true},
                             {ScoreRule::kAccumulate, 0.0f, 1.0f, false, true},
                             {ScoreRule::kEma, 0.5f, 0.65f, true, trial % 2 == 0}};
    for (uint32_t i = 0; i < states; ++i) {
      Streams& st = host[i] = RandomStreams(1 + rng() % 40, trial % 7 == 0 ? 3000 : 500);
      for (size_t k = 0; k < st.slices.size(); ++k) {  // NaN (never scored) under EMA only
        if (ops[(i + k) % 3].rule != ScoreRule::kAccumulate) continue;
        for (uint32_t j = 0; j < st.slices[k].length; ++j) {
          float& x = st.scores[st.slices[k].offset + j];
          x = std::isnan(x) ? 0.0f : x;
        }
      }
      saved[i].assign(st.scores.size(), -1.0f);
      keep[i].assign(st.scores.size(), 9);
      slice_out[i].assign(st.slices.size(), StreamSlice{});
      d_scores.push_back(std::make_unique<DeviceArray<float>>(st.scores));
      d_saved.push_back(std::make_unique<DeviceArray<float>>(saved[i]));
      d_pos.push_back(std::make_unique<DeviceArray<int64_t>>(st.positions));
      d_keep.push_back(std::make_unique<DeviceArray<uint8_t>>(keep[i]));
      d_slice_out.push_back(std::make_unique<DeviceArray<StreamSlice>>(slice_out[i]));
    }
    // Rows packed back to back; each segment's flags copied to keep_copy in order.
    for (uint32_t i = 0; i < states; ++i) {
      for (size_t s = 0; s < host[i].slices.size(); ++s) {
        const StreamSlice sl = host[i].slices[s];
        row_at.push_back(rows.size());
        rows.insert(rows.end(), host[i].attention.begin() + sl.offset,
                    host[i].attention.begin() + sl.offset + sl.length);
        // Each segment its own policy's rule, as in a batch that mixes policies.
        const ScoreStep op = ops[(i + s) % 3];
        h_seg.push_back({sl, op, nullptr, host[i].scores.data(), saved[i].data(),
                         host[i].positions.data(), keep[i].data(), &slice_out[i][s], copy_bytes});
        d_seg_host.push_back({sl, op, nullptr, d_scores[i]->get(), d_saved[i]->get(),
                              d_pos[i]->get(), d_keep[i]->get(), d_slice_out[i]->get() + s,
                              copy_bytes});
        copy_bytes += sl.length;
      }
    }
    DeviceArray<float> d_rows(rows);
    for (size_t g = 0; g < h_seg.size(); ++g) {
      h_seg[g].attention = rows.data() + row_at[g];
      d_seg_host[g].attention = d_rows.get() + row_at[g];
    }
    const auto n = static_cast<uint32_t>(h_seg.size());
    std::vector<float> mx(n, 0);
    std::vector<uint8_t> copy(copy_bytes, 7);
    DeviceArray<StepSegment> d_seg(d_seg_host);
    DeviceArray<float> d_mx(mx);
    DeviceArray<uint8_t> d_copy(copy);
    UpdateScoresSegmentsRef(h_seg.data(), n, mx.data());
    SelectTopSegmentsRef(h_seg.data(), n, mx.data(), copy.data());
    CUDA_OK(cuda::UpdateScoresSegments(d_seg.get(), n, d_mx.get(), nullptr));
    CUDA_OK(cuda::SelectTopSegments(d_seg.get(), n, d_mx.get(), d_copy.get(), nullptr));
    Check(BitEqual(d_mx.Host(), mx), "segments: stream max" + t);
    Check(d_copy.Host() == copy, "segments: keep copy" + t);
    for (uint32_t i = 0; i < states; ++i) {
      Check(BitEqual(d_scores[i]->Host(), host[i].scores), "segments: scores" + t);
      Check(BitEqual(d_saved[i]->Host(), saved[i]), "segments: saved scores" + t);
      Check(d_keep[i]->Host() == keep[i], "segments: keep" + t);
      Check(BitEqual(d_slice_out[i]->Host(), slice_out[i]), "segments: slices" + t);
    }
    // The compaction to those flags, by segments: the streams that selected (a state is
    // compacted only after a selecting step); odd states into arrays of their own (a batched
    // step's other bank), even ones in place.
    std::vector<CompactSegment> hc, dc_host;
    std::vector<std::vector<uint32_t>> index(states);
    std::vector<std::unique_ptr<DeviceArray<uint32_t>>> d_index;
    std::vector<std::vector<float>> out_scores(states);
    std::vector<std::vector<int64_t>> out_pos(states);
    std::vector<std::unique_ptr<DeviceArray<float>>> d_out_scores;
    std::vector<std::unique_ptr<DeviceArray<int64_t>>> d_out_pos;
    for (uint32_t i = 0; i < states; ++i) {
      index[i].assign(host[i].scores.size(), 0);
      d_index.push_back(std::make_unique<DeviceArray<uint32_t>>(index[i]));
      out_scores[i].assign(host[i].scores.size(), 0.0f);
      out_pos[i].assign(host[i].positions.size(), 0);
      d_out_scores.push_back(std::make_unique<DeviceArray<float>>(out_scores[i]));
      d_out_pos.push_back(std::make_unique<DeviceArray<int64_t>>(out_pos[i]));
      const bool apart = i % 2 == 1;
      for (size_t k = 0; k < host[i].slices.size(); ++k) {
        if (!ops[(i + k) % 3].select) continue;
        const StreamSlice sl = host[i].slices[k];
        hc.push_back({sl, keep[i].data(), host[i].scores.data(), host[i].positions.data(),
                      index[i].data(), apart ? out_scores[i].data() : nullptr,
                      apart ? out_pos[i].data() : nullptr});
        dc_host.push_back({sl, d_keep[i]->get(), d_scores[i]->get(), d_pos[i]->get(),
                           d_index[i]->get(), apart ? d_out_scores[i]->get() : nullptr,
                           apart ? d_out_pos[i]->get() : nullptr});
      }
    }
    const auto nc = static_cast<uint32_t>(hc.size());
    std::vector<uint32_t> kept(nc, 0);
    DeviceArray<CompactSegment> d_cseg(dc_host);
    DeviceArray<uint32_t> d_kept(kept);
    CompactSlotsSegmentsRef(hc.data(), nc, kept.data());
    CUDA_OK(cuda::CompactSlotsSegments(d_cseg.get(), nc, d_kept.get(), nullptr));
    Check(d_kept.Host() == kept, "segments: kept" + t);
    bool same = true;
    uint32_t g = 0;
    for (uint32_t i = 0; i < states; ++i) {
      const bool apart = i % 2 == 1;
      const std::vector<float> sc = apart ? d_out_scores[i]->Host() : d_scores[i]->Host();
      const std::vector<int64_t> pos = apart ? d_out_pos[i]->Host() : d_pos[i]->Host();
      const std::vector<float>& want_sc = apart ? out_scores[i] : host[i].scores;
      const std::vector<int64_t>& want_pos = apart ? out_pos[i] : host[i].positions;
      const std::vector<uint32_t> idx = d_index[i]->Host();
      for (size_t k = 0; k < host[i].slices.size(); ++k) {
        if (!ops[(i + k) % 3].select) continue;
        const StreamSlice sl = host[i].slices[k];
        for (uint32_t r = 0; r < kept[g]; ++r) {
          const uint32_t at = sl.offset + r;
          same = same && idx[at] == index[i][at] && pos[at] == want_pos[at] &&
                 std::memcmp(&sc[at], &want_sc[at], 4) == 0;
        }
        ++g;
      }
    }
    Check(same, "segments: compact slots" + t);
    // A scatter into every state's scores, from one staged buffer.
    std::vector<uint8_t> staged(64 * states);
    for (auto& b : staged) b = static_cast<uint8_t>(rng());
    std::vector<ScatterOp> h_ops, d_ops_host;
    for (uint32_t i = 0; i < states; ++i) {
      const uint64_t bytes = std::min<uint64_t>(64, host[i].scores.size() * 4);
      h_ops.push_back({64ull * i, reinterpret_cast<uint8_t*>(host[i].scores.data()), bytes});
      d_ops_host.push_back({64ull * i, reinterpret_cast<uint8_t*>(d_scores[i]->get()), bytes});
    }
    DeviceArray<uint8_t> d_staged(staged);
    DeviceArray<ScatterOp> d_ops(d_ops_host);
    ScatterBatchRef(staged.data(), h_ops.data(), h_ops.size());
    CUDA_OK(cuda::ScatterBatch(d_staged.get(), d_ops.get(), states, nullptr));
    bool scattered = true;
    for (uint32_t i = 0; i < states; ++i) {
      const std::vector<float> sc = d_scores[i]->Host();
      const uint64_t bytes = h_ops[i].bytes;
      scattered = scattered && std::memcmp(sc.data(), host[i].scores.data(), bytes) == 0;
    }
    Check(scattered, "scatter batch" + t);
  }
}

}  // namespace
}  // namespace kvmem::kernels

int main(int argc, char** argv) {
  const std::set<std::string> groups = {"move", "quant", "select", "compact", "segments"};
  const std::set<std::string> asked(argv + 1, argv + argc);
  for (const std::string& group : asked) {
    if (groups.count(group) == 0) {
      std::printf("gpu parity: unknown group '%s' (move, quant, select, compact, segments)\n",
                  group.c_str());
      return 2;
    }
  }
  const auto wanted = [&](const char* group) { return asked.empty() || asked.count(group) > 0; };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu parity: no CUDA device, skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("gpu parity on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  using namespace kvmem::kernels;
  if (wanted("move")) MoveBatches();
  if (wanted("quant")) Quantization();
  if (wanted("select")) Selection();
  if (wanted("compact")) RowCompaction();
  if (wanted("segments")) Segments();
  std::printf("gpu parity: %d checks, %d mismatches\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
