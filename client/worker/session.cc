#include "session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace kvmem::worker {

Session::Session(const LlamaModel& model, KvStore& store, KvmemKvStore* daemon,
                 SessionOptions options)
    : model_(model),
      store_(store),
      daemon_(daemon),
      local_(dynamic_cast<LocalKvStore*>(&store)),
      options_(options) {}

uint32_t Session::PrefillWindow(const client::PolicySpec& policy, uint32_t observation_window) {
  const std::string name = policy.name.value_or("full");
  if (name == "h2o") return std::numeric_limits<uint32_t>::max();
  if (name == "refreekv_h2o") {
    auto it = policy.params.find("window");
    return it != policy.params.end() ? static_cast<uint32_t>(it->second) : 8;
  }
  return observation_window;
}

namespace {

// Whether the prompt is compressed: every policy but full at layout precision (which keeps
// every token as it is) may drop or quantize at Compress.
bool Compresses(const client::PolicySpec& policy) {
  return policy.name.value_or("full") != "full" ||
         policy.quantization != client::Precision::kLayout;
}

}  // namespace

ForwardOptions Session::Options(bool prefill) const {
  ForwardOptions options;
  if (daemon_ == nullptr) return options;
  // Token entropy needs the statistics of every forward pass: a token's entropy is that
  // of the distribution that predicted it, possibly the previous pass's last one.
  options.next_token_stats =
      daemon_->AppendUses("token_entropy") || (!prefill && daemon_->StepUses("logit_stats"));
  options.layer_distance = daemon_->AppendUses("layer_distance");
  if (prefill) {
    // Policies read optional Compress signals when sent (h2o seeds its accumulators from
    // the window scores, confkv its EMA): the prompt's Compress gets both.
    if (compress_prompt_ && Compresses(daemon_->policy())) {
      options.attention_rows = true;
      options.windows = {PrefillWindow(daemon_->policy(), options_.observation_window)};
    }
  } else {
    options.attention_rows = daemon_->StepUses("attention_rows");
  }
  return options;
}

std::vector<int64_t> Session::NextPositions(size_t count) const {
  std::vector<int64_t> positions(count);
  for (size_t i = 0; i < count; ++i) positions[i] = next_position_ + static_cast<int64_t>(i);
  return positions;
}

absl::StatusOr<std::vector<float>> Session::Feed(const std::vector<int32_t>& tokens, bool prefill) {
  const uint32_t chunk = options_.prefill_chunk;
  const bool compresses = daemon_ != nullptr && compress_prompt_ && Compresses(daemon_->policy());
  if (prefill && chunk > 0 && !compresses && tokens.size() > 1) {
    absl::StatusOr<std::vector<float>> logits;
    for (size_t at = 0; at < tokens.size();) {
      const size_t end =
          std::min<size_t>(tokens.size(), at + chunk - static_cast<size_t>(next_position_ % chunk));
      const std::vector<int32_t> piece(tokens.begin() + static_cast<ptrdiff_t>(at),
                                       tokens.begin() + static_cast<ptrdiff_t>(end));
      const std::vector<int64_t> positions = NextPositions(piece.size());
      absl::StatusOr<ForwardResult> r = model_.Forward(piece, positions, store_, Options(true));
      if (!r.ok()) return r.status();
      logits = Commit(piece, *r, true);
      if (!logits.ok()) return logits;
      at = end;
    }
    return logits;
  }
  const std::vector<int64_t> positions = NextPositions(tokens.size());
  absl::StatusOr<ForwardResult> r = model_.Forward(tokens, positions, store_, Options(prefill));
  if (!r.ok()) return r.status();
  return Commit(tokens, *r, prefill);
}

absl::StatusOr<std::vector<float>> FallbackSession::Feed(const std::vector<int32_t>& tokens,
                                                         bool prefill) {
  if (local_session_ == nullptr) {
    absl::StatusOr<std::vector<float>> logits = primary_->Feed(tokens, prefill);
    const absl::StatusCode code = logits.status().code();
    if (logits.ok() ||
        (code != absl::StatusCode::kUnavailable && code != absl::StatusCode::kDeadlineExceeded &&
         code != absl::StatusCode::kCancelled && code != absl::StatusCode::kNotFound &&
         code != absl::StatusCode::kDataLoss)) {
      if (logits.ok()) fed_.emplace_back(tokens, prefill);
      return logits;
    }
    fell_back_ = logits.status();
    local_ = std::make_unique<LocalKvStore>(model_.config());
    local_session_ = std::make_unique<Session>(model_, *local_, nullptr, options_);
    // The mapped prefix as a pass of its own (as the request that published it computed
    // it, chunked alike under --prefill_chunk), then every pass as it ran.
    if (!mapped_.empty()) fed_.insert(fed_.begin(), {mapped_, true});
    for (const auto& [past, past_prefill] : fed_) {
      absl::StatusOr<std::vector<float>> again = local_session_->Feed(past, past_prefill);
      if (!again.ok()) return again.status();
    }
  }
  absl::StatusOr<std::vector<float>> logits = local_session_->Feed(tokens, prefill);
  if (logits.ok()) fed_.emplace_back(tokens, prefill);
  return logits;
}

