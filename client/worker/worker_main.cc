// kvmem_worker: SmolLM2 (or any Llama-family GGUF) on the CPU with its KV cache in kvmemd.
//
//   kvmem_worker generate   --model M --prompt "..." [--policy confkv] [--target ADDR]
//   kvmem_worker perplexity --model M --text FILE [--policy window --param window=512]
//   kvmem_worker dump       --model M --prompt "..."   (JSON: ids and full-cache logits)
//   kvmem_worker kl         --model M --text FILE     (confidence inputs and KL per step)
//   kvmem_worker quanterr   --model M --text FILE     (int8/int4/nf4 error on real K/V)
//   kvmem_worker multi      --model M --prompt_file F --policies "full;h2o,budget=256"
//   kvmem_worker docqa      --model M --text DOC --questions_file Q --doc_mode document
//                           (questions over one document, all sequences held at once:
//                           time to first token, answers, pool bytes; see DocQa)
//                           (one prefill, then per policy: compress, answer, KV bytes; the
//                           answers decode side by side, one StepBatch per token)
//
// --cache=kvmemd (default) keeps the cache in the daemon; --cache=local keeps it in process.
// Through kvmemd every generated token is one StepBatch (the token and the step's signals;
// --attention_f16 sends attention rows as halves), plus ReadKv with --read_path=grpc.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/quantize.h"
#include "kv_stores.h"
#include "model.h"
#include "session.h"
#include "tokenizer.h"

ABSL_FLAG(std::string, model, "", "path to the GGUF file (scripts/fetch_model.sh prints it)");
ABSL_FLAG(std::string, target, "127.0.0.1:50551", "kvmemd address");
ABSL_FLAG(std::string, cache, "kvmemd", "kvmemd or local");
ABSL_FLAG(std::string, read_path, "shm", "shm (same-host, in place) or grpc (ReadKv)");
ABSL_FLAG(std::string, policy, "confkv", "kvmemd policy");
ABSL_FLAG(std::vector<std::string>, param, {},
          "policy parameters, comma-separated name=value pairs (one --param flag)");
ABSL_FLAG(std::string, quantization, "none", "none, int8, int4, nf4");
ABSL_FLAG(uint32_t, quant_recent, 0, "tokens kept unquantized at the end of each stream (0 = 128)");
ABSL_FLAG(std::string, prompt, "", "user message (generate, dump)");
ABSL_FLAG(bool, raw, false, "use the prompt as is, without the chat template");
ABSL_FLAG(uint32_t, max_tokens, 64, "tokens to generate");
ABSL_FLAG(double, temperature, 0, "0 = greedy");
ABSL_FLAG(uint32_t, seed, 1, "sampling seed");
ABSL_FLAG(std::string, text, "", "text file (perplexity)");
ABSL_FLAG(uint32_t, max_eval_tokens, 0, "perplexity: stop after this many tokens (0 = all)");
ABSL_FLAG(uint32_t, window, 32, "observation window for prefill window scores");
ABSL_FLAG(bool, ids_only, false, "dump: token ids only, no forward pass");
ABSL_FLAG(uint32_t, kl_warmup, 512, "kl: tokens before the first measured step");
ABSL_FLAG(uint32_t, kl_drop, 256, "kl: newest tokens dropped for the second distribution");
ABSL_FLAG(uint32_t, kl_keep_recent, 0,
          "kl: keep this many newest tokens and drop the --kl_drop before them instead");
ABSL_FLAG(std::string, prompt_file, "", "read the prompt from this file instead of --prompt");
ABSL_FLAG(uint32_t, max_prompt_tokens, 0, "generate: cut the prompt to this many tokens");
ABSL_FLAG(bool, prefix_cache, false,
          "generate: create the sequence with the prompt's token ids (its published prefix is "
          "mapped and not computed again) and publish its blocks as they fill; policies that "
          "do not compress the prompt only (with --prefill_chunk=16 a request that reuses a "
          "prefix gives the cold request's logits to the bit)");
