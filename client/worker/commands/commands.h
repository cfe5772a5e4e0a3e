#pragma once
// kvmem_worker's subcommands, one file each, and what they share (env.cc): the flags more
// than one of them reads, the model and KV store a subcommand starts from (Env), policy
// parsing, input files, JSON output. A subcommand returns the process's exit status and
// says why it failed on stderr; results go to stdout.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gguf.h"
#include "kv_stores.h"
#include "kvmem/client.h"
#include "model.h"
#include "nlohmann/json_fwd.hpp"
#include "session.h"
#include "tokenizer.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, cache);
ABSL_DECLARE_FLAG(std::string, transport);
ABSL_DECLARE_FLAG(std::string, policy);
ABSL_DECLARE_FLAG(std::vector<std::string>, param);
ABSL_DECLARE_FLAG(std::string, quantization);
ABSL_DECLARE_FLAG(uint32_t, quant_recent);
ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(std::string, prompt_file);
ABSL_DECLARE_FLAG(bool, raw);
ABSL_DECLARE_FLAG(std::string, answer_prefix);
ABSL_DECLARE_FLAG(std::string, text);
ABSL_DECLARE_FLAG(uint32_t, max_tokens);
ABSL_DECLARE_FLAG(uint32_t, max_eval_tokens);
ABSL_DECLARE_FLAG(uint32_t, window);
ABSL_DECLARE_FLAG(bool, step_channel);
ABSL_DECLARE_FLAG(bool, attention_f16);
ABSL_DECLARE_FLAG(uint32_t, prefill_chunk);

namespace kvmem::worker {

// The subcommands (kvmem_worker NAME ...).
int RunGenerate();
int RunPerplexity();
int RunDump();
int RunKlStudy();
int RunMulti();
int RunQuantError();
int RunDocQa();

// Says "kvmem_worker: what: status" on stderr; returns 1, the exit status.
int Fail(const std::string& what, const absl::Status& s);

// Policy `name` with "key=value" parameters; the keys "quantization" (none/int8/int4/nf4)
// and "quant_recent" set the storage precision instead of a policy parameter.
absl::StatusOr<client::PolicySpec> ParsePolicy(const std::string& name,
                                               const std::vector<std::string>& params,
                                               absl::string_view quantization,
                                               uint32_t quant_recent);
// --policy, --param, --quantization and --quant_recent.
absl::StatusOr<client::PolicySpec> PolicyFromFlags();
SessionOptions SessionOptionsFromFlags();
// --transport.
absl::StatusOr<client::KvTransport> TransportFromFlags();
// --in_place_writes: write K/V and rows in place when kvmemd offers it (KvmemKvStore::Create).
bool InPlaceFromFlags();

// The model and where its KV cache lives: `local` (in process) or `daemon` (kvmemd, with
// `client`); `store` is the one in use.
struct Env {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<LocalKvStore> local;
  std::unique_ptr<KvmemKvStore> daemon;
  KvStore* store = nullptr;
};
// Loads --model; the cache in process when `force_local` or --cache=local, else a kvmemd
// sequence at --target under the flags' policy.
absl::Status Setup(Env& env, bool force_local);

// A client of --target; with --step_channel its StepBatches go through a step channel when
// the daemon is on this host (said on stderr when it is not).
absl::StatusOr<std::unique_ptr<client::Client>> ConnectDaemon();

// The prompt text: --prompt_file when given, else --prompt.
std::string PromptText();
// The token ids of --text (no special tokens).
absl::StatusOr<std::vector<int32_t>> TextTokens(const Tokenizer& tokenizer);

// Bytes of a full cache of `tokens` tokens (K and V, every stream) at `bytes_per_element`.
uint64_t FullCacheBytes(const ModelConfig& c, int64_t tokens, uint32_t bytes_per_element);

// Prints `value` as one line of JSON (bytes that are not UTF-8 become U+FFFD).
void PrintJsonLine(const nlohmann::ordered_json& value);

}  // namespace kvmem::worker
