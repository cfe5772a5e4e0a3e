#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "commands/commands.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "path to the GGUF file (scripts/fetch_model.sh prints it)");
ABSL_FLAG(std::string, target, "127.0.0.1:50551", "kvmemd address");
ABSL_FLAG(std::string, auth_token_file, "",
          "a file holding the bearer token of a kvmemd with --auth-tokens (first line)");
ABSL_FLAG(std::string, cache, "kvmemd", "kvmemd or local");
ABSL_FLAG(double, daemon_deadline_seconds, 30,
          "generate: a kvmemd call that takes longer (retries included) fails, and the answer "
          "is finished with an in-process cache");
ABSL_FLAG(std::string, transport, "auto",
          "how K/V moves with kvmemd: attach (same host, read in place), ucx (RMA gets and "
          "messages; kvmemd --ucx), grpc (ReadKv, K/V in the Append), or auto (the first of "
          "them that works)");
ABSL_FLAG(std::string, policy, "confkv", "kvmemd policy");
ABSL_FLAG(std::vector<std::string>, param, {},
          "policy parameters, comma-separated name=value pairs (one --param flag)");
ABSL_FLAG(std::string, quantization, "none", "none, int8, int4, nf4");
ABSL_FLAG(uint32_t, quant_recent, 0, "tokens kept unquantized at the end of each stream (0 = 128)");
ABSL_FLAG(std::string, prompt, "", "user message (generate, dump)");
ABSL_FLAG(std::string, prompt_file, "", "read the prompt from this file instead of --prompt");
ABSL_FLAG(bool, raw, false, "use the prompt as is, without the chat template");
ABSL_FLAG(std::string, answer_prefix, "",
          "generate/multi: text appended after the assistant turn opens (e.g. 'The pass key is')");
ABSL_FLAG(std::string, text, "", "text file (perplexity)");
ABSL_FLAG(uint32_t, max_tokens, 64, "tokens to generate");
ABSL_FLAG(uint32_t, max_eval_tokens, 0, "perplexity: stop after this many tokens (0 = all)");
ABSL_FLAG(uint32_t, window, 32, "observation window for prefill window scores");
ABSL_FLAG(bool, step_channel, true,
          "send each StepBatch through a shared-memory step channel when kvmemd is on this host "
          "(falls back to gRPC when it cannot open one)");
ABSL_FLAG(bool, in_place_writes, true,
          "against a same-host kvmemd that offers it (kvmemd --in_place_writes), write each "
          "decode step's K/V into the pool and its attention rows into the step channel's "
          "signal area instead of sending them");
ABSL_FLAG(bool, attention_f16, false,
          "send the per-step attention rows to kvmemd as IEEE halves instead of f32");
ABSL_FLAG(uint32_t, prefill_chunk, 0,
          "compute a prompt that is not compressed in chunks ending at multiples of N "
          "positions (16, the block size: a reused prefix then gives the cold request's "
          "logits to the bit, at about 3.5x the prefill time here); 0 = one pass");

namespace kvmem::worker {
namespace {

absl::StatusOr<client::Precision> ParsePrecision(absl::string_view q) {
  if (q == "int8") return client::Precision::kInt8;
  if (q == "int4") return client::Precision::kInt4;
  if (q == "nf4") return client::Precision::kNF4;
  if (q == "none") return client::Precision::kLayout;
  return absl::InvalidArgumentError(
      absl::StrCat("quantization: none, int8, int4 or nf4, got '", q, "'"));
}

}  // namespace

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvmem_worker: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

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

bool InPlaceFromFlags() { return absl::GetFlag(FLAGS_in_place_writes); }

absl::StatusOr<client::KvTransport> TransportFromFlags() {
  return client::ParseKvTransport(absl::GetFlag(FLAGS_transport));
}

absl::StatusOr<std::unique_ptr<client::Client>> ConnectDaemon() {
  client::ClientOptions options;
  const double deadline = absl::GetFlag(FLAGS_daemon_deadline_seconds);
  if (!(deadline > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--daemon_deadline_seconds: ", deadline, " is not a positive time"));
  }
  options.deadline = absl::Seconds(deadline);
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = client::ReadAuthToken(file);
    if (!token.ok()) return token.status();
    options.auth_token = *token;
  }
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(absl::GetFlag(FLAGS_target), options);
  if (!c.ok() || !absl::GetFlag(FLAGS_step_channel)) return c;
  // A signal area for the rows when they may go in place: 16 MiB holds a step's rows of
  // SmolLM2 (90 streams) at 16k tokens as f32, or a batch of shorter ones.
  uint64_t signal_bytes = 0;
  if (absl::GetFlag(FLAGS_in_place_writes)) {
    absl::StatusOr<client::Info> info = (*c)->GetInfo();
    if (info.ok() && info->in_place_writes) signal_bytes = 16ull << 20;
    // The tables too, where the daemon keeps them in shared memory: a step's answer then
    // names the version instead of carrying the update.
    if (info.ok() && info->table_area_bytes != 0) {
      if (absl::Status s = (*c)->AttachTableArea(); !s.ok()) {
        std::fprintf(stderr, "table area not attached (updates come in answers): %s\n",
                     s.ToString().c_str());
      }
    }
  }
  if (absl::Status s = (*c)->OpenStepChannel(std::nullopt, signal_bytes); !s.ok()) {
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
  absl::StatusOr<client::KvTransport> transport = TransportFromFlags();
  if (!transport.ok()) return transport.status();
  absl::StatusOr<std::unique_ptr<KvmemKvStore>> d = KvmemKvStore::Create(
      env.client.get(), env.model->config(), *policy, *transport, nullptr, InPlaceFromFlags());
  if (!d.ok()) return d.status();
  env.daemon = *std::move(d);
  env.store = env.daemon.get();
  return absl::OkStatus();
}

std::string PromptText() {
  if (absl::GetFlag(FLAGS_prompt_file).empty()) return absl::GetFlag(FLAGS_prompt);
  std::ifstream in(absl::GetFlag(FLAGS_prompt_file), std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

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

void PrintJsonLine(const nlohmann::ordered_json& value) {
  const std::string line =
      value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::printf("%s\n", line.c_str());
}

}  // namespace kvmem::worker
