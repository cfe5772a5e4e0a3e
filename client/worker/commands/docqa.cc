// kvmem_worker docqa: questions over one document, every request's sequence held until all
// have answered (as if asked at once). --doc_mode says how the document's cache is made:
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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "commands/commands.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, questions_file, "", "docqa: one question per line");
ABSL_FLAG(uint32_t, document_tokens, 0, "docqa: cut the document to this many tokens (0 = all)");
ABSL_FLAG(std::string, doc_mode, "plain",
          "docqa: plain (each request prefills document and question, no sharing), prefix "
          "(full cache, the document's published blocks mapped), compress (each request "
          "compresses document and question with --policy), document (the document compressed "
          "once with --policy and shared; questions appended uncompressed), private_document "
          "(each request compresses the document itself, then appends its question)");

namespace kvmem::worker {

int RunDocQa() {
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
    absl::StatusOr<client::KvTransport> transport = TransportFromFlags();
    if (!transport.ok()) return Fail("create", transport.status());
    absl::StatusOr<std::unique_ptr<KvmemKvStore>> store =
        KvmemKvStore::Create(c->get(), env.model->config(), *policy, *transport,
                             with_prompt ? &prompt : nullptr, InPlaceFromFlags());
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
    nlohmann::ordered_json line;
    line["question"] = questions[i];
    line["prompt_tokens"] = r.ids.size();
    line["document_tokens"] = head.size();
    line["reused"] = r.reused;
    line["ttft_ms"] = std::round(r.ttft_ms * 10) / 10;  // to 0.1 ms
    line["kv_bytes"] = r.session->kv_bytes();
    line["answer"] = r.answer;
    PrintJsonLine(line);
  }
  nlohmann::ordered_json totals;
  totals["mode"] = mode;
  totals["policy"] = policy->name.value_or("full");
  totals["requests"] = requests.size();
  totals["pool_used_bytes"] = stats->pool_used_bytes;
  totals["blocks_used"] = stats->blocks_used;
  totals["kv_bytes_sum"] = kv_bytes;
  PrintJsonLine(totals);
  return 0;
}

}  // namespace kvmem::worker