ABSL_FLAG(std::string, policies, "",
          "multi: ';'-separated policies, each name[,key=value...] (keys as in --param, plus "
          "quantization=int8|int4|nf4 and quant_recent=N)");
ABSL_FLAG(std::string, answer_prefix, "",
          "generate/multi: text appended after the assistant turn opens (e.g. 'The pass key is')");
ABSL_FLAG(bool, stop_at_number, false,
          "multi: stop an answer at the first non-digit after a number (retrieval, arithmetic)");
ABSL_FLAG(bool, step_channel, true,
          "send each StepBatch through a shared-memory step channel when kvmemd is on this host "
          "(falls back to gRPC when it cannot open one)");
ABSL_FLAG(bool, attention_f16, false,
          "send the per-step attention rows to kvmemd as IEEE halves instead of f32");
ABSL_FLAG(uint32_t, prefill_chunk, 0,
          "compute a prompt that is not compressed in chunks ending at multiples of N "
          "positions (16, the block size: a reused prefix then gives the cold request's "
          "logits to the bit, at about 3.5x the prefill time here); 0 = one pass");
ABSL_FLAG(std::string, questions_file, "", "docqa: one question per line");
ABSL_FLAG(uint32_t, document_tokens, 0, "docqa: cut the document to this many tokens (0 = all)");
ABSL_FLAG(std::string, doc_mode, "plain",
          "docqa: plain (each request prefills document and question, no sharing), prefix "
          "(full cache, the document's published blocks mapped), compress (each request "
          "compresses document and question with --policy), document (the document compressed "
          "once with --policy and shared; questions appended uncompressed), private_document "
          "(each request compresses the document itself, then appends its question)");
ABSL_FLAG(uint32_t, prefill_tokens, 0,
          "perplexity: feed the first N tokens as one prompt (prefill + Compress), then score "
          "the rest token by token");

namespace kvmem::worker {
namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvmem_worker: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

absl::StatusOr<client::Precision> ParsePrecision(absl::string_view q) {
  if (q == "int8") return client::Precision::kInt8;
  if (q == "int4") return client::Precision::kInt4;
  if (q == "nf4") return client::Precision::kNF4;
  if (q == "none") return client::Precision::kLayout;
  return absl::InvalidArgumentError(
      absl::StrCat("quantization: none, int8, int4 or nf4, got '", q, "'"));
}

// Policy `name` with "key=value" parameters; the keys "quantization" (none/int8/int4/nf4)
// and "quant_recent" set the storage precision instead of a policy parameter.
absl::StatusOr<client::PolicySpec> ParsePolicy(const std::string& name,
                                               const std::vector<std::string>& params,
                                               absl::string_view quantization,
                                               uint32_t quant_recent) {
  client::PolicySpec spec;
  spec.name = name;
  absl::StatusOr<client::Precision> precision = ParsePrecision(quantization);
  if (!precision.ok()) return precision.status();
  spec.quantization = *precision;
  if (quant_recent != 0) spec.quantization_recent_tokens = quant_recent;  // 0: the default
  for (const std::string& p : params) {
    std::vector<std::string> kv = absl::StrSplit(p, absl::MaxSplits('=', 1));
    if (kv.size() == 2 && kv[0] == "quantization") {
      precision = ParsePrecision(kv[1]);
      if (!precision.ok()) return precision.status();
      spec.quantization = *precision;
      continue;
    }
    double value;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &value)) {
      return absl::InvalidArgumentError("policy parameter: expected name=value, got " + p);
    }
    if (kv[0] == "quant_recent") {
      spec.quantization_recent_tokens = static_cast<uint32_t>(value);
    } else {
      spec.params[kv[0]] = value;
    }
  }
  return spec;
}

absl::StatusOr<client::PolicySpec> PolicyFromFlags() {
  return ParsePolicy(absl::GetFlag(FLAGS_policy), absl::GetFlag(FLAGS_param),
                     absl::GetFlag(FLAGS_quantization), absl::GetFlag(FLAGS_quant_recent));
}

