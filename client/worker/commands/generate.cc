// kvmem_worker generate: a chat answer, decoded token by token with the cache in kvmemd (one
// StepBatch per token) or in process; prints the answer, then speeds and KV bytes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

#include "absl/flags/flag.h"
#include "commands/commands.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(double, temperature, 0, "0 = greedy");
ABSL_FLAG(uint32_t, seed, 1, "sampling seed");
ABSL_FLAG(uint32_t, max_prompt_tokens, 0, "generate: cut the prompt to this many tokens");
ABSL_FLAG(bool, prefix_cache, false,
          "generate: create the sequence with the prompt's token ids (its published prefix is "
          "mapped and not computed again) and publish its blocks as they fill; policies that "
          "do not compress the prompt only (with --prefill_chunk=16 a request that reuses a "
          "prefix gives the cold request's logits to the bit)");
ABSL_FLAG(bool, pull_prefix, false,
          "generate, with --prefix_cache: first ask kvmemd to pull the longest prefix of the "
          "prompt another node of its fleet holds (PullPrefix; kvmemd --cluster-index), timed "
          "as part of the first token");
ABSL_FLAG(uint64_t, pull_min_tokens, 0,
          "with --pull_prefix: pull only when another node holds at least this many more "
          "tokens of the prompt (fewer are computed: cheaper; bench/RESULTS.md has the "
          "crossover for this model)");
ABSL_FLAG(std::string, pull_transport, "",
          "with --pull_prefix: how kvmemd fetches the prefix from the other node: attach "
          "(its pool mapped: the same host), ucx, grpc, or empty (the first that can)");
ABSL_FLAG(std::string, kept_positions, "",
          "generate: write to this file, after the prompt and after each decode step, a JSON "
          "line with the token fed (-1 for the prompt, whose ids it lists) and the positions "
          "kvmemd keeps in every stream (layer-major): what the transformers cache's parity "
          "test compares against");

