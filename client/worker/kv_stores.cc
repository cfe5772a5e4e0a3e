#include "kv_stores.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvmem::worker {

LocalKvStore::LocalKvStore(const ModelConfig& config) : config_(config) {
  const uint32_t streams = config.num_layers * config.num_kv_heads;
  positions_.resize(streams);
  k_.resize(streams);
  v_.resize(streams);
}

absl::Status LocalKvStore::Past(uint32_t layer, uint32_t kv_head, PastStream* out) {
  const uint32_t s = layer * config_.num_kv_heads + kv_head;
  out->runs.clear();
  out->positions = positions_[s];
  if (!positions_[s].empty()) {
    out->runs.push_back({k_[s].data(), v_[s].data(), static_cast<uint32_t>(positions_[s].size())});
  }
  return absl::OkStatus();
}

void LocalKvStore::Append(absl::Span<const int64_t> positions, const ForwardResult& r) {
  const uint64_t T = positions.size(), D = config_.head_dim;
  for (uint32_t s = 0; s < positions_.size(); ++s) {
    positions_[s].insert(positions_[s].end(), positions.begin(), positions.end());
    k_[s].insert(k_[s].end(), r.k.begin() + s * T * D, r.k.begin() + (s + 1) * T * D);
    v_[s].insert(v_[s].end(), r.v.begin() + s * T * D, r.v.begin() + (s + 1) * T * D);
  }
}

absl::StatusOr<std::unique_ptr<KvmemKvStore>> KvmemKvStore::Create(
    client::Client* client, const ModelConfig& config, const client::PolicySpec& policy,
    client::KvTransport transport, const client::Prompt* prompt, bool in_place) {
  std::unique_ptr<KvmemKvStore> store(new KvmemKvStore());
  store->client_ = client;
  store->config_ = config;
  absl::StatusOr<client::Info> info = client->GetInfo();
  if (!info.ok()) return info.status();
  store->max_message_bytes_ = info->max_message_bytes;
  for (const client::PolicyInfo& p : info->policies) {
    if (p.name == policy.name.value_or("full")) store->policy_info_ = p;
  }
  absl::StatusOr<std::unique_ptr<client::KvPath>> path =
      client::KvPath::Open(client, *info, {transport, in_place && info->in_place_writes});
  if (!path.ok()) return path.status();
  store->path_ = *std::move(path);
  store->pool_ = store->path_->attached();
  store->pool_writable_ = store->pool_ != nullptr && in_place && info->in_place_writes;
  absl::StatusOr<client::Sequence> seq =
      client->CreateSequence(LayoutOf(config), policy, std::nullopt, prompt);
  if (!seq.ok()) return seq.status();
  store->sequence_ = *seq;
  store->policy_ = policy;
  // Attach: the one whole table, without slot positions. The worker appends in position
  // order, so every retained slot precedes the next token whichever the policy kept, and
  // attention needs no positions (K is stored after RoPE); tables without them make smaller
  // updates (an eviction at a stream's head changes every block after it).
  absl::StatusOr<client::BlockTable> table = client->GetBlockTable(seq->id, false);
  if (!table.ok()) return table.status();
  store->table_ = *std::move(table);
  return store;
}

client::Layout KvmemKvStore::LayoutOf(const ModelConfig& config) {
  return client::Layout{
      config.num_layers, config.num_kv_heads, config.head_dim, client::DType::kF32, 16,
      config.vocab};
}

KvmemKvStore::~KvmemKvStore() {
  if (client_ != nullptr && sequence_.id != 0) (void)client_->Release(sequence_.id);
}

bool KvmemKvStore::StepUses(std::string_view signal) const {
  const std::vector<std::string>& s = policy_info_.step_signals;
  return std::find(s.begin(), s.end(), signal) != s.end();
}

bool KvmemKvStore::AppendUses(std::string_view signal) const {
  const std::vector<std::string>& s = policy_info_.append_signals;
  return std::find(s.begin(), s.end(), signal) != s.end();
}

absl::Status KvmemKvStore::Refetch() {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<client::BlockTable> table = client_->GetBlockTable(sequence_.id, table_.positions);
  read_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!table.ok()) return table.status();
  table_ = *std::move(table);
  return absl::OkStatus();
}