SessionOptions SessionOptionsFromFlags() {
  return SessionOptions{absl::GetFlag(FLAGS_window), absl::GetFlag(FLAGS_attention_f16),
                        absl::GetFlag(FLAGS_prefill_chunk)};
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

struct Env {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<LocalKvStore> local;
  std::unique_ptr<KvmemKvStore> daemon;
  KvStore* store = nullptr;
};

// A client of --target; with --step_channel its StepBatches go through a step channel when
// the daemon is on this host (said on stderr when it is not).
absl::StatusOr<std::unique_ptr<client::Client>> ConnectDaemon() {
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(absl::GetFlag(FLAGS_target));
  if (!c.ok() || !absl::GetFlag(FLAGS_step_channel)) return c;
  if (absl::Status s = (*c)->OpenStepChannel(); !s.ok()) {
    std::fprintf(stderr, "step channel not opened (StepBatch goes by gRPC): %s\n",
                 s.ToString().c_str());
  }
  return c;
}

absl::Status Setup(Env& env, bool force_local) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(absl::GetFlag(FLAGS_model));
  if (!file.ok()) return file.status();
  env.file = *std::move(file);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(*env.file);
  if (!tok.ok()) return tok.status();
  env.tokenizer = *std::move(tok);
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(*env.file);
  if (!model.ok()) return model.status();
  env.model = *std::move(model);
  if (force_local || absl::GetFlag(FLAGS_cache) == "local") {
    env.local = std::make_unique<LocalKvStore>(env.model->config());
    env.store = env.local.get();
    return absl::OkStatus();
  }
  absl::StatusOr<client::PolicySpec> policy = PolicyFromFlags();
  if (!policy.ok()) return policy.status();
  absl::StatusOr<std::unique_ptr<client::Client>> c = ConnectDaemon();
  if (!c.ok()) return c.status();
  env.client = *std::move(c);
  const auto path = absl::GetFlag(FLAGS_read_path) == "grpc"
                        ? KvmemKvStore::ReadPath::kGrpc
                        : KvmemKvStore::ReadPath::kSharedMemory;
  absl::StatusOr<std::unique_ptr<KvmemKvStore>> d =
      KvmemKvStore::Create(env.client.get(), env.model->config(), *policy, path);
  if (!d.ok()) return d.status();
  env.daemon = *std::move(d);
  env.store = env.daemon.get();
  return absl::OkStatus();
}

// The prompt text: --prompt_file when given, else --prompt.
std::string PromptText() {
  if (absl::GetFlag(FLAGS_prompt_file).empty()) return absl::GetFlag(FLAGS_prompt);
  std::ifstream in(absl::GetFlag(FLAGS_prompt_file), std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// The token ids of --text (no special tokens).
absl::StatusOr<std::vector<int32_t>> TextTokens(const Tokenizer& tokenizer) {
  std::ifstream in(absl::GetFlag(FLAGS_text));
  if (!in) return absl::NotFoundError("cannot read " + absl::GetFlag(FLAGS_text));
  std::stringstream buf;
  buf << in.rdbuf();
  return tokenizer.Encode(buf.str(), false);
}

uint64_t FullCacheBytes(const ModelConfig& c, int64_t tokens, uint32_t bytes_per_element) {
  return uint64_t(tokens) * c.num_layers * c.num_kv_heads * 2 * c.head_dim * bytes_per_element;
}

int Generate() {
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
    const auto path = absl::GetFlag(FLAGS_read_path) == "grpc"
                          ? KvmemKvStore::ReadPath::kGrpc
                          : KvmemKvStore::ReadPath::kSharedMemory;
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> d =
        KvmemKvStore::Create(env.client.get(), env.model->config(), *policy, path, &prompt);
    if (!d.ok()) return Fail("setup", d.status());
    env.daemon = *std::move(d);
    env.store = env.daemon.get();
    reused = env.daemon->reused_tokens();
  }
  Session session(*env.model, *env.store, env.daemon.get(), SessionOptionsFromFlags());
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  session.SkipMapped(static_cast<int64_t>(reused));
  absl::StatusOr<std::vector<float>> logits = session.Feed(
      std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(reused), ids.end()), true);
  if (!logits.ok()) return Fail("prefill", logits.status());
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
    logits = session.Feed({next}, false);
    if (!logits.ok()) return Fail("decode", logits.status());
  }
  const auto t2 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "\ndecode done\n");
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("%s\n", answer.c_str());
  std::printf("---\nprompt %zu tokens, %.1f tokens/s prefill; %u generated, %.1f tokens/s decode\n",
              ids.size(), ids.size() / prefill_s, generated,
              generated > 0 ? generated / decode_s : 0.0);
  if (absl::GetFlag(FLAGS_prefix_cache)) {
    std::printf("prefix cache: %llu of %zu prompt tokens reused; first token after %.1f ms\n",
                static_cast<unsigned long long>(reused), ids.size(), 1000 * prefill_s);
  }
  if (env.daemon != nullptr) {
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
        "(StepBatch %s%s)\n",
        session.daemon_ms_per_step(), median, first, slowest_ms, slowest_step,
        env.client->step_channel_batches() > 0 ? "over the step channel" : "over gRPC",
        absl::GetFlag(FLAGS_read_path) == "grpc" ? ", ReadKv" : "");
  }
  return 0;
}

