// kvmem_worker quanterr: relative error of int8 / int4 / nf4 on this model's real K and V.
// The first --max_eval_tokens tokens of --text go through the model (in process); every full
// block of 16 tokens of every stream is quantized and dequantized with the kernels'
// reference (kernels/quantize.h). Prints "type k_error v_error" with
// error = ||x - x_hat|| / ||x|| over all blocks (K after RoPE).
#include <cmath>
#include <cstdio>
#include <numeric>
#include <utility>

#include "absl/flags/flag.h"
#include "commands/commands.h"
#include "kernels/quantize.h"

namespace kvmem::worker {

int RunQuantError() {
  Env env;
  if (absl::Status s = Setup(env, true); !s.ok()) return Fail("setup", s);
  absl::StatusOr<std::vector<int32_t>> text = TextTokens(*env.tokenizer);
  if (!text.ok()) return Fail("--text", text.status());
  std::vector<int32_t> ids = *std::move(text);
  const uint32_t limit = absl::GetFlag(FLAGS_max_eval_tokens);
  if (limit > 0 && ids.size() > limit) ids.resize(limit);
  constexpr uint32_t kBlock = 16;
  if (ids.size() < kBlock) return Fail("--text", absl::InvalidArgumentError("under 16 tokens"));
  std::vector<int64_t> positions(ids.size());
  std::iota(positions.begin(), positions.end(), 0);
  absl::StatusOr<ForwardResult> r = env.model->Forward(ids, positions, *env.local, {});
  if (!r.ok()) return Fail("forward", r.status());
  const ModelConfig& c = env.model->config();
  const uint32_t D = c.head_dim, T = static_cast<uint32_t>(ids.size());
  for (auto [type, name] :
       {std::pair{kernels::QuantType::kInt8, "int8"}, std::pair{kernels::QuantType::kInt4, "int4"},
        std::pair{kernels::QuantType::kNF4, "nf4"}}) {
    const kernels::QuantGeometry g{type, kBlock, D};
    std::vector<uint8_t> codes(g.codes_bytes());
    std::vector<float> scales(g.scale_floats()), out(uint64_t{kBlock} * D);
    double err[2] = {0, 0}, norm[2] = {0, 0};
    for (int plane = 0; plane < 2; ++plane) {
      const std::vector<float>& x = plane == 0 ? r->k : r->v;
      for (uint32_t s = 0; s < c.num_layers * c.num_kv_heads; ++s) {
        for (uint32_t t0 = 0; t0 + kBlock <= T; t0 += kBlock) {
          const float* src = x.data() + (uint64_t{s} * T + t0) * D;
          kernels::QuantizePlaneRef(src, kernels::ElemType::kF32, g, 0, kBlock, codes.data(),
                                    scales.data());
          kernels::DequantizePlaneRef(codes.data(), scales.data(), g, 0, kBlock,
                                      kernels::ElemType::kF32, out.data());
          for (uint32_t i = 0; i < kBlock * D; ++i) {
            err[plane] += double(src[i] - out[i]) * (src[i] - out[i]);
            norm[plane] += double(src[i]) * src[i];
          }
        }
      }
    }
    std::printf("%s %.6f %.6f\n", name, std::sqrt(err[0] / norm[0]), std::sqrt(err[1] / norm[1]));
  }
  return 0;
}

}  // namespace kvmem::worker
