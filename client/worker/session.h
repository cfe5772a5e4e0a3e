#pragma once
// Session: one model run against one cache (a prompt, then a token at a time) and what the
// daemon's policy is told about it. A prompt is appended (one Append or AppendStream) and
// compressed; every decode step is one StepBatch entry that carries the new token with its
// per-token signals and the step's signals, so a generated token costs one call (plus
// ReadKv on the gRPC read path). The block table is never fetched per step: the store keeps
// it from the updates the calls answer with. DecodeBatch steps several sessions, one
// forward pass each, with one StepBatch.
//
// Only the signals the sequence's policy reads are computed and sent (full and window read
// none; confkv reads logit statistics and attention rows on Step).
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv_stores.h"
#include "model.h"

namespace kvmem::worker {

struct SessionOptions {
  // The SnapKV observation window of the prompt's window scores (policies other than h2o
  // and refreekv_h2o, which choose their own).
  uint32_t observation_window = 32;
  // Attention rows go to the daemon as IEEE halves instead of f32.
  bool attention_f16 = false;
  // A prompt of a policy that does not compress it is computed in chunks that end at
  // multiples of this many positions (0: one pass). With the cache's block size, a request
  // that maps a published prefix computes exactly the chunks a cold request computes after
  // it, so its logits are the cold request's to the bit (a matrix product's rounding
  // depends on its row count).
  uint32_t prefill_chunk = 0;
};

class Session {
 public:
  // `daemon` is `store` when the cache is in kvmemd, else null; `store` outlives the session.
  Session(const LlamaModel& model, KvStore& store, KvmemKvStore* daemon,
          SessionOptions options = {});

  // Runs `tokens` at the next positions and commits them (a prompt: append, compress; else
  // the decode step); returns the last token's logits.
  absl::StatusOr<std::vector<float>> Feed(const std::vector<int32_t>& tokens, bool prefill);

  // A prompt appended as it is, never compressed: the question after a shared compressed
  // document (kvpress's protocol: the question is not compressed).
  absl::StatusOr<std::vector<float>> FeedUncompressed(const std::vector<int32_t>& tokens);

  // The first `tokens` positions are in the cache already (a prefix mapped at creation):
  // the next Feed starts after them.
  void SkipMapped(int64_t tokens) { next_position_ = tokens; }

  // What a forward pass must compute for this session's policy.
  ForwardOptions Options(bool prefill) const;

  // Commits a forward pass computed elsewhere (a prompt's, against an empty cache, with at
  // least this session's Options) over `tokens` at the next positions.
  absl::StatusOr<std::vector<float>> Commit(const std::vector<int32_t>& tokens,
                                            const ForwardResult& r, bool prefill);

  // The prompt window scores each policy reads: H2O starts its accumulators from every
  // prompt query's attention; refreekv_h2o uses its `window` parameter (8); the others the
  // SnapKV observation window.
  static uint32_t PrefillWindow(const client::PolicySpec& policy, uint32_t observation_window);

  uint64_t evicted() const { return evicted_; }
  uint64_t kv_bytes() const { return kv_bytes_; }
  double mean_kv_bytes() const { return steps_ > 0 ? kv_bytes_sum_ / steps_ : 0.0; }
  // Mean wall time per decode step spent in daemon calls: the StepBatch that commits it,
  // and ReadKv before its forward pass on the gRPC path (a prompt's reads not counted).
  double daemon_ms_per_step() const;
  // The same time per step, in step order (ms): the first step (the step channel's first
  // batch) and rare slow ones weigh in the mean, so it alone hides what a steady step costs.
  const std::vector<double>& daemon_ms_by_step() const { return daemon_ms_by_step_; }
  int64_t tokens() const { return next_position_; }

 private:
  friend absl::Status DecodeBatch(absl::Span<Session* const> sessions,
                                  absl::Span<const int32_t> tokens,
                                  std::vector<std::vector<float>>* logits);

