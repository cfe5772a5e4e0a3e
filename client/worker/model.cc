#include "model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvmem::worker {
namespace {

absl::StatusOr<std::vector<float>> LoadF32(const GgufFile& file, const std::string& name,
                                           std::vector<uint64_t> dims) {
  absl::StatusOr<const GgufTensor*> t = file.Tensor(name);
  if (!t.ok()) return t.status();
  if ((*t)->dims != dims) {
    std::string want, got;
    for (uint64_t d : dims) want += absl::StrCat(d, " ");
    for (uint64_t d : (*t)->dims) got += absl::StrCat(d, " ");
    return absl::DataLossError(
        absl::StrCat("gguf: tensor ", name, " has dims [", got, "], expected [", want, "]"));
  }
  return file.ToFloat(**t);
}

void RmsNorm(const float* x, const float* w, uint32_t n, float eps, float* out) {
  double ss = 0;
  for (uint32_t i = 0; i < n; ++i) ss += double{x[i]} * x[i];
  const float scale = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (uint32_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

// y[T][out] = x[T][in] * W^T with W stored [out][in] (GGUF dims [in, out]).
void MatMul(const float* x, const std::vector<float>& w, uint32_t T, uint32_t in, uint32_t out,
            float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(T), static_cast<int>(out),
              static_cast<int>(in), 1.0f, x, static_cast<int>(in), w.data(), static_cast<int>(in),
              0.0f, y, static_cast<int>(out));
}

// Rotary embedding, llama.cpp "normal" mode: pairs (2i, 2i+1) rotated by pos * base^(-2i/d).
void Rope(float* x, uint32_t heads, uint32_t dim, int64_t pos, float base) {
  for (uint32_t i = 0; i < dim / 2; ++i) {
    const double theta = static_cast<double>(pos) * std::pow(base, -2.0 * i / dim);
    const float c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
    for (uint32_t h = 0; h < heads; ++h) {
      float* p = x + h * dim + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
  }
}

// Prompts at least this long attend through matrix products (BlockedAttention).
constexpr uint32_t kBlockedMinTokens = 32;

// Causal attention of T new queries of `heads` query heads (starting at `head0`, all sharing
// one KV stream) over the stream's past (every past position before the new ones) and the
// new keys, as matrix products over chunks of queries: S = Q K^T / sqrt(d) through BLAS,
// a row softmax over the visible keys, O = P V through BLAS. `accumulate(t, p, valid)`
// receives every query's weights. Same arithmetic as the row-by-row path up to summation
// order; O(T * n) memory per chunk instead of per row.
template <typename Accumulate>
void BlockedAttention(const float* q, uint32_t q_stride, uint32_t head0, uint32_t heads, uint32_t T,
                      const PastStream& past, const float* new_k, const float* new_v, uint32_t D,
                      float scale, float* out, Accumulate&& accumulate) {
  constexpr uint32_t kChunk = 128;
  const size_t n_past = past.slots();
  const size_t n = n_past + T;
  // K and V of the stream, past then new, contiguous [n][D].
  std::vector<float> k(n * D), v(n * D);
  size_t at = 0;
  for (const PastStream::Run& run : past.runs) {
    std::copy_n(run.k, uint64_t{run.count} * D, k.data() + at * D);
    std::copy_n(run.v, uint64_t{run.count} * D, v.data() + at * D);
    at += run.count;
  }
  std::copy_n(new_k, uint64_t{T} * D, k.data() + n_past * D);
  std::copy_n(new_v, uint64_t{T} * D, v.data() + n_past * D);
  std::vector<float> s(uint64_t{kChunk} * n);
  for (uint32_t h = head0; h < head0 + heads; ++h) {
    for (uint32_t t0 = 0; t0 < T; t0 += kChunk) {
      const uint32_t rows = std::min(kChunk, T - t0);
      const size_t keys = n_past + t0 + rows;  // what the chunk's last query sees
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(keys), static_cast<int>(D), scale,
                  q + uint64_t{t0} * q_stride + uint64_t{h} * D, static_cast<int>(q_stride),
                  k.data(), static_cast<int>(D), 0.0f, s.data(), static_cast<int>(keys));
      // One thread: OpenMP here would spin against OpenBLAS's own threads between the two
      // products (measured: most of the prefill time went to the two pools' waiting).
      for (int r = 0; r < static_cast<int>(rows); ++r) {
        float* row = s.data() + uint64_t(r) * keys;
        const size_t valid = n_past + t0 + r + 1;
        const float mx = *std::max_element(row, row + valid);
        const float inv_z = 1.0f / ExpShiftSum(row, valid, mx);
        for (size_t j = 0; j < valid; ++j) row[j] *= inv_z;
        std::fill(row + valid, row + keys, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                  static_cast<int>(D), static_cast<int>(keys), 1.0f, s.data(),
                  static_cast<int>(keys), v.data(), static_cast<int>(D), 0.0f,
                  out + uint64_t{t0} * q_stride + uint64_t{h} * D, static_cast<int>(q_stride));
      for (uint32_t r = 0; r < rows; ++r) {
        accumulate(t0 + r, s.data() + uint64_t{r} * keys, n_past + t0 + r + 1);
      }
    }
  }
}

// One new query per head of a GQA group (`heads` heads from `head0`, sharing one KV stream):
// decode. Each past key and value row is read once for the whole group, while it is in L1,
// rather than once per head (the group's later heads would read the stream's K/V again from
// L2 or memory). Per head the arithmetic and its
// order are those of the row-by-row path: the same Dot per key, softmax, then Axpy per value
// row in slot order; `accumulate(0, p, n)` is called per head in head order. `scores` is
// scratch of heads * (n_past + 1) floats.
template <typename Accumulate>
void DecodeAttention(const float* q, uint32_t head0, uint32_t heads, const PastStream& past,
                     int64_t position, const float* new_k, const float* new_v, uint32_t D,
                     float scale, float* out, std::vector<float>* scores, Accumulate&& accumulate) {
  const size_t n_past = past.slots();
  const size_t n = n_past + 1;
  scores->resize(uint64_t{heads} * n);
  float* s = scores->data();
  const float* qh = q + uint64_t{head0} * D;
  // The runs lie apart (a pool's blocks) and a hardware prefetcher stops at each one's end:
  // while one run is read, the next one's rows are fetched, row for row (bench/RESULTS.md).
  auto prefetch_row = [D](const float* row) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (uint64_t b = 0; b < uint64_t{D} * sizeof(float); b += 64) __builtin_prefetch(bytes + b);
  };
  const PastStream::Run* const end = past.runs.data() + past.runs.size();
  size_t j = 0;
  for (const PastStream::Run* run = past.runs.data(); run != end; ++run) {
    const PastStream::Run* next = run + 1 != end ? run + 1 : nullptr;
    for (uint32_t i = 0; i < run->count; ++i, ++j) {
      if (next != nullptr && i < next->count) prefetch_row(next->k + uint64_t{i} * D);
      const bool visible = past.positions.empty() || past.positions[j] <= position;
      const float* k = run->k + uint64_t{i} * D;
      for (uint32_t h = 0; h < heads; ++h) {
        s[h * n + j] = visible ? Dot(qh + uint64_t{h} * D, k, D) * scale : -INFINITY;
      }
    }
  }
  for (uint32_t h = 0; h < heads; ++h) {
    float* row = s + h * n;
    row[n_past] = Dot(qh + uint64_t{h} * D, new_k, D) * scale;
    const float mx = *std::max_element(row, row + n);
    const float inv_z = 1.0f / ExpShiftSum(row, n, mx);
    for (size_t u = 0; u < n; ++u) row[u] *= inv_z;
    std::fill_n(out + uint64_t{head0 + h} * D, D, 0.0f);
  }
  j = 0;
  for (const PastStream::Run* run = past.runs.data(); run != end; ++run) {
    const PastStream::Run* next = run + 1 != end ? run + 1 : nullptr;
    for (uint32_t i = 0; i < run->count; ++i, ++j) {
      if (next != nullptr && i < next->count) prefetch_row(next->v + uint64_t{i} * D);
      const float* v = run->v + uint64_t{i} * D;
      for (uint32_t h = 0; h < heads; ++h) {
        const float w = s[h * n + j];
        if (w != 0) Axpy(w, v, out + uint64_t{head0 + h} * D, D);
      }
    }
  }
  for (uint32_t h = 0; h < heads; ++h) {
    Axpy(s[h * n + n_past], new_v, out + uint64_t{head0 + h} * D, D);
    accumulate(0, s + h * n, n);
  }
}

}  // namespace

void LlamaModel::Apply(const Weight& w, const float* x, uint32_t T, uint32_t in, uint32_t out,
                       float* y) {
  if (T == 1 && w.quant.data != nullptr) {
    QuantMatVec(w.quant, x, y);
    return;
  }
  MatMul(x, w.f32, T, in, out, y);
}

namespace {
absl::StatusOr<LlamaModel::Weight> LoadWeight(const GgufFile& file, const std::string& name,
                                              std::vector<uint64_t> dims);
}  // namespace

std::string BlasCoreTypeOverride() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  const std::string core = openblas_get_corename();
  if (core != "Prescott" && core != "Core2" && core != "Nehalem") return "";
  if (__builtin_cpu_supports("avx512f")) return "SkylakeX";
  if (__builtin_cpu_supports("avx2")) return "Haswell";
  return "";
}