absl::Status KvmemKvStore::BeginForward() {
  if (pool_ != nullptr) {
    absl::Status s = pool_->BeginRead(table_);
    if (absl::IsFailedPrecondition(s)) {  // changed by another client: attach again
      if (absl::Status fetched = Refetch(); !fetched.ok()) return fetched;
      s = pool_->BeginRead(table_);
    }
    return s;
  }
  for (int attempt = 0;; ++attempt) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<client::StreamKv>> kv = path_->Read(table_);
    read_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (kv.ok()) {
      copied_kv_ = *std::move(kv);
      return absl::OkStatus();
    }
    // Stale, or changed during the read: once more on a table fetched again.
    const bool stale = absl::IsFailedPrecondition(kv.status()) || absl::IsAborted(kv.status());
    if (attempt > 0 || !stale) return kv.status();
    if (absl::Status fetched = Refetch(); !fetched.ok()) return fetched;
  }
}

absl::Status KvmemKvStore::Past(uint32_t layer, uint32_t kv_head, PastStream* out) {
  const uint32_t s = layer * config_.num_kv_heads + kv_head;
  const uint32_t D = config_.head_dim;
  out->runs.clear();
  out->scratch.clear();
  if (pool_ == nullptr) {
    if (s >= copied_kv_.size()) return absl::InternalError("worker: a stream the read lacks");
    const client::StreamKv& kv = copied_kv_[s];
    out->positions = kv.positions;  // ReadKv's; none from a table fetched without them
    const uint64_t rows = kv.k.size() / (uint64_t{D} * sizeof(float));
    if (kv.k.size() != kv.v.size() || rows * D * sizeof(float) != kv.k.size() ||
        (!kv.positions.empty() && kv.positions.size() != rows)) {
      return absl::InternalError(absl::StrCat("worker: stream ", s, " read as ", kv.k.size(),
                                              " bytes of K and ", kv.v.size(), " of V for ",
                                              kv.positions.size(), " positions"));
    }
    if (rows > 0) {
      out->runs.push_back({reinterpret_cast<const float*>(kv.k.data()),
                           reinterpret_cast<const float*>(kv.v.data()),
                           static_cast<uint32_t>(rows)});
    }
    return absl::OkStatus();
  }
  out->positions.clear();  // the table holds none (see Create)
  absl::StatusOr<std::vector<client::BlockView>> blocks =
      pool_->StreamBlocks(table_, layer, kv_head);
  if (!blocks.ok()) return blocks.status();
  // Quantized blocks are dequantized into scratch first, so that run pointers stay valid.
  uint64_t quantized_slots = 0;
  for (const client::BlockView& b : *blocks) {
    if (b.precision != client::Precision::kLayout) quantized_slots += b.count;
  }
  out->scratch.resize(2 * quantized_slots * D);
  float* scratch = out->scratch.data();
  for (const client::BlockView& b : *blocks) {
    if (b.precision == client::Precision::kLayout) {
      // In place: the pool's own bytes (f32 layout).
      out->runs.push_back(
          {reinterpret_cast<const float*>(b.k), reinterpret_cast<const float*>(b.v), b.count});
      continue;
    }
    float* k = scratch;
    float* v = scratch + uint64_t{b.count} * D;
    client::DequantizeBlock(table_, b, client::DType::kF32, k, v);
    out->runs.push_back({k, v, b.count});
    scratch += 2ull * b.count * D;
  }
  return absl::OkStatus();
}

absl::Status KvmemKvStore::EndForward() {
  if (pool_ == nullptr) return absl::OkStatus();
  return pool_->EndRead(table_);
}