absl::StatusOr<std::vector<float>> Session::FeedUncompressed(const std::vector<int32_t>& tokens) {
  compress_prompt_ = false;
  absl::StatusOr<std::vector<float>> logits = Feed(tokens, true);
  compress_prompt_ = true;
  return logits;
}

absl::StatusOr<std::vector<float>> Session::Commit(const std::vector<int32_t>& tokens,
                                                   const ForwardResult& r, bool prefill) {
  const uint32_t V = model_.config().vocab;
  std::vector<float> logits(r.logits.end() - V, r.logits.end());
  if (daemon_ == nullptr) {
    const std::vector<int64_t> positions = NextPositions(tokens.size());
    next_position_ += static_cast<int64_t>(tokens.size());
    if (local_ != nullptr) local_->Append(positions, r);
    return logits;
  }
  if (prefill) {
    if (absl::Status s = CommitPrompt(tokens, r); !s.ok()) return s;
    return logits;
  }
  PendingStep pending;
  const client::Client::SignalArea area = daemon_->client()->signal_area();
  uint64_t area_offset = 0;
  PrepareStep(tokens, r, &pending, &area, &area_offset);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<client::BatchResult>> results =
      daemon_->client()->StepBatch(absl::MakeConstSpan(&pending.entry, 1));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!results.ok()) return results.status();
  if (absl::Status s = FinishStep((*results)[0], seconds); !s.ok()) return s;
  return logits;
}

std::vector<float> Session::TokenEntropy(size_t count, const ForwardResult& r) {
  if (r.next_token_stats.empty()) return {};
  std::vector<float> entropy(count);
  for (size_t i = 0; i < count; ++i) {
    entropy[i] = i == 0 ? last_topk_entropy_ : r.next_token_stats[i - 1].topk_entropy;
  }
  if (std::isnan(entropy[0])) {
    double sum = 0;
    for (size_t i = 1; i < count; ++i) sum += entropy[i];
    entropy[0] = count > 1 ? static_cast<float>(sum / static_cast<double>(count - 1)) : 0.0f;
  }
  last_topk_entropy_ = r.next_token_stats.back().topk_entropy;
  return daemon_->AppendUses("token_entropy") ? entropy : std::vector<float>{};
}

std::vector<client::StreamSignal> Session::AttentionRows(const ForwardResult& r) const {
  std::vector<client::StreamSignal> rows(r.attention_rows.size());
  const uint32_t H = model_.config().num_kv_heads;
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = {static_cast<uint32_t>(i / H), static_cast<uint32_t>(i % H), r.attention_rows[i]};
  }
  return rows;
}

absl::Status Session::CommitPrompt(const std::vector<int32_t>& tokens, const ForwardResult& r) {
  const std::vector<int64_t> positions = NextPositions(tokens.size());
  next_position_ += static_cast<int64_t>(tokens.size());
  const std::vector<float> entropy = TokenEntropy(tokens.size(), r);
  const absl::Span<const float> distance = daemon_->AppendUses("layer_distance")
                                               ? absl::MakeConstSpan(r.layer_distance)
                                               : absl::Span<const float>();
  absl::StatusOr<client::AppendResult> appended =
      daemon_->Append(positions, tokens, r, entropy, distance);
  if (!appended.ok()) return appended.status();
  read_seconds_counted_ = daemon_->read_seconds();  // a prompt's reads are no decode step's
  kv_bytes_ = appended->kv_bytes;
  if (!compress_prompt_ || !Compresses(daemon_->policy())) return absl::OkStatus();
  const uint32_t window = PrefillWindow(daemon_->policy(), options_.observation_window);
  const WindowScores* scores = nullptr;
  for (const WindowScores& ws : r.window_scores) {
    if (ws.window == window) scores = &ws;
  }
  if (scores == nullptr || r.attention_rows.empty()) {
    return absl::InternalError("prefill: the forward pass has no signals for Compress");
  }
  client::CompressArgs args;
  args.attention = AttentionRows(r);
  for (size_t i = 0; i < args.attention.size(); ++i) {
    args.window_scores.push_back(
        {args.attention[i].layer, args.attention[i].kv_head, scores->streams[i]});
  }
  absl::StatusOr<client::CompressResult> c = daemon_->Compress(std::move(args));
  if (!c.ok()) return c.status();
  evicted_ += c->evicted_tokens;
  kv_bytes_ = c->kv_bytes_after;
  return absl::OkStatus();
}