LogitSummary SummarizeLogits(absl::Span<const float> logits, uint32_t top_k) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l - max));
  const double log_z = std::log(z);
  double entropy = 0;
  std::vector<float> probs(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const double lp = (logits[i] - max) - log_z;
    const double p = std::exp(lp);
    probs[i] = static_cast<float>(p);
    if (p > 0) entropy -= p * lp;
  }
  const size_t k = std::min<size_t>(top_k, probs.size());
  std::vector<float> top(probs);
  std::partial_sort(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(k), top.end(),
                    std::greater<float>());
  double mass = 0;
  for (size_t i = 0; i < k; ++i) mass += top[i];
  double topk_entropy = 0;
  for (size_t i = 0; i < k; ++i) {
    const double p = top[i] / mass;
    if (p > 0) topk_entropy -= p * std::log(p);
  }
  return {static_cast<float>(entropy), top[0], k > 1 ? top[1] : 0.0f,
          static_cast<float>(topk_entropy)};
}

namespace {
absl::StatusOr<LlamaModel::Weight> LoadWeight(const GgufFile& file, const std::string& name,
                                              std::vector<uint64_t> dims) {
  LlamaModel::Weight w;
  absl::StatusOr<std::vector<float>> f32 = LoadF32(file, name, dims);
  if (!f32.ok()) return f32.status();
  w.f32 = *std::move(f32);
  const GgufTensor* t = *file.Tensor(name);
  if ((t->type == 3 || t->type == 8) && dims.size() == 2) {
    w.quant = QuantMatrix{t->type, static_cast<uint32_t>(dims[1]), static_cast<uint32_t>(dims[0]),
                          t->data};
  }
  return w;
}
}  // namespace

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const GgufFile& file) {
  // BLAS threads as many as the worker's own (KVMEM_WORKER_THREADS), not OpenBLAS's default
  // of every core: its idle threads spin and fight the daemon for the cores.
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(WorkerThreads());
  absl::StatusOr<std::string> arch = file.GetString("general.architecture");
  if (!arch.ok()) return arch.status();
  if (*arch != "llama") {
    return absl::UnimplementedError(absl::StrCat("model: architecture ", *arch, " (llama only)"));
  }
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  ModelConfig& c = m->config_;
  auto geti = [&](const char* key, uint32_t* out) -> absl::Status {
    absl::StatusOr<int64_t> v = file.GetInt(absl::StrCat("llama.", key));
    if (!v.ok()) return v.status();
    if (*v <= 0 || *v > (1 << 24)) {
      return absl::DataLossError(absl::StrCat("gguf: llama.", key, " = ", *v, " is implausible"));
    }
    *out = static_cast<uint32_t>(*v);
    return absl::OkStatus();
  };
  for (auto [key, out] : std::initializer_list<std::pair<const char*, uint32_t*>>{
           {"block_count", &c.num_layers},
           {"embedding_length", &c.embed},
           {"feed_forward_length", &c.ffn},
           {"attention.head_count", &c.num_heads},
           {"attention.head_count_kv", &c.num_kv_heads},
           {"context_length", &c.context}}) {
    if (absl::Status s = geti(key, out); !s.ok()) return s;
  }
  if (c.embed % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    return absl::DataLossError("gguf: head counts do not divide the embedding");
  }
  c.head_dim = c.embed / c.num_heads;
  if (auto v = file.GetFloat("llama.rope.freq_base"); v.ok()) c.rope_base = static_cast<float>(*v);
  if (auto v = file.GetFloat("llama.attention.layer_norm_rms_epsilon"); v.ok()) {
    c.norm_eps = static_cast<float>(*v);
  }
  absl::StatusOr<const GgufTensor*> embd = file.Tensor("token_embd.weight");
  if (!embd.ok()) return embd.status();
  if ((*embd)->dims.size() != 2 || (*embd)->dims[0] != c.embed) {
    return absl::DataLossError("gguf: token_embd.weight has the wrong shape");
  }
  c.vocab = static_cast<uint32_t>((*embd)->dims[1]);
  absl::StatusOr<Weight> e = LoadWeight(file, "token_embd.weight", {c.embed, c.vocab});
  if (!e.ok()) return e.status();
  m->embedding = *std::move(e);
  absl::StatusOr<std::vector<float>> norm = LoadF32(file, "output_norm.weight", {c.embed});
  if (!norm.ok()) return norm.status();
  m->output_norm = *std::move(norm);
  if (file.Tensor("output.weight").ok()) {
    absl::StatusOr<Weight> out = LoadWeight(file, "output.weight", {c.embed, c.vocab});
    if (!out.ok()) return out.status();
    m->output = *std::move(out);
  }
  const uint32_t kv = c.num_kv_heads * c.head_dim;
  m->layers_.resize(c.num_layers);
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    for (auto [name, dst] :
         {std::pair<const char*, std::vector<float>*>{"attn_norm.weight", &L.attn_norm},
          {"ffn_norm.weight", &L.ffn_norm}}) {
      absl::StatusOr<std::vector<float>> w = LoadF32(file, p + name, {c.embed});
      if (!w.ok()) return w.status();
      *dst = *std::move(w);
    }
    struct Item {
      const char* name;
      Weight* dst;
      std::vector<uint64_t> dims;
    };
    for (const Item& it : std::vector<Item>{{"attn_q.weight", &L.wq, {c.embed, c.embed}},
                                            {"attn_k.weight", &L.wk, {c.embed, kv}},
                                            {"attn_v.weight", &L.wv, {c.embed, kv}},
                                            {"attn_output.weight", &L.wo, {c.embed, c.embed}},
                                            {"ffn_gate.weight", &L.w_gate, {c.embed, c.ffn}},
                                            {"ffn_up.weight", &L.w_up, {c.embed, c.ffn}},
                                            {"ffn_down.weight", &L.w_down, {c.ffn, c.embed}}}) {
      absl::StatusOr<Weight> w = LoadWeight(file, p + it.name, it.dims);
      if (!w.ok()) return w.status();
      *it.dst = *std::move(w);
    }
  }
  return m;
}