absl::StatusOr<client::AppendResult> KvmemKvStore::Append(absl::Span<const int64_t> positions,
                                                          absl::Span<const int32_t> token_ids,
                                                          const ForwardResult& r,
                                                          absl::Span<const float> token_entropy,
                                                          absl::Span<const float> layer_distance) {
  const uint64_t T = positions.size(), D = config_.head_dim;
  const uint64_t streams = uint64_t{config_.num_layers} * config_.num_kv_heads;
  const uint64_t per_token = 2 * streams * D * 4;
  const uint64_t chunk = std::max<uint64_t>(1, max_message_bytes_ / per_token);
  auto signal = [](absl::Span<const float> s, uint64_t t0, uint64_t n) {
    return s.empty() ? s : s.subspan(t0, n);
  };
  if (T <= chunk || path_->AppendsByUcx(2 * streams * T * D * 4)) {  // K and V as they lie
    const client::AppendArgs args{
        positions,
        token_ids,
        std::string_view(reinterpret_cast<const char*>(r.k.data()), r.k.size() * 4),
        std::string_view(reinterpret_cast<const char*>(r.v.data()), r.v.size() * 4),
        token_entropy,
        layer_distance};
    return path_->Append(sequence_.id, args, &table_);
  }
  // Re-laid [L][H][T][D] as [L][H][n][D] per chunk of n tokens; one stream, all or none.
  std::vector<std::string> k, v;
  std::vector<client::AppendArgs> chunks;
  for (uint64_t t0 = 0; t0 < T; t0 += chunk) {
    const uint64_t n = std::min(chunk, T - t0);
    k.emplace_back(streams * n * D * 4, '\0');
    v.emplace_back(streams * n * D * 4, '\0');
    for (uint64_t s = 0; s < streams; ++s) {
      std::memcpy(k.back().data() + s * n * D * 4, r.k.data() + (s * T + t0) * D, n * D * 4);
      std::memcpy(v.back().data() + s * n * D * 4, r.v.data() + (s * T + t0) * D, n * D * 4);
    }
  }
  for (uint64_t t0 = 0, i = 0; t0 < T; t0 += chunk, ++i) {
    const uint64_t n = std::min(chunk, T - t0);
    chunks.push_back({positions.subspan(t0, n), token_ids.subspan(t0, n), k[i], v[i],
                      signal(token_entropy, t0, n), signal(layer_distance, t0, n)});
  }
  return client_->AppendStream(sequence_.id, chunks, &table_);
}

absl::StatusOr<client::CompressResult> KvmemKvStore::Compress(client::CompressArgs args) {
  args.epoch = table_.epoch;
  return client_->Compress(sequence_.id, args, &table_);
}

client::BatchEntry KvmemKvStore::StepEntry(std::optional<client::AppendArgs> append,
                                           std::optional<client::StepArgs> step,
                                           const client::Client::SignalArea* area,
                                           uint64_t* area_offset) {
  if (step) step->epoch = table_.epoch;
  client::BatchEntry entry{sequence_.id, std::nullopt, std::nullopt, &table_};
  plan_written_ = false;
  if (pool_writable_) {
    entry.plan_tokens = 1;  // the next step's plan
    // A plan is good only on the table it was made on: one changed elsewhere since (and
    // fetched again) would have the daemon refuse the commit.
    if (append && plan_ && plan_version_ == table_.version &&
        append->positions.size() <= plan_->tokens &&
        pool_
            ->WritePlanned(*plan_, table_, static_cast<uint32_t>(append->positions.size()),
                           append->k, append->v)
            .ok()) {
      append->k = {};
      append->v = {};
      entry.written_plan = plan_->plan_id;
      plan_written_ = true;
    }
    if (step && !step->attention.empty() && area != nullptr && area_offset != nullptr &&
        !area->bytes.empty()) {
      absl::StatusOr<uint64_t> written = client::WriteAttentionRows(
          area->bytes, *area_offset, step->attention, step->attention_f16);
      if (written.ok()) {
        step->attention_offset = *area_offset;
        step->attention.clear();
        *area_offset += (*written + 7) / 8 * 8;
        ++area_row_steps_;
      }
    }
  }
  entry.append = std::move(append);
  entry.step = std::move(step);
  return entry;
}

void KvmemKvStore::StepDone(const client::BatchResult& result) {
  if (plan_written_ && (result.status.ok() || result.appended)) ++in_place_steps_;
  // A plan is good for one commit: the one made after this entry, or none.
  plan_ = result.plan;
  plan_version_ = table_.version;  // the call kept the table: it is the plan's
}

}  // namespace kvmem::worker