void Session::PrepareStep(const std::vector<int32_t>& tokens, const ForwardResult& r,
                          PendingStep* pending, const client::Client::SignalArea* area,
                          uint64_t* area_offset) {
  pending->positions = NextPositions(tokens.size());
  pending->tokens = tokens;
  next_position_ += static_cast<int64_t>(tokens.size());
  pending->entropy = TokenEntropy(tokens.size(), r);
  const client::AppendArgs append{
      pending->positions,
      pending->tokens,
      std::string_view(reinterpret_cast<const char*>(r.k.data()), r.k.size() * sizeof(float)),
      std::string_view(reinterpret_cast<const char*>(r.v.data()), r.v.size() * sizeof(float)),
      pending->entropy,
      daemon_->AppendUses("layer_distance") ? absl::MakeConstSpan(r.layer_distance)
                                            : absl::Span<const float>()};
  client::StepArgs step;
  if (daemon_->StepUses("logit_stats")) {
    const LogitSummary& s = r.next_token_stats.back();
    step.logit_stats = client::LogitStats{s.entropy, s.p1, s.p2, {}};
  }
  step.attention = AttentionRows(r);  // empty unless the policy reads them
  step.attention_f16 = options_.attention_f16;
  pending->entry = daemon_->StepEntry(append, std::move(step), area, area_offset);
}

absl::Status Session::FinishStep(const client::BatchResult& result, double seconds) {
  daemon_->StepDone(result);
  if (!result.status.ok()) return result.status;
  if (!result.step) return absl::InternalError("StepBatch: an entry without its step's result");
  // The step's call, and the reads since the last step (ReadKv before its forward pass).
  const double read_seconds = daemon_->read_seconds();
  const double step_seconds = seconds + read_seconds - read_seconds_counted_;
  read_seconds_counted_ = read_seconds;
  daemon_seconds_ += step_seconds;
  daemon_ms_by_step_.push_back(1e3 * step_seconds);
  evicted_ += result.step->evicted_tokens;
  kv_bytes_ = result.step->kv_bytes_after;
  kv_bytes_sum_ += static_cast<double>(result.step->kv_bytes_after);
  ++steps_;
  return absl::OkStatus();
}

double Session::daemon_ms_per_step() const {
  if (steps_ == 0 || daemon_ == nullptr) return 0.0;
  return 1e3 * daemon_seconds_ / static_cast<double>(steps_);
}

absl::Status DecodeBatch(absl::Span<Session* const> sessions, absl::Span<const int32_t> tokens,
                         std::vector<std::vector<float>>* logits) {
  if (sessions.size() != tokens.size()) {
    return absl::InvalidArgumentError("DecodeBatch: one token per session");
  }
  logits->assign(sessions.size(), {});
  if (sessions.empty()) return absl::OkStatus();
  // Reserved whole: entries point into the pending steps and the forward results.
  std::vector<ForwardResult> forwards(sessions.size());
  std::vector<Session::PendingStep> pending(sessions.size());
  std::vector<client::BatchEntry> entries;
  entries.reserve(sessions.size());
  const uint32_t V = sessions[0]->model_.config().vocab;
  // One signal area for the batch: each entry's rows after the last's.
  const client::Client::SignalArea area = sessions[0]->daemon_->client()->signal_area();
  uint64_t area_offset = 0;
  for (size_t i = 0; i < sessions.size(); ++i) {
    Session& s = *sessions[i];
    if (s.daemon_ == nullptr || s.daemon_->client() != sessions[0]->daemon_->client()) {
      return absl::InvalidArgumentError("DecodeBatch: sessions of one kvmemd client only");
    }
    const std::vector<int32_t> token = {tokens[i]};
    absl::StatusOr<ForwardResult> r =
        s.model_.Forward(token, s.NextPositions(1), s.store_, s.Options(false));
    if (!r.ok()) return r.status();
    forwards[i] = *std::move(r);
    (*logits)[i].assign(forwards[i].logits.end() - V, forwards[i].logits.end());
    s.PrepareStep(token, forwards[i], &pending[i], &area, &area_offset);
    entries.push_back(pending[i].entry);
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<client::BatchResult>> results =
      sessions[0]->daemon_->client()->StepBatch(entries);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!results.ok()) return results.status();
  absl::Status first_error;
  for (size_t i = 0; i < sessions.size(); ++i) {
    absl::Status s = sessions[i]->FinishStep((*results)[i], seconds);
    if (!s.ok() && first_error.ok()) first_error = s;
  }
  return first_error;
}

}  // namespace kvmem::worker
