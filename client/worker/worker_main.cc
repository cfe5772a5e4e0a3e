// kvmem_worker: SmolLM2 (or any Llama-family GGUF) on the CPU with its KV cache in kvmemd.
//
//   kvmem_worker generate   --model M --prompt "..." [--policy confkv] [--target ADDR]
//   kvmem_worker perplexity --model M --text FILE [--policy window --param window=512]
//   kvmem_worker dump       --model M --prompt "..."   (JSON: ids and full-cache logits)
//   kvmem_worker kl         --model M --text FILE     (confidence inputs and KL per step)
//
// --cache=kvmemd (default) keeps the cache in the daemon; --cache=local keeps it in process.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kv_stores.h"
#include "model.h"
#include "tokenizer.h"

ABSL_FLAG(std::string, model, "", "path to the GGUF file (scripts/fetch_model.sh prints it)");
ABSL_FLAG(std::string, target, "127.0.0.1:50551", "kvmemd address");
ABSL_FLAG(std::string, cache, "kvmemd", "kvmemd or local");
ABSL_FLAG(std::string, read_path, "shm", "shm (same-host, in place) or grpc (ReadKV)");
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
ABSL_FLAG(std::string, prompt_file, "", "read the prompt from this file instead of --prompt");
ABSL_FLAG(uint32_t, max_prompt_tokens, 0, "generate: cut the prompt to this many tokens");

namespace kvmem::worker {
namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvmem_worker: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

absl::StatusOr<client::PolicySpec> PolicyFromFlags() {
  client::PolicySpec spec;
  spec.name = absl::GetFlag(FLAGS_policy);
  for (const std::string& p : absl::GetFlag(FLAGS_param)) {
    std::vector<std::string> kv = absl::StrSplit(p, absl::MaxSplits('=', 1));
    double value;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &value)) {
      return absl::InvalidArgumentError("--param: expected name=value, got " + p);
    }
    spec.params[kv[0]] = value;
  }
  const std::string q = absl::GetFlag(FLAGS_quantization);
  if (q == "int8")
    spec.quantization = client::Precision::kInt8;
  else if (q == "int4")
    spec.quantization = client::Precision::kInt4;
  else if (q == "nf4")
    spec.quantization = client::Precision::kNF4;
  else if (q != "none")
    return absl::InvalidArgumentError("--quantization: none, int8, int4 or nf4");
  return spec;
}

// One model run against one cache: prefill, then a token at a time, sending the signals the
// daemon's policies use after every step.
class Session {
 public:
  Session(const LlamaModel& model, KvStore& store, KvmemKvStore* daemon)
      : model_(model),
        store_(store),
        daemon_(daemon),
        local_(dynamic_cast<LocalKvStore*>(&store)) {}