int Perplexity() {
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

// A view of a store without the slots whose positions fall in [drop_from, drop_to).
class DroppingKvStore final : public KvStore {
 public:
  DroppingKvStore(KvStore& inner, int64_t drop_from, int64_t drop_to)
      : inner_(inner), from_(drop_from), to_(drop_to) {}
  absl::Status BeginForward() override { return inner_.BeginForward(); }
  absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) override {
    PastStream all;
    if (absl::Status s = inner_.Past(layer, kv_head, &all); !s.ok()) return s;
    out->runs.clear();
    out->positions.clear();
    out->scratch = std::move(all.scratch);  // runs may point into it; moving keeps the buffer
    size_t base = 0;                        // index in all.positions of the run's first slot
    for (const PastStream::Run& run : all.runs) {
      uint32_t begin = 0;
      for (uint32_t i = 0; i <= run.count; ++i) {
        const bool end = i == run.count;
        const bool dropped =
            !end && all.positions[base + i] >= from_ && all.positions[base + i] < to_;
        if (!end && !dropped) continue;
        if (i > begin) {
          out->runs.push_back(
              {run.k + uint64_t{begin} * dim_, run.v + uint64_t{begin} * dim_, i - begin});
          out->positions.insert(out->positions.end(), all.positions.begin() + base + begin,
                                all.positions.begin() + base + i);
        }
        begin = i + 1;
      }
      base += run.count;
    }
    return absl::OkStatus();
  }
  void set_dim(uint32_t d) { dim_ = d; }

 private:
  KvStore& inner_;
  int64_t from_, to_;
  uint32_t dim_ = 0;
};