  // A decode step between its forward pass and the answer to its StepBatch entry. The
  // entry's spans point into this object and into the forward result.
  struct PendingStep {
    std::vector<int64_t> positions;
    std::vector<int32_t> tokens;
    std::vector<float> entropy;
    client::BatchEntry entry;
  };

  std::vector<int64_t> NextPositions(size_t count) const;
  // The entropy signal of `tokens`: the distribution that predicted each one (the
  // sequence's first token gets the mean of the others).
  std::vector<float> TokenEntropy(size_t count, const ForwardResult& r);
  // The step's attention rows (the last query's, over retained slots and the new tokens).
  std::vector<client::StreamSignal> AttentionRows(const ForwardResult& r) const;
  absl::Status CommitPrompt(const std::vector<int32_t>& tokens, const ForwardResult& r);
  // Advances the session over `tokens`; `pending` gets the daemon's entry (its spans point
  // into `pending` and `r`, which must stay where they are until FinishStep).
  // In place (KvmemKvStore::in_place), the step's rows go into `area` from *area_offset.
  void PrepareStep(const std::vector<int32_t>& tokens, const ForwardResult& r, PendingStep* pending,
                   const client::Client::SignalArea* area = nullptr,
                   uint64_t* area_offset = nullptr);
  absl::Status FinishStep(const client::BatchResult& result, double seconds);

  const LlamaModel& model_;
  KvStore& store_;
  KvmemKvStore* daemon_;
  LocalKvStore* local_;
  SessionOptions options_;
  int64_t next_position_ = 0;
  bool compress_prompt_ = true;  // false inside FeedUncompressed
  float last_topk_entropy_ = std::nanf("");
  uint64_t evicted_ = 0;
  uint64_t kv_bytes_ = 0;
  double kv_bytes_sum_ = 0;
  uint64_t steps_ = 0;
  double daemon_seconds_ = 0;
  double read_seconds_counted_ = 0;  // the store's read time counted (in a step, or a prompt's)
  std::vector<double> daemon_ms_by_step_;
};

// A generation that keeps serving when kvmemd does not: every Feed goes to `primary` (a
// session whose cache is in kvmemd) until one fails because kvmemd or the sequence is gone
// (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: down, draining or not answering; NOT_FOUND:
// a restarted kvmemd, or a lapsed lease; DATA_LOSS: the sequence was poisoned). Then the
// cache is rebuilt in process — the same passes again, so that under `full` without a
// mapped prefix the logits are the ones kvmemd's cache gave (with one, as a chunked
// prefill gives them) — and this Feed and every later one runs there. A request is never
// stuck on the cache longer than the client's deadline; the next may use kvmemd again.
class FallbackSession {
 public:
  // `mapped`: the prompt tokens `primary` had mapped from a published prefix (SkipMapped),
  // which the first Feed did not carry; rebuilt with it.
  FallbackSession(const LlamaModel& model, Session* primary, SessionOptions options,
                  std::vector<int32_t> mapped = {})
      : model_(model), primary_(primary), options_(options), mapped_(std::move(mapped)) {}

  absl::StatusOr<std::vector<float>> Feed(const std::vector<int32_t>& tokens, bool prefill);
  // Why it left kvmemd (OK while it has not).
  const absl::Status& fell_back() const { return fell_back_; }

 private:
  const LlamaModel& model_;
  Session* const primary_;
  const SessionOptions options_;
  std::vector<int32_t> mapped_;
  std::vector<std::pair<std::vector<int32_t>, bool>> fed_;  // every Feed that succeeded
  absl::Status fell_back_;
  std::unique_ptr<LocalKvStore> local_;
  std::unique_ptr<Session> local_session_;
};

// Feeds tokens[i] to sessions[i] (one token each), then commits every session's step in one
// StepBatch; (*logits)[i] becomes session i's next-token logits. Daemon sessions only, all
// on one client; the first failing entry's error is returned (later entries still applied).
absl::Status DecodeBatch(absl::Span<Session* const> sessions, absl::Span<const int32_t> tokens,
                         std::vector<std::vector<float>>* logits);

}  // namespace kvmem::worker