absl::StatusOr<ForwardResult> LlamaModel::Forward(absl::Span<const int32_t> tokens,
                                                  absl::Span<const int64_t> positions,
                                                  KvStore& store,
                                                  const ForwardOptions& options) const {
  const ModelConfig& c = config_;
  const uint32_t T = static_cast<uint32_t>(tokens.size());
  if (T == 0 || positions.size() != T) {
    return absl::InvalidArgumentError("forward: tokens and positions must be non-empty and equal");
  }
  for (int32_t t : tokens) {
    if (t < 0 || static_cast<uint32_t>(t) >= c.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: token id ", t, " outside the vocabulary"));
    }
  }
  const uint32_t E = c.embed, D = c.head_dim, H = c.num_heads, HKV = c.num_kv_heads;
  const uint32_t group = H / HKV, KV = HKV * D;
  if (absl::Status s = store.BeginForward(); !s.ok()) return s;

  ForwardResult r;
  r.k.resize(uint64_t{c.num_layers} * HKV * T * D);
  r.v.resize(r.k.size());
  if (options.attention_rows) r.attention_rows.resize(c.num_layers * HKV);
  for (uint32_t w : options.windows) {
    r.window_scores.push_back({w, std::vector<std::vector<float>>(c.num_layers * HKV)});
  }

  std::vector<float> x(uint64_t{T} * E), h(uint64_t{T} * E), q(uint64_t{T} * E),
      k(uint64_t{T} * KV), v(uint64_t{T} * KV), attn(uint64_t{T} * E), o(uint64_t{T} * E),
      gate(uint64_t{T} * c.ffn), up(uint64_t{T} * c.ffn), mid_hidden;
  for (uint32_t t = 0; t < T; ++t) {
    std::copy_n(embedding.f32.data() + uint64_t(tokens[t]) * E, E, x.data() + uint64_t{t} * E);
  }
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  PastStream past;
  std::vector<float> scores;
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[l];
    for (uint32_t t = 0; t < T; ++t) {
      RmsNorm(&x[uint64_t{t} * E], L.attn_norm.data(), E, c.norm_eps, &h[uint64_t{t} * E]);
    }
    Apply(L.wq, h.data(), T, E, E, q.data());
    Apply(L.wk, h.data(), T, E, KV, k.data());
    Apply(L.wv, h.data(), T, E, KV, v.data());
    for (uint32_t t = 0; t < T; ++t) {
      Rope(&q[uint64_t{t} * E], H, D, positions[t], c.rope_base);
      Rope(&k[uint64_t{t} * KV], HKV, D, positions[t], c.rope_base);
    }
    // One KV stream of this layer: its GQA group of query heads over its past and new keys.
    auto attend = [&](uint32_t g, PastStream& past, std::vector<float>& scores) -> absl::Status {
      // New K/V of this stream, [T][D], into the result for the store.
      float* rk = &r.k[(uint64_t{l} * HKV + g) * T * D];
      float* rv = &r.v[(uint64_t{l} * HKV + g) * T * D];
      for (uint32_t t = 0; t < T; ++t) {
        std::copy_n(&k[uint64_t{t} * KV + g * D], D, rk + uint64_t{t} * D);
        std::copy_n(&v[uint64_t{t} * KV + g * D], D, rv + uint64_t{t} * D);
      }
      if (absl::Status s = store.Past(l, g, &past); !s.ok()) return s;
      const size_t n_past = past.slots();
      if (!past.positions.empty() && past.positions.size() != n_past) {
        return absl::InternalError("forward: a past stream's positions do not match its slots");
      }
      const size_t n = n_past + T;
      std::vector<float>* row_out =
          options.attention_rows ? &r.attention_rows[l * HKV + g] : nullptr;
      if (row_out) row_out->assign(n, 0.0f);
      for (WindowScores& ws : r.window_scores) ws.streams[l * HKV + g].assign(n, 0.0f);
      // Signals from query t's attention weights p[0, valid) (zero beyond), GQA-group mean.
      const float inv_group = 1.0f / static_cast<float>(group);
      auto accumulate = [&](uint32_t t, const float* p, size_t valid) {
        if (row_out && t + 1 == T) Axpy(inv_group, p, row_out->data(), valid);
        for (WindowScores& ws : r.window_scores) {
          if (uint64_t{t} + ws.window < T) continue;
          Axpy(inv_group, p, ws.streams[l * HKV + g].data(), valid);
        }
      };
      bool past_before_new = true;
      for (int64_t pos : past.positions) past_before_new &= pos < positions[0];
      if (T >= kBlockedMinTokens && past_before_new) {
        BlockedAttention(q.data(), E, g * group, group, T, past, rk, rv, D, inv_sqrt_d, attn.data(),
                         accumulate);
        return absl::OkStatus();
      }
      if (T == 1) {
        DecodeAttention(q.data(), g * group, group, past, positions[0], rk, rv, D, inv_sqrt_d,
                        attn.data(), &scores, accumulate);
        return absl::OkStatus();
      }
      scores.resize(n);
      for (uint32_t hh = 0; hh < group; ++hh) {
        const uint32_t head = g * group + hh;
        for (uint32_t t = 0; t < T; ++t) {
          const float* qt = &q[uint64_t{t} * E + head * D];
          // Scores over the past (causal by original position), then the new tokens <= t.
          size_t j = 0;
          for (const PastStream::Run& run : past.runs) {
            for (uint32_t i = 0; i < run.count; ++i, ++j) {
              scores[j] = past.positions.empty() || past.positions[j] <= positions[t]
                              ? Dot(qt, run.k + uint64_t{i} * D, D) * inv_sqrt_d
                              : -INFINITY;
            }
          }
          for (uint32_t u = 0; u < T; ++u) {
            scores[n_past + u] = u <= t ? Dot(qt, rk + uint64_t{u} * D, D) * inv_sqrt_d : -INFINITY;
          }
          const float mx = *std::max_element(scores.begin(), scores.end());
          const float inv_z = 1.0f / ExpShiftSum(scores.data(), n, mx);
          for (float& s : scores) s *= inv_z;
          float* out = &attn[uint64_t{t} * E + head * D];
          std::fill_n(out, D, 0.0f);
          j = 0;
          for (const PastStream::Run& run : past.runs) {
            for (uint32_t i = 0; i < run.count; ++i, ++j) {
              if (scores[j] == 0) continue;
              Axpy(scores[j], run.v + uint64_t{i} * D, out, D);
            }
          }
          for (uint32_t u = 0; u <= t; ++u) Axpy(scores[n_past + u], rv + uint64_t{u} * D, out, D);
          accumulate(t, scores.data(), n);
        }
      }
      return absl::OkStatus();
    };
    // A decode step's streams attend on the worker's threads (each stream's arithmetic is
    // its own, so the result does not depend on the split); a prompt's attend one by one
    // (BlockedAttention's products have OpenBLAS's threads).
    const int threads = T == 1 ? std::min<int>(WorkerThreads(), static_cast<int>(HKV)) : 1;
    if (threads > 1) {
      std::vector<absl::Status> status(HKV);
#pragma omp parallel num_threads(threads)
      {
        PastStream own_past;
        std::vector<float> own_scores;
#pragma omp for schedule(static, 1)
        for (int g = 0; g < static_cast<int>(HKV); ++g) {
          try {  // nothing may leave an OpenMP region by an exception
            status[g] = attend(g, own_past, own_scores);
          } catch (const std::bad_alloc&) {
            status[g] = absl::ResourceExhaustedError("forward: out of memory in decode attention");
          }
        }
      }
      for (const absl::Status& s : status) {
        if (!s.ok()) return s;
      }
    } else {
      for (uint32_t g = 0; g < HKV; ++g) {
        if (absl::Status s = attend(g, past, scores); !s.ok()) return s;
      }
    }
    Apply(L.wo, attn.data(), T, E, E, o.data());
    for (uint64_t i = 0; i < x.size(); ++i) x[i] += o[i];
    for (uint32_t t = 0; t < T; ++t) {
      RmsNorm(&x[uint64_t{t} * E], L.ffn_norm.data(), E, c.norm_eps, &h[uint64_t{t} * E]);
    }
    Apply(L.w_gate, h.data(), T, E, c.ffn, gate.data());
    Apply(L.w_up, h.data(), T, E, c.ffn, up.data());
    for (uint64_t i = 0; i < gate.size(); ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
    Apply(L.w_down, gate.data(), T, c.ffn, E, o.data());
    for (uint64_t i = 0; i < x.size(); ++i) x[i] += o[i];
    if (options.layer_distance && l + 1 == c.num_layers / 2) mid_hidden = x;
  }
  if (absl::Status s = store.EndForward(); !s.ok()) return s;
  if (options.layer_distance) {
    // 1 - cos(h after layer L/2, h after the last layer, before the final norm).
    r.layer_distance.resize(T);
    for (uint32_t t = 0; t < T; ++t) {
      double dot = 0, a2 = 0, b2 = 0;
      for (uint32_t i = 0; i < E; ++i) {
        const double a = mid_hidden[uint64_t{t} * E + i], b = x[uint64_t{t} * E + i];
        dot += a * b;
        a2 += a * a;
        b2 += b * b;
      }
      const double cos = (a2 > 0 && b2 > 0) ? dot / std::sqrt(a2 * b2) : 1.0;
      r.layer_distance[t] = static_cast<float>(std::clamp(1.0 - cos, 0.0, 2.0));
    }
  }
  // One token's statistics come from its logits below (the same rows, the same arithmetic).
  const bool stats_from_logits = options.next_token_stats && T == 1;
  if (options.next_token_stats && !stats_from_logits) {
    // Row by row in chunks, so that a long prompt never holds T x vocab logits at once.
    constexpr uint32_t kChunk = 32;
    std::vector<float> chunk_logits(uint64_t{kChunk} * c.vocab);
    r.next_token_stats.resize(T);
    for (uint32_t t0 = 0; t0 < T; t0 += kChunk) {
      const uint32_t rows = std::min(kChunk, T - t0);
      for (uint32_t t = 0; t < rows; ++t) {
        RmsNorm(&x[uint64_t{t0 + t} * E], output_norm.data(), E, c.norm_eps, &h[uint64_t{t} * E]);
      }
      Apply(output.f32.empty() ? embedding : output, h.data(), rows, E, c.vocab,
            chunk_logits.data());
      for (uint32_t t = 0; t < rows; ++t) {
        r.next_token_stats[t0 + t] = SummarizeLogits(
            absl::MakeConstSpan(chunk_logits.data() + uint64_t{t} * c.vocab, c.vocab));
      }
    }
  }
  const uint32_t first = options.all_logits ? 0 : T - 1;
  const uint32_t rows = T - first;
  for (uint32_t t = first; t < T; ++t) {
    RmsNorm(&x[uint64_t{t} * E], output_norm.data(), E, c.norm_eps, &h[uint64_t{t - first} * E]);
  }
  r.logits.resize(uint64_t{rows} * c.vocab);
  Apply(output.f32.empty() ? embedding : output, h.data(), rows, E, c.vocab, r.logits.data());
  if (stats_from_logits) r.next_token_stats = {SummarizeLogits(r.logits)};
  return r;
}

}  // namespace kvmem::worker
