// kvmem_worker dump: JSON for the parity tests: the prompt's token ids and the full-cache
// logits of its last token ({"ids": [...], "logits": [...]}; ids only with --ids_only, which
// loads no weights).
#include "absl/flags/flag.h"
#include "commands/commands.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(bool, ids_only, false, "dump: token ids only, no forward pass");

namespace kvmem::worker {

int RunDump() {
  nlohmann::ordered_json out;
  if (absl::GetFlag(FLAGS_ids_only)) {  // the tokenizer alone: no weights loaded
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(absl::GetFlag(FLAGS_model));
    if (!file.ok()) return Fail("--model", file.status());
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
    if (!tok.ok()) return Fail("--model", tok.status());
    out["ids"] = (*tok)->Encode(PromptText(), true);
    PrintJsonLine(out);
    return 0;
  }
  Env env;
  if (absl::Status s = Setup(env, absl::GetFlag(FLAGS_cache) == "local"); !s.ok()) {
    return Fail("setup", s);
  }
  const std::vector<int32_t> ids = env.tokenizer->Encode(PromptText(), true);
  out["ids"] = ids;
  if (!ids.empty()) {
    Session session(*env.model, *env.store, env.daemon.get(), SessionOptionsFromFlags());
    absl::StatusOr<std::vector<float>> logits = session.Feed(ids, true);
    if (!logits.ok()) return Fail("forward", logits.status());
    out["logits"] = *logits;
  }
  PrintJsonLine(out);
  return 0;
}

}  // namespace kvmem::worker
