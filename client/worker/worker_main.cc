// kvmem_worker: SmolLM2 (or any Llama-family GGUF) on the CPU with its KV cache in kvmemd.
//
//   kvmem_worker generate   --model M --prompt "..." [--policy confkv] [--target ADDR]
//   kvmem_worker perplexity --model M --text FILE [--policy window --param window=512]
//   kvmem_worker dump       --model M --prompt "..."   (JSON: ids and full-cache logits)
//   kvmem_worker kl         --model M --text FILE     (confidence inputs and KL per step)
//   kvmem_worker quanterr   --model M --text FILE     (int8/int4/nf4 error on real K/V)
//   kvmem_worker multi      --model M --prompt_file F --policies "full;h2o,budget=256"
//                           (one prefill, then per policy: compress, answer, KV bytes; the
//                           answers decode side by side, one StepBatch per token)
//   kvmem_worker docqa      --model M --text DOC --questions_file Q --doc_mode document
//                           (questions over one document, all sequences held at once:
//                           time to first token, answers, pool bytes)
//
// --cache=kvmemd (default) keeps the cache in the daemon; --cache=local keeps it in process.
// Through kvmemd every generated token is one StepBatch (the token and the step's signals;
// --attention_f16 sends attention rows as halves); --transport picks how K/V moves
// (auto: attach on the same host, else UCX where kvmemd runs --ucx, else gRPC's ReadKv).
// Each subcommand is a file in commands/.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "commands/commands.h"

namespace {

struct Subcommand {
  std::string_view name;
  int (*run)();
};
constexpr Subcommand kSubcommands[] = {
    {"generate", kvmem::worker::RunGenerate}, {"perplexity", kvmem::worker::RunPerplexity},
    {"dump", kvmem::worker::RunDump},         {"kl", kvmem::worker::RunKlStudy},
    {"multi", kvmem::worker::RunMulti},       {"quanterr", kvmem::worker::RunQuantError},
    {"docqa", kvmem::worker::RunDocQa},
};
constexpr char kUsage[] =
    "usage: kvmem_worker generate|perplexity|dump|kl|multi|quanterr|docqa --model=PATH ...";

}  // namespace

int main(int argc, char** argv) {
  // Generic BLAS kernels on a CPU OpenBLAS does not know: run again with the right ones.
  if (const std::string core = kvmem::worker::BlasCoreTypeOverride(); !core.empty()) {
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    execv("/proc/self/exe", argv);  // returns only on failure: go on with the generic kernels
  }
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string_view mode = args.size() > 1 ? args[1] : "";
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::fprintf(stderr, "kvmem_worker: --model is required (bash scripts/fetch_model.sh)\n");
    return 2;
  }
  for (const Subcommand& subcommand : kSubcommands) {
    if (subcommand.name == mode) return subcommand.run();
  }
  std::fprintf(stderr, "%s\n", kUsage);
  return 2;
}
