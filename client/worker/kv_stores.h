#pragma once
// The two places a worker's KV cache can live: in the worker's own memory (the reference
// the kvmemd path is checked against) and in kvmemd, read in place through the same-host
// mapping of its pool, by UCX from another host, or over gRPC with ReadKv (kvmem/kv_path.h
// chooses).
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvmem/client.h"
#include "kvmem/kv_path.h"
#include "kvmem/shared_pool.h"
#include "model.h"

namespace kvmem::worker {

// Everything in process, f32, never evicts.
class LocalKvStore final : public KvStore {
 public:
  explicit LocalKvStore(const ModelConfig& config);
  absl::Status BeginForward() override { return absl::OkStatus(); }
  absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) override;
  void Append(absl::Span<const int64_t> positions, const ForwardResult& r);
  uint64_t tokens() const { return positions_.empty() ? 0 : positions_[0].size(); }

 private:
  ModelConfig config_;
  std::vector<std::vector<int64_t>> positions_;
  std::vector<std::vector<float>> k_, v_;
};

// The cache in kvmemd. Layout f32 by default so that attention reads layout-precision
// blocks where they lie; quantized blocks are dequantized as they are read.
//
// The block table is fetched once, when the store attaches (Create), and then kept current
// by the updates the daemon answers every mutating call with: Append, Compress and the
// entries of StepBatch carry `&table()`. A forward pass reads the pool in place under that
// table's epoch (attach), or copies every stream by UCX gets or ReadKv; a table found stale
// (another client changed the sequence) is fetched again once. A prompt's K/V goes by UCX
// where the path says so (one message, committed whole), else in Append or AppendStream.
class KvmemKvStore final : public KvStore {
 public:
  // `transport`: kvmem/kv_path.h (kAuto: attach on the same host, else UCX, else gRPC). With
  // `prompt`, the sequence starts with the longest published prefix of it mapped
  // (reused_tokens(); published again as it fills when prompt->auto_publish).
  // `in_place`: on the shared-memory path, against a kvmemd that offers it
  // (--in_place_writes), each decode step's K/V is written into the pool where the last
  // step's write plan says and its attention rows into the step channel's signal area (when
  // one is open), so that its StepBatch entry carries neither.
  static absl::StatusOr<std::unique_ptr<KvmemKvStore>> Create(
      client::Client* client, const ModelConfig& config, const client::PolicySpec& policy,
      client::KvTransport transport, const client::Prompt* prompt = nullptr, bool in_place = false);
  uint64_t reused_tokens() const { return sequence_.reused_prefix_tokens; }
  // The layout the worker's sequences have (f32 K/V, blocks of 16 tokens).
  static client::Layout LayoutOf(const ModelConfig& config);
  ~KvmemKvStore() override;

  absl::Status BeginForward() override;
  absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) override;
  absl::Status EndForward() override;

  // The new tokens of `r` ([L][H][T][D] K and V) with their per-token signals (empty spans:
  // none sent), committed atomically: one Append, or one AppendStream of message-sized
  // chunks. Keeps the table.
  absl::StatusOr<client::AppendResult> Append(absl::Span<const int64_t> positions,
                                              absl::Span<const int32_t> token_ids,
                                              const ForwardResult& r,
                                              absl::Span<const float> token_entropy,
                                              absl::Span<const float> layer_distance);
  // Compress at the table's epoch (args.epoch is set here). Keeps the table.
  absl::StatusOr<client::CompressResult> Compress(client::CompressArgs args);
  // This sequence's entry of a StepBatch: `append` (views that must outlive the call), then
  // `step` at the table's epoch; the table is kept by the call.
  // In place, the K/V goes into the pool now, and the rows into `area` (the batch's signal
  // area, its next free byte at *area_offset) when it holds them; what does not fit a plan
  // or the area goes as message bytes.
  client::BatchEntry StepEntry(std::optional<client::AppendArgs> append,
                               std::optional<client::StepArgs> step,
                               const client::Client::SignalArea* area = nullptr,
                               uint64_t* area_offset = nullptr);
  // Takes the result of the entry StepEntry made: its plan for the next step.
  void StepDone(const client::BatchResult& result);
  bool in_place() const { return pool_writable_; }
  // Steps whose K/V this store wrote in place, and whose rows went in the signal area.
  uint64_t in_place_steps() const { return in_place_steps_; }
  uint64_t area_row_steps() const { return area_row_steps_; }

  // Whether the sequence's policy requires `signal` ("attention_rows", "logit_stats", ...)
  // on every Step, or per appended token (GetInfo's lists for the policy).
  bool StepUses(std::string_view signal) const;
  bool AppendUses(std::string_view signal) const;

  uint64_t sequence_id() const { return sequence_.id; }
  const client::PolicySpec& policy() const { return policy_; }
  const client::BlockTable& table() const { return table_; }
  client::Client* client() const { return client_; }
  // Seconds spent copying K/V out (UCX, ReadKv) and fetching stale tables again so far.
  double read_seconds() const { return read_seconds_; }
  // The transports the store's K/V goes by, and why.
  const client::KvPath& path() const { return *path_; }

 private:
  KvmemKvStore() = default;
  absl::Status Refetch();

  client::Client* client_ = nullptr;
  ModelConfig config_;
  client::Sequence sequence_;
  client::PolicySpec policy_;
  client::PolicyInfo policy_info_;
  std::unique_ptr<client::KvPath> path_;
  client::SharedPool* pool_ = nullptr;  // path_'s mapping (attach), else null
  bool pool_writable_ = false;
  std::optional<client::WritePlan> plan_;  // where the next token goes (in place)
  uint64_t plan_version_ = 0;              // the table version the plan was made on
  bool plan_written_ = false;              // the last entry committed a plan
  uint64_t in_place_steps_ = 0, area_row_steps_ = 0;
  client::BlockTable table_;
  std::vector<client::StreamKv> copied_kv_;  // not attached: this forward's streams
  uint64_t max_message_bytes_ = 0;
  double read_seconds_ = 0;
};

}  // namespace kvmem::worker