  // Runs `tokens` (at the next positions); returns the last token's logits.
  absl::StatusOr<std::vector<float>> Feed(const std::vector<int32_t>& tokens, bool prefill) {
    std::vector<int64_t> positions(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i)
      positions[i] = next_position_ + static_cast<int64_t>(i);
    ForwardOptions options;
    options.attention_rows = daemon_ != nullptr;
    options.layer_distance = daemon_ != nullptr;
    options.next_token_stats = daemon_ != nullptr;
    options.window = prefill && daemon_ != nullptr ? absl::GetFlag(FLAGS_window) : 0;
    absl::StatusOr<ForwardResult> r = model_.Forward(tokens, positions, store_, options);
    if (!r.ok()) return r.status();
    next_position_ += static_cast<int64_t>(tokens.size());
    if (local_ != nullptr) local_->Append(positions, *r);
    if (daemon_ != nullptr) {
      // Token entropy of token i: the distribution that predicted it (the first token of the
      // sequence gets the mean of the others).
      std::vector<float> entropy(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) {
        entropy[i] = i == 0 ? last_topk_entropy_ : r->next_token_stats[i - 1].topk_entropy;
      }
      if (std::isnan(entropy[0])) {
        double sum = 0;
        for (size_t i = 1; i < entropy.size(); ++i) sum += entropy[i];
        entropy[0] = entropy.size() > 1 ? static_cast<float>(sum / (entropy.size() - 1)) : 0.0f;
      }
      last_topk_entropy_ = r->next_token_stats.back().topk_entropy;
      const uint64_t epoch = daemon_->table_epoch();
      const auto daemon_start = std::chrono::steady_clock::now();
      absl::StatusOr<client::AppendResult> appended =
          daemon_->Append(positions, tokens, *r, entropy);
      if (!appended.ok()) return appended.status();
      const LogitSummary& s = r->next_token_stats.back();
      std::vector<client::StreamSignal> rows(r->attention_rows.size());
      const uint32_t H = model_.config().num_kv_heads;
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = {static_cast<uint32_t>(i / H), static_cast<uint32_t>(i % H),
                   r->attention_rows[i]};
      }
      if (prefill) {
        client::CompressArgs args;
        args.epoch = epoch;
        args.attention = rows;
        for (size_t i = 0; i < rows.size(); ++i) {
          args.window_scores.push_back({rows[i].layer, rows[i].kv_head, r->window_scores[i]});
        }
        absl::StatusOr<client::CompressResult> c =
            daemon_->client()->Compress(daemon_->sequence_id(), args);
        if (!c.ok()) return c.status();
        evicted_ += c->evicted_tokens;
        kv_bytes_ = c->kv_bytes_after;
      } else {
        client::StepArgs args;
        args.epoch = epoch;
        args.logit_stats = client::LogitStats{s.entropy, s.p1, s.p2, {}};
        args.attention = std::move(rows);
        absl::StatusOr<client::StepResult> step =
            daemon_->client()->Step(daemon_->sequence_id(), args);
        if (!step.ok()) return step.status();
        evicted_ += step->evicted_tokens;
        kv_bytes_ = step->kv_bytes_after;
        kv_bytes_sum_ += static_cast<double>(step->kv_bytes_after);
        ++steps_;
        daemon_seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - daemon_start).count();
      }
    }
    const uint32_t V = model_.config().vocab;
    return std::vector<float>(r->logits.end() - V, r->logits.end());
  }

  uint64_t evicted() const { return evicted_; }
  uint64_t kv_bytes() const { return kv_bytes_; }
  double mean_kv_bytes() const { return steps_ > 0 ? kv_bytes_sum_ / steps_ : 0.0; }
  // Mean wall time per decode step spent in daemon calls: Append + Step, and the block-table
  // fetch before the forward pass.
  double daemon_ms_per_step() const {
    if (steps_ == 0 || daemon_ == nullptr) return 0.0;
    return 1e3 * (daemon_seconds_ + daemon_->table_seconds()) / steps_;
  }
  int64_t tokens() const { return next_position_; }

 private:
  const LlamaModel& model_;
  KvStore& store_;
  KvmemKvStore* daemon_;
  LocalKvStore* local_;
  int64_t next_position_ = 0;
  float last_topk_entropy_ = std::nanf("");
  uint64_t evicted_ = 0;
  uint64_t kv_bytes_ = 0;
  double kv_bytes_sum_ = 0;
  uint64_t steps_ = 0;
  double daemon_seconds_ = 0;
};

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
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(absl::GetFlag(FLAGS_target));
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

uint64_t FullCacheBytes(const ModelConfig& c, int64_t tokens, uint32_t bytes_per_element) {
  return uint64_t(tokens) * c.num_layers * c.num_kv_heads * 2 * c.head_dim * bytes_per_element;
}