// Confidence against KL: teacher-forced over a text with the in-process cache; at every
// step after --kl_warmup tokens, the next-token distribution with the full cache (p) and
// with the last --kl_drop tokens dropped (q) — or, with --kl_keep_recent R, the --kl_drop
// tokens before the newest R. Prints "step entropy p1 p2 kl" per line.
int KlStudy() {
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
      DroppingKvStore dropped(*env.local, pos - keep - drop, pos - keep);
      dropped.set_dim(c.head_dim);
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

// JSON string literal of `s` (UTF-8 passes through; control characters escaped).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Whether `piece` ends a number that `answer` already holds: its first character is not a
// digit and the answer has one.
bool EndsNumber(const std::string& answer, const std::string& piece) {
  auto digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  const bool has_digit = std::any_of(answer.begin(), answer.end(), digit);
  return has_digit && !piece.empty() && !digit(piece[0]);
}

// One prompt, many policies: the prompt's forward pass runs once (in process, every signal
// any policy needs); then, per policy, a kvmemd sequence receives the prompt's K/V and
// signals and compresses; the answers are decoded greedily side by side, one forward pass
// per policy and one StepBatch for all of them per token. Prints one JSON line per policy:
// answer, KV bytes after the prompt's compression, mean KV bytes while decoding.
int Multi() {
  Env env;
  if (absl::Status s = Setup(env, true); !s.ok()) return Fail("setup", s);
  absl::StatusOr<std::unique_ptr<client::Client>> c = ConnectDaemon();
  if (!c.ok()) return Fail("connect", c.status());
  std::vector<client::PolicySpec> specs;
  std::vector<std::string> labels;
  for (absl::string_view entry :
       absl::StrSplit(absl::GetFlag(FLAGS_policies), ';', absl::SkipWhitespace())) {
    std::vector<std::string> parts = absl::StrSplit(entry, ',', absl::SkipWhitespace());
    absl::StatusOr<client::PolicySpec> spec =
        ParsePolicy(parts[0], std::vector<std::string>(parts.begin() + 1, parts.end()), "none", 0);
    if (!spec.ok()) return Fail("--policies", spec.status());
    specs.push_back(*spec);
    labels.emplace_back(entry);
  }
  if (specs.empty()) return Fail("--policies", absl::InvalidArgumentError("no policy given"));
  const std::string prompt =
      (absl::GetFlag(FLAGS_raw) ? PromptText() : env.tokenizer->ChatPrompt(PromptText())) +
      absl::GetFlag(FLAGS_answer_prefix);
  const std::vector<int32_t> ids = env.tokenizer->Encode(prompt, true);
  ForwardOptions options;
  options.attention_rows = options.layer_distance = options.next_token_stats = true;
  for (const client::PolicySpec& spec : specs) {
    const uint32_t w = Session::PrefillWindow(spec, absl::GetFlag(FLAGS_window));
    if (std::find(options.windows.begin(), options.windows.end(), w) == options.windows.end()) {
      options.windows.push_back(w);
    }
  }
  std::vector<int64_t> positions(ids.size());
  std::iota(positions.begin(), positions.end(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<ForwardResult> r = env.model->Forward(ids, positions, *env.local, options);
  if (!r.ok()) return Fail("prefill", r.status());
  std::fprintf(stderr, "prompt %zu tokens, prefill %.1f s\n", ids.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  const uint64_t full = FullCacheBytes(env.model->config(), static_cast<int64_t>(ids.size()), 4);
  struct Answer {
    std::unique_ptr<KvmemKvStore> store;
    std::unique_ptr<Session> session;
    std::vector<float> logits;
    uint64_t kv_prompt = 0;
    std::string text;
    bool done = false;
  };
  std::vector<Answer> answers(specs.size());
  for (size_t p = 0; p < specs.size(); ++p) {
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> store = KvmemKvStore::Create(
        c->get(), env.model->config(), specs[p], KvmemKvStore::ReadPath::kSharedMemory);
    if (!store.ok()) return Fail(labels[p], store.status());
    Answer& a = answers[p];
    a.store = *std::move(store);
    a.session =
        std::make_unique<Session>(*env.model, *a.store, a.store.get(), SessionOptionsFromFlags());
    absl::StatusOr<std::vector<float>> logits = a.session->Commit(ids, *r, true);
    if (!logits.ok()) return Fail(labels[p], logits.status());
    a.logits = *std::move(logits);
    a.kv_prompt = a.session->kv_bytes();
  }
  for (uint32_t i = 0; i < absl::GetFlag(FLAGS_max_tokens); ++i) {
    std::vector<Session*> sessions;
    std::vector<int32_t> tokens;
    std::vector<Answer*> stepped;
    for (Answer& a : answers) {
      if (a.done) continue;
      const int32_t next = static_cast<int32_t>(std::max_element(a.logits.begin(), a.logits.end()) -
                                                a.logits.begin());
      const std::string piece = env.tokenizer->Decode(next);
      if (next == env.tokenizer->eos() || next == env.tokenizer->im_end() ||
          (absl::GetFlag(FLAGS_stop_at_number) && EndsNumber(a.text, piece))) {
        a.done = true;
        continue;
      }
      a.text += piece;
      sessions.push_back(a.session.get());
      tokens.push_back(next);
      stepped.push_back(&a);
    }
    if (sessions.empty()) break;
    std::vector<std::vector<float>> logits;
    if (absl::Status s = DecodeBatch(sessions, tokens, &logits); !s.ok()) return Fail("decode", s);
    for (size_t j = 0; j < stepped.size(); ++j) stepped[j]->logits = std::move(logits[j]);
  }
  for (size_t p = 0; p < specs.size(); ++p) {
    const Session& session = *answers[p].session;
    const uint64_t kv_prompt = answers[p].kv_prompt;
    std::printf(
        "{\"policy\": %s, \"prompt_tokens\": %zu, \"kv_bytes_full\": %llu, "
        "\"kv_bytes_prompt\": %llu, \"kv_bytes_mean\": %.0f, \"evicted\": %llu, "
        "\"answer\": %s}\n",
        JsonString(labels[p]).c_str(), ids.size(), static_cast<unsigned long long>(full),
        static_cast<unsigned long long>(kv_prompt),
        session.mean_kv_bytes() > 0 ? session.mean_kv_bytes() : static_cast<double>(kv_prompt),
        static_cast<unsigned long long>(session.evicted()), JsonString(answers[p].text).c_str());
  }
  return 0;
}

// Questions over one document, every request's sequence held until all have answered (as
// if asked at once). --doc_mode says how the document's cache is made:
//   plain             each request prefills document + question (full cache, nothing shared)
//   prefix            the same, created with the prompt's ids: the document's blocks,
//                     published by the first request, are mapped by the others
//   compress          each request prefills document + question and compresses them with
//                     --policy (its question is the observation window)
//   document          the first request prefills the document, compresses it with --policy
//                     by the policy's own rule (the document's end is the window) and
//                     publishes it; every request maps it and appends its question
//                     uncompressed
//   private_document  as document, but every request compresses the document itself
//                     (its answers must be document's, to the token)
// Prints one JSON line per question (tokens reused, time to first token, answer), then one
// with the pool's bytes and blocks while all sequences are held.
int DocQa() {
  Env env;
  if (absl::Status s = Setup(env, true); !s.ok()) return Fail("setup", s);
  const std::string mode = absl::GetFlag(FLAGS_doc_mode);
  if (mode != "plain" && mode != "prefix" && mode != "compress" && mode != "document" &&
      mode != "private_document") {
    return Fail("--doc_mode", absl::InvalidArgumentError("unknown mode " + mode));
  }
  absl::StatusOr<client::PolicySpec> policy = PolicyFromFlags();
  if (!policy.ok()) return Fail("setup", policy.status());
  if (mode == "plain" || mode == "prefix") *policy = client::PolicySpec{"full", {}};
  absl::StatusOr<std::unique_ptr<client::Client>> c = ConnectDaemon();
  if (!c.ok()) return Fail("connect", c.status());
  std::ifstream doc_in(absl::GetFlag(FLAGS_text)), q_in(absl::GetFlag(FLAGS_questions_file));
  if (!doc_in || !q_in) {
    return Fail("docqa", absl::NotFoundError("cannot read --text or --questions_file"));
  }
  std::stringstream doc_buf;
  doc_buf << doc_in.rdbuf();
  std::vector<int32_t> doc_ids = env.tokenizer->Encode(doc_buf.str(), false);
  if (const uint32_t cut = absl::GetFlag(FLAGS_document_tokens); cut > 0 && doc_ids.size() > cut) {
    doc_ids.resize(cut);
  }
  // The document part of every prompt is the same token ids: system turn, user turn's
  // opening, document (encoded apart from the question, so no merge crosses the boundary).
  const std::string chat = env.tokenizer->ChatPrompt("\x01");
  const size_t cut_at = chat.find('\x01');
  std::vector<int32_t> head = env.tokenizer->Encode(chat.substr(0, cut_at), true);
  head.insert(head.end(), doc_ids.begin(), doc_ids.end());
  std::vector<std::string> questions;
  for (std::string line; std::getline(q_in, line);) {
    if (!line.empty()) questions.push_back(line);
  }
  struct Request {
    std::unique_ptr<KvmemKvStore> store;
    std::unique_ptr<Session> session;
    std::vector<int32_t> ids;
    uint64_t reused = 0;
    double ttft_ms = 0;
    std::vector<float> logits;
    std::string answer;
    bool done = false;
  };
  std::vector<Request> requests(questions.size());
  const bool shared_document = mode == "document" || mode == "private_document";
  for (size_t i = 0; i < questions.size(); ++i) {
    Request& r = requests[i];
    std::vector<int32_t> question = env.tokenizer->Encode(
        absl::StrCat("\n\nQuestion: ", questions[i], chat.substr(cut_at + 1)), true);
    r.ids = head;
    r.ids.insert(r.ids.end(), question.begin(), question.end());
    const auto t0 = std::chrono::steady_clock::now();
    client::Prompt prompt{r.ids, "", "smollm2-135m", /*auto_publish=*/mode == "prefix"};
    if (mode == "document") prompt.document_tokens = static_cast<uint32_t>(head.size());
    const bool with_prompt = mode == "prefix" || mode == "document";
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> store = KvmemKvStore::Create(
        c->get(), env.model->config(), *policy, KvmemKvStore::ReadPath::kSharedMemory,
        with_prompt ? &prompt : nullptr);
    if (!store.ok()) return Fail("create", store.status());
    r.store = *std::move(store);
    r.reused = r.store->reused_tokens();
    r.session =
        std::make_unique<Session>(*env.model, *r.store, r.store.get(), SessionOptionsFromFlags());
    r.session->SkipMapped(static_cast<int64_t>(r.reused));
    absl::StatusOr<std::vector<float>> logits;
    if (shared_document) {
      if (r.reused < head.size()) {  // compress the document (and publish it)
        logits = r.session->Feed(std::vector<int32_t>(head.begin() + r.reused, head.end()), true);
        if (!logits.ok()) return Fail("document", logits.status());
        if (mode == "document") {
          absl::StatusOr<uint64_t> published = (*c)->PublishDocument(r.store->sequence_id());
          if (!published.ok()) return Fail("publish", published.status());
        }
      }
      logits = r.session->FeedUncompressed(question);
    } else {
      logits = r.session->Feed(
          std::vector<int32_t>(r.ids.begin() + static_cast<ptrdiff_t>(r.reused), r.ids.end()),
          true);
    }
    if (!logits.ok()) return Fail("prefill", logits.status());
    r.logits = *std::move(logits);
    r.ttft_ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "request %zu: %llu of %zu tokens reused, first token after %.0f ms\n", i,
                 static_cast<unsigned long long>(r.reused), r.ids.size(), r.ttft_ms);
  }
  // The answers, greedy, side by side: one StepBatch per token.
  for (uint32_t t = 0; t < absl::GetFlag(FLAGS_max_tokens); ++t) {
    std::vector<Session*> sessions;
    std::vector<int32_t> tokens;
    std::vector<Request*> stepped;
    for (Request& r : requests) {
      if (r.done) continue;
      const int32_t next = static_cast<int32_t>(std::max_element(r.logits.begin(), r.logits.end()) -
                                                r.logits.begin());
      if (next == env.tokenizer->eos() || next == env.tokenizer->im_end()) {
        r.done = true;
        continue;
      }
      r.answer += env.tokenizer->Decode(next);
      sessions.push_back(r.session.get());
      tokens.push_back(next);
      stepped.push_back(&r);
    }
    if (sessions.empty()) break;
    std::vector<std::vector<float>> logits;
    if (absl::Status s = DecodeBatch(sessions, tokens, &logits); !s.ok()) return Fail("decode", s);
    for (size_t j = 0; j < stepped.size(); ++j) stepped[j]->logits = std::move(logits[j]);
  }
  absl::StatusOr<client::Stats> stats = (*c)->GetStats(false);
  if (!stats.ok()) return Fail("stats", stats.status());
  uint64_t kv_bytes = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    kv_bytes += r.session->kv_bytes();
    std::printf(
        "{\"question\": %s, \"prompt_tokens\": %zu, \"document_tokens\": %zu, \"reused\": %llu, "
        "\"ttft_ms\": %.1f, \"kv_bytes\": %llu, \"answer\": %s}\n",
        JsonString(questions[i]).c_str(), r.ids.size(), head.size(),
        static_cast<unsigned long long>(r.reused), r.ttft_ms,
        static_cast<unsigned long long>(r.session->kv_bytes()), JsonString(r.answer).c_str());
  }
  std::printf(
      "{\"mode\": %s, \"policy\": %s, \"requests\": %zu, \"pool_used_bytes\": %llu, "
      "\"blocks_used\": %llu, \"kv_bytes_sum\": %llu}\n",
      JsonString(mode).c_str(), JsonString(policy->name.value_or("full")).c_str(), requests.size(),
      static_cast<unsigned long long>(stats->pool_used_bytes),
      static_cast<unsigned long long>(stats->blocks_used),
      static_cast<unsigned long long>(kv_bytes));
  return 0;
}

// Relative error of int8 / int4 / nf4 on this model's real K and V: the first
// --max_eval_tokens tokens of --text through the model (in process), every full block of 16
// tokens of every stream quantized and dequantized with the kernels' reference
// (kernels/quantize.h). Prints "type k_error v_error" with error = ||x - x_hat|| / ||x||
// over all blocks (K after RoPE).
int QuantError() {
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

// JSON for the parity tests: token ids of the prompt, and the full-cache logits of its last
// token (local cache, no daemon).
int Dump() {
  if (absl::GetFlag(FLAGS_ids_only)) {  // the tokenizer alone: no weights loaded
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(absl::GetFlag(FLAGS_model));
    if (!file.ok()) return Fail("--model", file.status());
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
    if (!tok.ok()) return Fail("--model", tok.status());
    const std::vector<int32_t> ids = (*tok)->Encode(PromptText(), true);
    std::printf("{\"ids\": [");
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? ", " : "", ids[i]);
    std::printf("]}\n");
    return 0;
  }
  Env env;
  if (absl::Status s = Setup(env, absl::GetFlag(FLAGS_cache) == "local"); !s.ok())
    return Fail("setup", s);
  const std::vector<int32_t> ids = env.tokenizer->Encode(PromptText(), true);
  std::printf("{\"ids\": [");
  for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? ", " : "", ids[i]);
  std::printf("]");
  if (!ids.empty()) {
    Session session(*env.model, *env.store, env.daemon.get(), SessionOptionsFromFlags());
    absl::StatusOr<std::vector<float>> logits = session.Feed(ids, true);
    if (!logits.ok()) return Fail("forward", logits.status());
    std::printf(", \"logits\": [");
    for (size_t i = 0; i < logits->size(); ++i) std::printf("%s%.6g", i ? ", " : "", (*logits)[i]);
    std::printf("]");
  }
  std::printf("}\n");
  return 0;
}

}  // namespace
}  // namespace kvmem::worker

int main(int argc, char** argv) {
  // Generic BLAS kernels on a CPU OpenBLAS does not know: run again with the right ones.
  if (const std::string core = kvmem::worker::BlasCoreTypeOverride(); !core.empty()) {
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    execv("/proc/self/exe", argv);  // returns only on failure: go on with the generic kernels
  }
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string mode = args.size() > 1 ? args[1] : "";
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::fprintf(stderr, "kvmem_worker: --model is required (bash scripts/fetch_model.sh)\n");
    return 2;
  }
  if (mode == "generate") return kvmem::worker::Generate();
  if (mode == "perplexity") return kvmem::worker::Perplexity();
  if (mode == "dump") return kvmem::worker::Dump();
  if (mode == "kl") return kvmem::worker::KlStudy();
  if (mode == "multi") return kvmem::worker::Multi();
  if (mode == "quanterr") return kvmem::worker::QuantError();
  if (mode == "docqa") return kvmem::worker::DocQa();
  std::fprintf(
      stderr,
      "usage: kvmem_worker generate|perplexity|dump|kl|multi|quanterr|docqa --model=PATH ...\n");
  return 2;
}
