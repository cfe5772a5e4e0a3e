#pragma once
// The two places a worker's KV cache can live: in the worker's own memory (the reference
// the kvmemd path is checked against) and in kvmemd, read in place through the same-host
// mapping of its pool (or over gRPC with ReadKv, the portable path).
#include <memory>
#include <string>
#include <vector>

#include "kvmem/client.h"
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
class KvmemKvStore final : public KvStore {
 public:
  enum class ReadPath { kSharedMemory, kGrpc };
  static absl::StatusOr<std::unique_ptr<KvmemKvStore>> Create(client::Client* client,
                                                              const ModelConfig& config,
                                                              const client::PolicySpec& policy,
                                                              ReadPath path);
  ~KvmemKvStore() override;

  absl::Status BeginForward() override;
  absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) override;
  absl::Status EndForward() override;

  // Appends the new tokens with their per-token signals (chunked to the message limit).
  absl::StatusOr<client::AppendResult> Append(absl::Span<const int64_t> positions,
                                              absl::Span<const int32_t> token_ids,
                                              const ForwardResult& r,
                                              absl::Span<const float> token_entropy);
  uint64_t sequence_id() const { return sequence_.id; }
  const client::PolicySpec& policy() const { return policy_; }
  uint64_t table_epoch() const { return table_.epoch; }
  const client::BlockTable& table() const { return table_; }
  client::Client* client() const { return client_; }
  // Seconds spent fetching block tables (and ReadKv on the gRPC path) so far.
  double table_seconds() const { return table_seconds_; }

 private:
  KvmemKvStore() = default;
  client::Client* client_ = nullptr;
  ModelConfig config_;
  client::Sequence sequence_;
  client::PolicySpec policy_;
  ReadPath path_ = ReadPath::kSharedMemory;
  std::unique_ptr<client::SharedPool> pool_;
  client::BlockTable table_;
  std::vector<client::StreamKv> grpc_kv_;  // kGrpc: this forward's streams
  uint64_t max_message_bytes_ = 0;
  double table_seconds_ = 0;
};

}  // namespace kvmem::worker
