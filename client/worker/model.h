#pragma once
// LlamaModel: the Llama architecture (RMSNorm, RoPE, grouped-query attention, SwiGLU) on the
// CPU, weights from a GGUF file dequantized to f32 once, matrix work through OpenBLAS.
//
// The model does not own a cache. Forward() attends over the past K/V a KvStore supplies
// (in the store's order, with the tokens' original positions) plus the new tokens, and
// hands the new tokens' K/V back for the store to append. It also computes the signals
// kvmemd's policies use.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gguf.h"
#include "quant_matvec.h"

namespace kvmem::worker {

struct ModelConfig {
  uint32_t num_layers = 0;
  uint32_t embed = 0;
  uint32_t ffn = 0;
  uint32_t num_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t vocab = 0;
  uint32_t context = 0;
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;
};

// Past K/V of one stream (layer, kv head) as contiguous runs of f32 rows [count][head_dim],
// in cache order. Runs point into the store's memory (zero copy) or into `scratch`.
struct PastStream {
  struct Run {
    const float* k;
    const float* v;
    uint32_t count;
  };
  std::vector<Run> runs;
  // One per slot, across the runs in order; empty when the store does not keep them, which
  // says that every past slot precedes the new tokens (a cache appended in position order).
  std::vector<int64_t> positions;
  std::vector<float> scratch;

  uint64_t slots() const {
    uint64_t n = 0;
    for (const Run& run : runs) n += run.count;
    return n;
  }
};

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Called once per Forward before any Past(): fetch what the store needs (block table).
  virtual absl::Status BeginForward() = 0;
  // Between BeginForward and EndForward; called from several threads at once for different
  // streams (a decode step's streams attend in parallel), so it changes nothing shared.
  virtual absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) = 0;
  // Called after Forward() computed everything it reads.
  virtual absl::Status EndForward() { return absl::OkStatus(); }
};

// Logit statistics of one distribution: full-vocabulary entropy (nats), p1, p2, and the
// entropy of the top-k renormalized (k = 256 for token entropy).
struct LogitSummary {
  float entropy, p1, p2, topk_entropy;
};
struct ForwardOptions {
  bool all_logits = false;  // logits for every token (else only the last)
  // Window scores over the last w queries for each w here (w >= T: every query).
  std::vector<uint32_t> windows;
  bool attention_rows = false;    // the last query's attention over past + new keys
  bool layer_distance = false;    // 1 - cos(h_mid, h_last) per token
  bool next_token_stats = false;  // LogitSummary of every token's next-token distribution
};

// Per stream (l * H_kv + h), over past slots then new tokens: the column sums of the last
// `window` queries' attention (GQA-group mean).
struct WindowScores {
  uint32_t window;
  std::vector<std::vector<float>> streams;
};

struct ForwardResult {
  std::vector<float> logits;  // [T or 1][vocab]
  // New tokens' K and V, [L][H_kv][T][D] (K after RoPE): what the store appends.
  std::vector<float> k;
  std::vector<float> v;
  // Per stream (l * H_kv + h), over past slots then new tokens, GQA-group mean.
  std::vector<std::vector<float>> attention_rows;
  std::vector<WindowScores> window_scores;     // one per ForwardOptions::windows
  std::vector<float> layer_distance;           // [T]
  std::vector<LogitSummary> next_token_stats;  // [T]
};

class LlamaModel {
 public:
  // A weight both as f32 (prefill: matrix-matrix through BLAS) and, when GGUF stores it
  // quantized, as its raw blocks (decode: matrix-vector reading 0.6-1.1 bytes per weight).
  struct Weight {
    std::vector<float> f32;  // [out][in]
    QuantMatrix quant;       // data == nullptr when not quantized
  };

  // `file` must outlive the model: decode reads quantized weights where they lie.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const GgufFile& file);
  const ModelConfig& config() const { return config_; }

  absl::StatusOr<ForwardResult> Forward(absl::Span<const int32_t> tokens,
                                        absl::Span<const int64_t> positions, KvStore& store,
                                        const ForwardOptions& options) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    Weight wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  // y[T][out] = x[T][in] W^T.
  static void Apply(const Weight& w, const float* x, uint32_t T, uint32_t in, uint32_t out,
                    float* y);
  LlamaModel() = default;
  ModelConfig config_;
  Weight embedding;  // [vocab][embed], also the output projection when tied
  std::vector<float> output_norm;
  Weight output;  // empty when tied to the embedding
  std::vector<Layer> layers_;
};

// OpenBLAS (Debian's dynamic-arch build) picks its kernels from the CPU model at load time
// and falls back to generic SSE3 ("Prescott") kernels on models it does not know, at half
// the speed or less. Returns the core type to force through OPENBLAS_CORETYPE (read only
// at load, so the process must re-execute itself) when that happened on a CPU with AVX2 or
// AVX-512, else an empty string.
std::string BlasCoreTypeOverride();

LogitSummary SummarizeLogits(absl::Span<const float> logits, uint32_t top_k = 256);

}  // namespace kvmem::worker
