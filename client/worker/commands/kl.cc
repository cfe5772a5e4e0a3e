// kvmem_worker kl: confidence against KL. Teacher-forced over --text with the in-process
// cache; at every step after --kl_warmup tokens, the next-token distribution with the full
// cache (p) and with the last --kl_drop tokens dropped (q), or, with --kl_keep_recent R, the
// --kl_drop tokens before the newest R. Prints "step entropy p1 p2 kl" per line.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/flags/flag.h"
#include "commands/commands.h"
#include "dropping_kv_store.h"

ABSL_FLAG(uint32_t, kl_warmup, 512, "kl: tokens before the first measured step");
ABSL_FLAG(uint32_t, kl_drop, 256, "kl: newest tokens dropped for the second distribution");
ABSL_FLAG(uint32_t, kl_keep_recent, 0,
          "kl: keep this many newest tokens and drop the --kl_drop before them instead");

namespace kvmem::worker {

int RunKlStudy() {
  Env env;
  if (absl::Status s = Setup(env, true); !s.ok()) return Fail("setup", s);
  absl::StatusOr<std::vector<int32_t>> text = TextTokens(*env.tokenizer);
  if (!text.ok()) return Fail("--text", text.status());
  std::vector<int32_t> ids = *std::move(text);
  const uint32_t warmup = absl::GetFlag(FLAGS_kl_warmup), drop = absl::GetFlag(FLAGS_kl_drop);
  const int64_t keep = absl::GetFlag(FLAGS_kl_keep_recent);
  const uint32_t steps = absl::GetFlag(FLAGS_max_eval_tokens);
  if (ids.size() < warmup + steps) {
    return Fail("--text", absl::InvalidArgumentError("text shorter than warmup + steps"));
  }
  const ModelConfig& c = env.model->config();
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < warmup + steps; ++i) {
    const int64_t pos = i;
    const std::vector<int32_t> token = {ids[i]};
    if (i >= warmup) {
      DroppingKvStore dropped(*env.local, pos - keep - drop, pos - keep, c.head_dim);
      absl::StatusOr<ForwardResult> q = env.model->Forward(token, {pos}, dropped, {});
      if (!q.ok()) return Fail("forward", q.status());
      absl::StatusOr<ForwardResult> p = env.model->Forward(token, {pos}, *env.local, {});
      if (!p.ok()) return Fail("forward", p.status());
      env.local->Append(std::vector<int64_t>{pos}, *p);
      // KL(p || q) over the full vocabulary, in nats.
      auto log_softmax = [](const std::vector<float>& l) {
        const float mx = *std::max_element(l.begin(), l.end());
        double z = 0;
        for (float x : l) z += std::exp(static_cast<double>(x - mx));
        std::vector<double> out(l.size());
        for (size_t k = 0; k < l.size(); ++k) out[k] = (l[k] - mx) - std::log(z);
        return out;
      };
      const std::vector<double> lp = log_softmax(p->logits), lq = log_softmax(q->logits);
      double kl = 0;
      for (size_t k = 0; k < lp.size(); ++k) kl += std::exp(lp[k]) * (lp[k] - lq[k]);
      const LogitSummary s = SummarizeLogits(p->logits);
      std::printf("%u %.6f %.6f %.6f %.6f\n", i - warmup, s.entropy, s.p1, s.p2, kl);
    } else {
      absl::StatusOr<ForwardResult> p = env.model->Forward(token, {pos}, *env.local, {});
      if (!p.ok()) return Fail("forward", p.status());
      env.local->Append(std::vector<int64_t>{pos}, *p);
    }
    if ((i + 1) % 32 == 0) {
      const double el =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "\r%u/%u tokens, ETA %.0fs   ", i + 1, warmup + steps,
                   el / (i + 1) * (warmup + steps - i - 1));
    }
  }
  std::fprintf(stderr, "\n");
  return 0;
}

}  // namespace kvmem::worker
