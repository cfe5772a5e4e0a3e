// kvmem_worker perplexity: teacher-forced over --text, one token a step (after an optional
// --prefill_tokens prompt), with the cache in kvmemd under --policy or in process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/flags/flag.h"
#include "commands/commands.h"

ABSL_FLAG(uint32_t, prefill_tokens, 0,
          "perplexity: feed the first N tokens as one prompt (prefill + Compress), then score "
          "the rest token by token");

namespace kvmem::worker {

int RunPerplexity() {
  Env env;
  if (absl::Status s = Setup(env, false); !s.ok()) return Fail("setup", s);
  absl::StatusOr<std::vector<int32_t>> text = TextTokens(*env.tokenizer);
  if (!text.ok()) return Fail("--text", text.status());
  std::vector<int32_t> ids = *std::move(text);
  const uint32_t limit = absl::GetFlag(FLAGS_max_eval_tokens);
  if (limit > 0 && ids.size() > limit + 1) ids.resize(limit + 1);
  if (ids.size() < 2) return Fail("--text", absl::InvalidArgumentError("fewer than 2 tokens"));
  const size_t prefix = absl::GetFlag(FLAGS_prefill_tokens);
  if (prefix + 1 >= ids.size()) {
    return Fail("--prefill_tokens", absl::InvalidArgumentError("must leave tokens to score"));
  }
  Session session(*env.model, *env.store, env.daemon.get(), SessionOptionsFromFlags());
  double nll = 0;
  size_t n = 0;  // tokens scored
  auto score = [&](const std::vector<float>& logits, int32_t next) {
    const float mx = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (float l : logits) z += std::exp(l - mx);
    nll -= (logits[next] - mx) - std::log(z);
    ++n;
  };
  const auto t0 = std::chrono::steady_clock::now();
  if (prefix > 0) {
    absl::StatusOr<std::vector<float>> logits =
        session.Feed(std::vector<int32_t>(ids.begin(), ids.begin() + prefix), true);
    if (!logits.ok()) return Fail("prefill", logits.status());
    score(*logits, ids[prefix]);
  }
  const size_t first = prefix > 0 ? prefix : 0;
  for (size_t i = first; i + 1 < ids.size(); ++i) {
    absl::StatusOr<std::vector<float>> logits = session.Feed({ids[i]}, false);
    if (!logits.ok()) return Fail("step", logits.status());
    score(*logits, ids[i + 1]);
    if ((i + 1) % 16 == 0 || i + 2 == ids.size()) {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double eta = elapsed / (i + 1 - first) * (ids.size() - 2 - i);
      std::fprintf(stderr, "\r%zu/%zu tokens, ppl %.3f, ETA %.0fs   ", i + 1, ids.size() - 1,
                   std::exp(nll / n), eta);
    }
  }
  std::fprintf(stderr, "\n");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "perplexity %.4f over %zu tokens (policy %s, KV bytes at end %llu, mean %.0f, "
      "%llu evicted, %.1f tokens/s)\n",
      std::exp(nll / n), n, env.daemon ? absl::GetFlag(FLAGS_policy).c_str() : "local",
      static_cast<unsigned long long>(session.kv_bytes()), session.mean_kv_bytes(),
      static_cast<unsigned long long>(session.evicted()), n / seconds);
  return 0;
}

}  // namespace kvmem::worker