namespace kvmem::worker {
namespace {

// One line of --kept_positions: the sequence's retained positions per stream, as the daemon
// has them now (GetBlockTable).
absl::Status WriteKept(const Env& env, int32_t token, const std::vector<int32_t>* ids,
                       std::ofstream& out) {
  absl::StatusOr<client::BlockTable> table =
      env.client->GetBlockTable(env.daemon->sequence_id(), /*positions=*/true);
  if (!table.ok()) return table.status();
  nlohmann::ordered_json line;
  line["token"] = token;
  if (ids != nullptr) line["ids"] = *ids;
  nlohmann::ordered_json kept = nlohmann::ordered_json::array();
  for (const client::StreamTable& st : table->streams) kept.push_back(st.positions);
  line["kept"] = std::move(kept);
  out << line.dump() << "\n";
  out.flush();
  return out ? absl::OkStatus() : absl::DataLossError("--kept_positions: write failed");
}

int32_t Pick(const std::vector<float>& logits, double temperature, std::mt19937& rng) {
  if (temperature <= 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> w(logits.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::exp((logits[i] - mx) / temperature);
  std::discrete_distribution<int32_t> d(w.begin(), w.end());
  return d(rng);
}

}  // namespace

int RunGenerate() {
  Env env;
  if (absl::Status s = Setup(env, false); !s.ok()) return Fail("setup", s);
  const std::string prompt =
      (absl::GetFlag(FLAGS_raw) ? PromptText() : env.tokenizer->ChatPrompt(PromptText())) +
      absl::GetFlag(FLAGS_answer_prefix);
  std::vector<int32_t> ids = env.tokenizer->Encode(prompt, true);
  const uint32_t max_prompt = absl::GetFlag(FLAGS_max_prompt_tokens);
  if (max_prompt > 0 && ids.size() > max_prompt) ids.resize(max_prompt);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t reused = 0;
  if (absl::GetFlag(FLAGS_prefix_cache)) {
    absl::StatusOr<client::PolicySpec> policy = PolicyFromFlags();
    if (!policy.ok()) return Fail("setup", policy.status());
    if (env.daemon == nullptr || policy->name.value_or("full") != "full" ||
        policy->quantization != client::Precision::kLayout) {
      return Fail("setup", absl::InvalidArgumentError(
                               "--prefix_cache: needs kvmemd and a policy that keeps the prompt "
                               "as it is (full, layout precision)"));
    }
    // The sequence again, created with the prompt (timed: it is part of the first token).
    env.store = nullptr;
    env.daemon.reset();
    client::Prompt prompt{ids, "", "smollm2-135m", /*auto_publish=*/true};
    if (absl::GetFlag(FLAGS_pull_prefix)) {
      absl::StatusOr<client::Pulled> pulled = env.client->PullPrefix(
          KvmemKvStore::LayoutOf(env.model->config()), prompt,
          {"", absl::GetFlag(FLAGS_pull_transport), absl::GetFlag(FLAGS_pull_min_tokens)});
      // A failed pull costs the prefix's compute, not the request.
      if (pulled.ok()) {
        std::fprintf(stderr,
                     "pulled %llu prompt tokens from the fleet (%s; held here %llu, by %s %llu)\n",
                     static_cast<unsigned long long>(pulled->pulled_tokens),
                     pulled->transport.empty() ? "nothing read" : pulled->transport.c_str(),
                     static_cast<unsigned long long>(pulled->local_tokens),
                     pulled->from_node.empty() ? "no other node" : pulled->from_node.c_str(),
                     static_cast<unsigned long long>(pulled->holder_tokens));
      } else {
        std::fprintf(stderr, "no pull (%s): the prompt is computed\n",
                     pulled.status().ToString().c_str());
      }
    }
    absl::StatusOr<client::KvTransport> transport = TransportFromFlags();
    if (!transport.ok()) return Fail("setup", transport.status());
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> d = KvmemKvStore::Create(
        env.client.get(), env.model->config(), *policy, *transport, &prompt, InPlaceFromFlags());
    if (!d.ok()) return Fail("setup", d.status());
    env.daemon = *std::move(d);
    env.store = env.daemon.get();
    reused = env.daemon->reused_tokens();
  }
  if (env.daemon != nullptr) {
    std::fprintf(stderr, "kv transport: %s\n", env.daemon->path().reason().c_str());
  }
  Session session(*env.model, *env.store, env.daemon.get(), SessionOptionsFromFlags());
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  session.SkipMapped(static_cast<int64_t>(reused));
  // Keeps answering when kvmemd goes away mid-request (FallbackSession).
  FallbackSession feeder(
      *env.model, &session, SessionOptionsFromFlags(),
      std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(reused)));
  absl::StatusOr<std::vector<float>> logits = feeder.Feed(
      std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(reused), ids.end()), true);
  if (!logits.ok()) return Fail("prefill", logits.status());
  std::ofstream kept;
  if (!absl::GetFlag(FLAGS_kept_positions).empty()) {
    if (env.daemon == nullptr) {
      return Fail("setup", absl::InvalidArgumentError("--kept_positions: needs --cache=kvmemd"));
    }
    kept.open(absl::GetFlag(FLAGS_kept_positions));
    if (absl::Status s = WriteKept(env, -1, &ids, kept); !s.ok()) return Fail("prefill", s);
  }
  const auto t1 = std::chrono::steady_clock::now();
  // Marks for scripts that sample the daemon while the worker decodes (eval.py speed).
  std::fprintf(stderr, "prefill done\n");
  std::string answer;
  uint32_t generated = 0;
  for (; generated < absl::GetFlag(FLAGS_max_tokens); ++generated) {
    const int32_t next = Pick(*logits, absl::GetFlag(FLAGS_temperature), rng);
    if (next == env.tokenizer->eos() || next == env.tokenizer->im_end()) break;
    answer += env.tokenizer->Decode(next);
    std::fprintf(stderr, "\r%u/%u tokens", generated + 1, absl::GetFlag(FLAGS_max_tokens));
    logits = feeder.Feed({next}, false);
    if (!logits.ok()) return Fail("decode", logits.status());
    if (kept.is_open() && feeder.fell_back().ok()) {
      if (absl::Status s = WriteKept(env, next, nullptr, kept); !s.ok()) return Fail("decode", s);
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "\ndecode done\n");
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("%s\n", answer.c_str());
  if (!feeder.fell_back().ok()) {
    std::printf("kvmemd: %s; the answer was finished with an in-process cache\n",
                feeder.fell_back().ToString().c_str());
  }
  std::printf("---\nprompt %zu tokens, %.1f tokens/s prefill; %u generated, %.1f tokens/s decode\n",
              ids.size(), ids.size() / prefill_s, generated,
              generated > 0 ? generated / decode_s : 0.0);
  if (absl::GetFlag(FLAGS_prefix_cache)) {
    std::printf("prefix cache: %llu of %zu prompt tokens reused; first token after %.1f ms\n",
                static_cast<unsigned long long>(reused), ids.size(), 1000 * prefill_s);
  }
  if (env.daemon != nullptr && feeder.fell_back().ok()) {
    const uint64_t full = FullCacheBytes(env.model->config(), session.tokens(), 4);
    std::printf(
        "kvmemd (%s): %llu KV bytes held for %lld tokens; full cache %llu (%.1f%% saved); "
        "%.1f tokens evicted per stream (%llu stream slots)\n",
        absl::GetFlag(FLAGS_policy).c_str(), static_cast<unsigned long long>(session.kv_bytes()),
        static_cast<long long>(session.tokens()), static_cast<unsigned long long>(full),
        100.0 * (1.0 - double(session.kv_bytes()) / double(full)),
        double(session.evicted()) /
            (env.model->config().num_layers * env.model->config().num_kv_heads),
        static_cast<unsigned long long>(session.evicted()));
    std::vector<double> by_step = session.daemon_ms_by_step();
    const double first = by_step.empty() ? 0.0 : by_step.front();
    const auto slowest = std::max_element(by_step.begin(), by_step.end());
    const double slowest_ms = slowest == by_step.end() ? 0.0 : *slowest;
    const size_t slowest_step =  // 1-based; 0 when no step ran
        slowest == by_step.end() ? 0 : static_cast<size_t>(slowest - by_step.begin()) + 1;
    std::sort(by_step.begin(), by_step.end());
    const size_t half = by_step.size() / 2;
    const double median = by_step.empty()      ? 0.0
                          : by_step.size() % 2 ? by_step[half]
                                               : (by_step[half - 1] + by_step[half]) / 2;
    std::printf(
        "daemon calls: %.2f ms per decode step, median %.2f, first %.2f, slowest %.2f (step %zu) "
        "(StepBatch %s, K/V reads by %s)\n",
        session.daemon_ms_per_step(), median, first, slowest_ms, slowest_step,
        env.client->step_channel_batches() > 0 ? "over the step channel" : "over gRPC",
        std::string(client::KvTransportName(env.daemon->path().reads())).c_str());
  }
  return 0;
}

}  // namespace kvmem::worker
