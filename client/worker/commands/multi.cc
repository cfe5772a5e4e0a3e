// kvmem_worker multi: one prompt, many policies. The prompt's forward pass runs once (in
// process, every signal any policy needs); then, per policy, a kvmemd sequence receives the
// prompt's K/V and signals and compresses; the answers are decoded greedily side by side,
// one forward pass per policy and one StepBatch for all of them per token. Prints one JSON
// line per policy: answer, KV bytes after the prompt's compression, mean KV bytes while
// decoding.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "commands/commands.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, policies, "",
          "multi: ';'-separated policies, each name[,key=value...] (keys as in --param, plus "
          "quantization=int8|int4|nf4 and quant_recent=N)");
ABSL_FLAG(bool, stop_at_number, false,
          "multi: stop an answer at the first non-digit after a number (retrieval, arithmetic)");

namespace kvmem::worker {
namespace {

// Whether `piece` ends a number that `answer` already holds: its first character is not a
// digit and the answer has one.
bool EndsNumber(const std::string& answer, const std::string& piece) {
  auto digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  const bool has_digit = std::any_of(answer.begin(), answer.end(), digit);
  return has_digit && !piece.empty() && !digit(piece[0]);
}

}  // namespace

int RunMulti() {
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
    absl::StatusOr<client::KvTransport> transport = TransportFromFlags();
    if (!transport.ok()) return Fail(labels[p], transport.status());
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> store = KvmemKvStore::Create(
        c->get(), env.model->config(), specs[p], *transport, nullptr, InPlaceFromFlags());
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
    const double kv_mean =
        session.mean_kv_bytes() > 0 ? session.mean_kv_bytes() : static_cast<double>(kv_prompt);
    nlohmann::ordered_json line;
    line["policy"] = labels[p];
    line["prompt_tokens"] = ids.size();
    line["kv_bytes_full"] = full;
    line["kv_bytes_prompt"] = kv_prompt;
    line["kv_bytes_mean"] = static_cast<uint64_t>(std::nearbyint(kv_mean));  // whole bytes
    line["evicted"] = session.evicted();
    line["answer"] = answers[p].text;
    PrintJsonLine(line);
  }
  return 0;
}

}  // namespace kvmem::worker