int Generate() {
  Env env;
  if (absl::Status s = Setup(env, false); !s.ok()) return Fail("setup", s);
  const std::string prompt =
      absl::GetFlag(FLAGS_raw) ? PromptText() : env.tokenizer->ChatPrompt(PromptText());
  std::vector<int32_t> ids = env.tokenizer->Encode(prompt, true);
  const uint32_t max_prompt = absl::GetFlag(FLAGS_max_prompt_tokens);
  if (max_prompt > 0 && ids.size() > max_prompt) ids.resize(max_prompt);
  Session session(*env.model, *env.store, env.daemon.get());
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<float>> logits = session.Feed(ids, true);
  if (!logits.ok()) return Fail("prefill", logits.status());
  const auto t1 = std::chrono::steady_clock::now();
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
  std::fprintf(stderr, "\n");
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("%s\n", answer.c_str());
  std::printf("---\nprompt %zu tokens, %.1f tokens/s prefill; %u generated, %.1f tokens/s decode\n",
              ids.size(), ids.size() / prefill_s, generated,
              generated > 0 ? generated / decode_s : 0.0);
  if (env.daemon != nullptr) {
    const uint64_t full = FullCacheBytes(env.model->config(), session.tokens(), 4);
    std::printf(
        "kvmemd (%s): %llu KV bytes held for %lld tokens; full cache %llu (%.1f%% saved); "
        "%llu tokens evicted\n",
        absl::GetFlag(FLAGS_policy).c_str(), static_cast<unsigned long long>(session.kv_bytes()),
        static_cast<long long>(session.tokens()), static_cast<unsigned long long>(full),
        100.0 * (1.0 - double(session.kv_bytes()) / double(full)),
        static_cast<unsigned long long>(session.evicted()));
    std::printf("daemon calls: %.2f ms per decode step (block table, Append, Step)\n",
                session.daemon_ms_per_step());
  }
  return 0;
}

int Perplexity() {
  Env env;
  if (absl::Status s = Setup(env, false); !s.ok()) return Fail("setup", s);
  std::ifstream in(absl::GetFlag(FLAGS_text));
  if (!in) return Fail("--text", absl::NotFoundError("cannot read " + absl::GetFlag(FLAGS_text)));
  std::stringstream buf;
  buf << in.rdbuf();
  std::vector<int32_t> ids = env.tokenizer->Encode(buf.str(), false);
  const uint32_t limit = absl::GetFlag(FLAGS_max_eval_tokens);
  if (limit > 0 && ids.size() > limit + 1) ids.resize(limit + 1);
  if (ids.size() < 2) return Fail("--text", absl::InvalidArgumentError("fewer than 2 tokens"));
  Session session(*env.model, *env.store, env.daemon.get());
  double nll = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    absl::StatusOr<std::vector<float>> logits = session.Feed({ids[i]}, false);
    if (!logits.ok()) return Fail("step", logits.status());
    const float mx = *std::max_element(logits->begin(), logits->end());
    double z = 0;
    for (float l : *logits) z += std::exp(l - mx);
    nll -= ((*logits)[ids[i + 1]] - mx) - std::log(z);
    if ((i + 1) % 16 == 0 || i + 2 == ids.size()) {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double eta = elapsed / (i + 1) * (ids.size() - 2 - i);
      std::fprintf(stderr, "\r%zu/%zu tokens, ppl %.3f, ETA %.0fs   ", i + 1, ids.size() - 1,
                   std::exp(nll / (i + 1)), eta);
    }
  }
  std::fprintf(stderr, "\n");
  const size_t n = ids.size() - 1;
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
// with the last --kl_drop tokens dropped (q). Prints "step entropy p1 p2 kl" per line.
int KlStudy() {
  Env env;
  if (absl::Status s = Setup(env, true); !s.ok()) return Fail("setup", s);
  std::ifstream in(absl::GetFlag(FLAGS_text));
  if (!in) return Fail("--text", absl::NotFoundError("cannot read " + absl::GetFlag(FLAGS_text)));
  std::stringstream buf;
  buf << in.rdbuf();
  std::vector<int32_t> ids = env.tokenizer->Encode(buf.str(), false);
  const uint32_t warmup = absl::GetFlag(FLAGS_kl_warmup), drop = absl::GetFlag(FLAGS_kl_drop);
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
      DroppingKvStore dropped(*env.local, pos - drop, pos);
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

// JSON for the parity tests: token ids of the prompt, and the full-cache logits of its last
// token (local cache, no daemon).
int Dump() {
  Env env;
  if (absl::Status s = Setup(env, absl::GetFlag(FLAGS_cache) == "local"); !s.ok())
    return Fail("setup", s);
  const std::vector<int32_t> ids = env.tokenizer->Encode(PromptText(), true);
  std::printf("{\"ids\": [");
  for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? ", " : "", ids[i]);
  std::printf("]");
  if (!ids.empty() && !absl::GetFlag(FLAGS_ids_only)) {
    Session session(*env.model, *env.store, env.daemon.get());
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
  std::fprintf(stderr, "usage: kvmem_worker generate|perplexity|dump --model=PATH ...\n");
  return 2;
}
