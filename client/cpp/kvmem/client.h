#pragma once
// libkvmem_client: a typed C++ client for kvmemd. No protobuf or gRPC type appears here.
//
// Every call carries a deadline (ClientOptions::deadline) and is retried by gRPC's retry
// policy (the channel's service config, exponential backoff) while the daemon answers
// UNAVAILABLE. Mutating calls carry a fresh request_id per call, the same on every retry,
// so that a retry of a call the daemon had applied returns its first answer instead of
// applying it twice. Errors are the daemon's gRPC status as absl::Status, message unchanged,
// with the daemon's google.rpc error details as payloads (below).
//
// Fields that are std::optional are left to the daemon's default when unset; an explicit
// value that is not valid (0 tokens, a lease of 0) is INVALID_ARGUMENT, never the default.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvmem/attach.h"

namespace kvmem::v1 {
class AppendRequest;
}  // namespace kvmem::v1

namespace kvmem::client {

// Payloads of a failed call's absl::Status (absl::Status::GetPayload). Every google.rpc
// detail the daemon sent is there serialized under its type URL (for instance
// "type.googleapis.com/google.rpc.BadRequest"); what they say is also there as text:
// - INVALID_ARGUMENT, OUT_OF_RANGE: the request's field path ("layout.block_tokens");
inline constexpr char kFieldPayload[] = "kvmem/field";
// - a stale epoch (FAILED_PRECONDITION, ABORTED): the sequence's current epoch and, where the
//   daemon knows it, its current table version, decimal;
inline constexpr char kCurrentEpochPayload[] = "kvmem/current_epoch";
inline constexpr char kCurrentVersionPayload[] = "kvmem/current_version";
// - RESOURCE_EXHAUSTED: the kvmemd flag that sets the limit ("--max-sequences").
inline constexpr char kLimitPayload[] = "kvmem/limit";

// The current epoch a stale-epoch error reports (kCurrentEpochPayload), if it does.
std::optional<uint64_t> CurrentEpoch(const absl::Status& status);

enum class DType { kF16 = 1, kBF16 = 2, kF32 = 3 };
uint32_t DTypeBytes(DType dtype);

struct Layout {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kF16;
  // Tokens per block; unset: the daemon's default (always set in a BlockTable's layout).
  std::optional<uint32_t> block_tokens = std::nullopt;
  uint32_t vocab_size = 0;
};

// Storage precision of a block.
enum class Precision { kLayout = 1, kInt8 = 2, kInt4 = 3, kNF4 = 4 };

struct PolicySpec {
  std::optional<std::string> name = std::nullopt;  // unset: "full"
  std::map<std::string, double> params;
  Precision quantization = Precision::kLayout;  // kLayout: never quantize
  // Tokens at each stream's end kept unquantized; unset: the daemon's default (128).
  std::optional<uint32_t> quantization_recent_tokens = std::nullopt;
};

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(30);  // per call, retries included
  int max_attempts = 5;                         // on UNAVAILABLE; gRPC allows at most 5
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // Calls made while the daemon is unreachable wait for it (up to the deadline) instead of
  // failing at once: for a sidecar that may still be starting.
  bool wait_for_ready = false;
  // A step channel that closes (a daemon restarted or drained) is opened again by a later
  // StepBatch after this long (at least 1 ms), then after twice as long after each attempt
  // whose channel answers no batch, up to a minute; until then batches go by gRPC.
  // absl::InfiniteDuration(): never. CloseStepChannel stops it.
  absl::Duration step_channel_reopen = absl::Seconds(1);
  // The bearer token of a kvmemd started with --auth-tokens, sent with every call
  // (metadata 'authorization: Bearer <token>'); empty: none.
  std::string auth_token;
  // TLS (PEM text): set tls_root_certs to verify a kvmemd started with --tls-cert; the
  // chain and key are this client's certificate (kvmemd --tls-client-ca: its common name
  // is the tenant). tls_server_name: the name to verify instead of the target's host.
  std::string tls_root_certs, tls_cert_chain, tls_private_key, tls_server_name;
};

struct ParamInfo {
  std::string name;
  double default_value = 0, min_value = 0, max_value = 0;
  std::string description;
};

struct PolicyInfo {
  std::string name;
  std::string description;
  std::vector<ParamInfo> params;
  std::vector<std::string> step_signals;
  std::vector<std::string> compress_signals;
  std::vector<std::string> append_signals;
};

struct QuantizerInfo {
  Precision precision = Precision::kLayout;
  std::string name, description;
};

struct Info {
  std::string version, backend, device_name;
  uint64_t pool_bytes = 0, pool_free_bytes = 0, page_bytes = 0;
  uint32_t default_block_tokens = 0, max_sequences = 0;
  absl::Duration default_lease, max_lease;  // whole seconds
  uint64_t max_message_bytes = 0;
  bool device_step = false;  // confkv/confkv_l/h2o steps run in the backend (kvmemd --device_step)
  bool in_place_writes = false;  // StepBatch hands out write plans (kvmemd --in_place_writes)
  std::vector<PolicyInfo> policies;
  std::vector<QuantizerInfo> quantizers;
  uint32_t default_quantization_recent_tokens = 0;
  // The pool's export, at most one of the two: the CPU backend's shared-memory segment
  // (kvmem/shared_pool.h maps it; 0 bytes: the pool is not one) or the CUDA backend's IPC
  // handle.
  uint64_t shm_bytes = 0;
  // What the pool's descriptor maps: pool bytes [shm_piece_offset, + shm_piece_bytes), the
  // whole pool unless kvmemd cuts it into tenant arenas (a tenant's arena, or the shared
  // part: SharedMemoryPool in kvmem.proto).
  uint64_t shm_piece_offset = 0, shm_piece_bytes = 0;
  // CUDA backend: the pool's cudaIpcMemHandle_t bytes (empty otherwise), its device's UUID,
  // the mapped size (kvmem/cuda_pool.h opens it).
  std::string cuda_ipc_handle, cuda_device_uuid;
  uint64_t cuda_pool_bytes = 0;
  uint32_t epoch_stride = 0, epoch_slots = 0;  // 0 slots: no epoch board offered
  // The table area (kvmem/table_area.h); 0 bytes: the daemon keeps none.
  uint64_t table_area_bytes = 0;
  uint32_t table_area_slots = 0;
  // The key to the pool's segment, the epoch board and the table area (kvmem/attach.h);
  // empty when same-host attach is not offered to this caller. Valid for a minute or so:
  // attach soon after GetInfo.
  SegmentTicket attach;
  // kvmemd's UCX worker and the remote keys of its pool and epoch board (kvmem/ucx_pool.h
  // reads by RMA); empty worker_address when not offered to this caller.
  struct Ucx {
    std::string worker_address, pool_rkey, epoch_board_rkey;
    uint64_t pool_address = 0, pool_bytes = 0, epoch_board_address = 0;
    std::string append_worker_address;  // remote appends (kvmem/ucx_sender.h): every caller
    uint64_t max_payload_bytes = 0;     // the largest such append's K/V (0: not said)
  } ucx;
  // Random at each start of kvmemd (0 from an older one): another means a restart, and
  // what was mapped from the one before is stale.
  uint64_t instance_id = 0;
};

struct Sequence {
  uint64_t id = 0;
  absl::Duration lease;       // granted, whole seconds
  uint32_t block_tokens = 0;  // 0 for a Fork's child: its parent's
  uint32_t epoch_slot = 0;
  uint64_t epoch = 0;  // the table's epoch
  // The table's version. A Fork's child starts at its parent's: a parent's BlockTable whose
  // version equals it may be carried over to the child (with the child's id, epoch and
  // epoch_slot) and kept from the child's updates; otherwise attach with GetBlockTable.
  uint64_t table_version = 0;
  // Prompt tokens mapped from published blocks (Prompt): the sequence holds them at
  // positions 0 .. reused_prefix_tokens - 1; append the rest of the prompt after them.
  uint64_t reused_prefix_tokens = 0;
};

// A new sequence's prompt, for prefix sharing (CreateSequence): its longest published
// prefix in the same model, layout and salt is mapped in, in whole blocks, never the last
// token.
struct Prompt {
  std::vector<int32_t> token_ids;
  std::string cache_salt;     // the tenant's: only prompts with the same salt share
  std::string model;          // with the layout, the namespace of the block hashes
  bool auto_publish = false;  // publish every full block as it is appended
  // The first document_tokens of token_ids are a document that may have been published
  // compressed under the new sequence's policy (PublishDocument): mapped whole if so.
  uint32_t document_tokens = 0;
};

// n new tokens. k and v are [L][H][n][D] in the layout dtype.
// An Append's K/V sent by UCX instead of in the request (AppendRequest.ucx_payload; kvmem/
// ucx_sender.h draws it and sends the message).
struct UcxTransfer {
  uint64_t transfer_hi = 0, transfer_lo = 0;
  uint64_t bytes = 0;  // K + V
};

struct AppendArgs {
  absl::Span<const int64_t> positions;
  absl::Span<const int32_t> token_ids;
  std::string_view k;
  std::string_view v;
  absl::Span<const float> token_entropy;
  absl::Span<const float> layer_distance;
};

struct AppendResult {
  uint64_t appended_tokens = 0;
  uint32_t max_stream_tokens = 0;
  uint64_t epoch = 0;
  uint64_t kv_bytes = 0;
  uint64_t table_version = 0;
};

struct LogitStats {
  float entropy = 0, p1 = 0, p2 = 0;
  std::vector<float> top_logprobs;
};

struct StreamSignal {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  std::vector<float> values;
};

struct StepArgs {
  uint64_t epoch = 0;
  std::optional<LogitStats> logit_stats;
  std::vector<StreamSignal> attention;
  // Send the attention rows as IEEE halves (half the bytes; ~3 significant digits).
  bool attention_f16 = false;
  // StepBatch through a step channel with a signal area (OpenStepChannel's signal_bytes):
  // the rows are in the area at this offset (WriteAttentionRows), `attention` is not sent.
  std::optional<uint64_t> attention_offset = std::nullopt;
};

// Writes `rows` into a step channel's signal area at `offset` (the layout of step_channel.h's
// signal_area), as halves when `f16`; returns the bytes written. INVALID_ARGUMENT when they
// do not fit.
absl::StatusOr<uint64_t> WriteAttentionRows(absl::Span<uint8_t> area, uint64_t offset,
                                            const std::vector<StreamSignal>& rows, bool f16);

// Where a sequence's next tokens go, to write their K/V into the pool in place (kvmemd
// --in_place_writes; WritePlan in kvmem.proto): token i of stream s at slot
// first_slots[s] + i of the block at pool offset block_offsets[s].
struct WritePlan {
  uint64_t plan_id = 0;
  uint32_t tokens = 0;
  std::vector<uint64_t> block_offsets;
  std::vector<uint32_t> first_slots;
};

struct StepResult {
  double confidence = 0;  // NaN when the policy computes none
  // Per-stream budget chosen this step; unset when the policy set no bound.
  std::optional<uint32_t> budget_tokens = std::nullopt;
  uint64_t evicted_tokens = 0, quantized_tokens = 0;
  uint64_t kv_bytes_before = 0, kv_bytes_after = 0;
  uint64_t epoch = 0, step = 0;
  uint64_t table_version = 0;
};

struct CompressArgs {
  uint64_t epoch = 0;
  // Per-stream target, at least 1; unset: the policy's own rule.
  std::optional<uint32_t> target_tokens = std::nullopt;
  std::vector<StreamSignal> window_scores;
  std::vector<StreamSignal> attention;
};

struct LayerKept {
  uint32_t layer = 0;
  uint64_t kept_tokens = 0, before_tokens = 0;
};

struct CompressResult {
  std::vector<LayerKept> layers;
  uint64_t evicted_tokens = 0, quantized_tokens = 0;
  uint64_t kv_bytes_before = 0, kv_bytes_after = 0, epoch = 0;
  uint64_t table_version = 0;
};

// One block of a stream: its live slots are [start, start + count).
struct TableBlock {
  uint32_t id = 0;
  uint64_t offset = 0;  // bytes into the pool
  uint32_t start = 0;
  uint32_t count = 0;
  Precision precision = Precision::kLayout;
};

struct StreamTable {
  uint32_t layer = 0, kv_head = 0;
  std::vector<TableBlock> blocks;
  std::vector<int64_t> positions;  // retained original positions, in block then slot order
};

// A sequence's block table. A client keeps one current without fetching it again: pass it
// to the calls that change the sequence (Append, AppendStream, Step, Compress, StepBatch),
// which send its version and apply the update the daemon answers with (the streams that
// changed, or the whole table when the version held was too old). GetBlockTable is for
// attaching and recovery.
struct BlockTable {
  uint64_t sequence_id = 0, epoch = 0;
  uint64_t version = 0;    // 0: none held yet (the next update is the whole table)
  bool positions = false;  // StreamTable::positions are kept (asked for)
  uint32_t block_tokens = 0;
  uint64_t block_bytes = 0;
  Layout layout;
  uint32_t epoch_slot = 0;
  Precision quantization = Precision::kLayout;
  uint64_t quantized_block_bytes = 0;
  std::vector<StreamTable> streams;  // index = layer * H + kv_head
};

// One sequence's decode step in a StepBatch: its new token(s), then the step.
struct BatchEntry {
  uint64_t sequence_id = 0;
  std::optional<AppendArgs> append;  // unset: only the step
  std::optional<StepArgs> step;      // unset: only the append; rows cover the new tokens too
  BlockTable* table = nullptr;       // kept current when set (see BlockTable)
  // The append's K/V was written in place at this plan (its k and v are then empty).
  uint64_t written_plan = 0;
  // Set: the result carries a plan for this many next tokens (an entry may ask only that).
  uint32_t plan_tokens = 0;
};

// What one entry did: the append and the step are each atomic; a step that failed after
// its append applied leaves `appended` set and `status` the step's error.
struct BatchResult {
  absl::Status status;
  std::optional<AppendResult> appended;
  std::optional<StepResult> step;
  // When plan_tokens was set: the plan, or plan_status says why there is none.
  std::optional<WritePlan> plan;
  absl::Status plan_status;
};

// Layers [begin, end), begin < end <= num_layers.
struct LayerRange {
  uint32_t begin = 0, end = 0;
};

// Client::PullPrefix's options and answer.
struct PullOptions {
  std::string from_node;    // the holder to pull from; empty: the one the fleet's index names
  std::string transport;    // "attach", "ucx", "grpc"; empty: the first kvmemd can
  uint64_t min_tokens = 0;  // pull only a gain of at least this many tokens
};
struct Pulled {
  uint64_t local_tokens = 0;   // what kvmemd held before
  uint64_t pulled_tokens = 0;  // pulled and published (0: nothing, or not worth it)
  uint64_t holder_tokens = 0;  // what the holder had
  uint64_t bytes = 0;          // K+V bytes moved
  std::string from_node, transport;
};

struct StreamKv {
  uint32_t layer = 0, kv_head = 0;
  uint64_t epoch = 0;
  std::vector<int64_t> positions;
  std::string k, v;  // [n][D] each, layout dtype
};

struct SequenceStats {
  uint64_t sequence_id = 0;
  std::string policy;
  uint64_t appended_tokens = 0;
  uint32_t max_stream_tokens = 0;
  uint64_t kv_bytes = 0, blocks = 0, epoch = 0, steps = 0;
  absl::Duration lease_remaining;                    // zero once lapsed
  std::optional<uint64_t> parent_id = std::nullopt;  // set for a Fork's child
  uint64_t pool_bytes_held = 0;
  std::string quantization;
  uint64_t slot_state_bytes = 0;  // scores/positions in the backend (device memory on CUDA)
};

// Since the daemon started, per policy. Tokens are a sequence's positions; stream slots
// are tokens times the streams they were taken from (tokens = stream slots / streams).
struct PolicyCounters {
  std::string policy;
  uint64_t tokens_appended = 0;
  double tokens_evicted = 0, tokens_quantized = 0;
  uint64_t stream_slots_evicted = 0, stream_slots_quantized = 0;
  uint64_t steps = 0;
};

struct Stats {
  uint64_t pool_bytes = 0, pool_used_bytes = 0, pool_free_bytes = 0;
  uint64_t pages_total = 0, pages_used = 0, blocks_used = 0;
  uint32_t sequences_active = 0;
  uint64_t sequences_created = 0;
  uint64_t tokens_appended = 0;
  double tokens_evicted = 0, tokens_quantized = 0;
  uint64_t stream_slots_evicted = 0, stream_slots_quantized = 0;
  std::vector<PolicyCounters> policies;
  // The sequences held now: K/V bytes of their tables, and a full cache's for their tokens.
  uint64_t kv_bytes = 0, full_cache_bytes = 0;
  uint64_t steps = 0, leases_expired = 0;
  uint64_t slot_state_bytes = 0;  // all sequences' scores/positions in the backend
  uint64_t host_metadata_bytes = 0, host_metadata_budget_bytes = 0;  // outside the pool
  // The table area: its heap, what the tables take of it, writes that found no room.
  uint64_t table_area_heap_bytes = 0, table_area_used_bytes = 0, table_area_misses = 0;
  uint64_t sequences_poisoned = 0;  // failed past a point of no return (DATA_LOSS)
  // Blocks (and bytes) a move kept out of circulation for good (a get abandoned in flight).
  uint64_t blocks_forsaken = 0, bytes_forsaken = 0;
  // Tenant arenas (kvmemd --tenant-arena): every one to an admin, a tenant's own to it.
  struct Arena {
    std::string tenant;
    uint64_t bytes = 0, free_bytes = 0;
  };
  std::vector<Arena> arenas;
  // Prefix sharing: counters since the daemon started, then the index now.
  uint64_t prefix_queries = 0, prefix_hits = 0, prefix_reused_tokens = 0;
  uint64_t prefix_reclaimed_bytes = 0;
  uint64_t prefix_entries = 0, prefix_indexed_blocks = 0, prefix_cached_blocks = 0;
  std::vector<SequenceStats> sequences;  // in id order
};

// The token in a token file (its first line, surrounding spaces dropped): for a
// --auth-token-file flag, which keeps the token off command lines.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

class Client {
 public:
  // target: "host:port" or "unix:path". Connecting is lazy; the first call waits for it.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  absl::StatusOr<Info> GetInfo();
  // `lease` unset: the daemon's --lease-seconds.
  absl::StatusOr<Sequence> CreateSequence(const Layout& layout, const PolicySpec& policy,
                                          std::optional<absl::Duration> lease = std::nullopt,
                                          const Prompt* prompt = nullptr);
  // `table`, when set, is kept current (see BlockTable).
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, const AppendArgs& args,
                                      BlockTable* table = nullptr);
  // The same with args' k and v left out of the request: `ucx_payload` announces them as a
  // UCX message (kvmem/ucx_sender.h sends it).
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, const AppendArgs& args,
                                      const UcxTransfer& ucx_payload, BlockTable* table = nullptr);
  // One client stream of chunks; the daemon applies them all or none.
  absl::StatusOr<AppendResult> AppendStream(uint64_t sequence_id,
                                            absl::Span<const AppendArgs> chunks,
                                            BlockTable* table = nullptr);
  // Signals the sequence's policy does not use are not sent (for sequences this client
  // created or forked: GetInfo lists each policy's signals).
  absl::StatusOr<StepResult> Step(uint64_t sequence_id, const StepArgs& args,
                                  BlockTable* table = nullptr);
  // The decode loop's call: every entry's append and step in one round trip; one result
  // per entry, in order. An entry's error fails only that entry; the call itself fails
  // only when the batch as a whole is malformed (a sequence twice) or does not arrive.
  absl::StatusOr<std::vector<BatchResult>> StepBatch(absl::Span<const BatchEntry> entries);
  // The same-host fast path: from now on StepBatch goes through a shared-memory channel
  // (the same messages without gRPC's transport) instead of a gRPC call. Fails, changing
  // nothing, when the daemon is on another host or refuses (its limits); a channel that
  // closes later (a drain, a daemon restart) is dropped and StepBatch goes by gRPC again,
  // repeating the batch in flight under its request_id, and a later StepBatch opens it
  // again (ClientOptions::step_channel_reopen). `capacity_bytes`: each direction's area,
  // 8 MiB unless set; a batch or response larger goes by gRPC.
  // `signal_bytes`: a signal area with the channel, for attention rows written in place
  // (StepArgs::attention_offset; SignalArea).
  absl::Status OpenStepChannel(std::optional<uint64_t> capacity_bytes = std::nullopt,
                               uint64_t signal_bytes = 0);
  // The same-host table path: from now on StepBatch keeps an entry's table (one held, not
  // asking for positions) current from the daemon's table area (kvmemd --table_area_bytes),
  // told only its new version, instead of receiving and applying the update; where the
  // area has moved on or holds none, the table is fetched. Fails, changing nothing, when the
  // daemon keeps no area or is on another host.
  absl::Status AttachTableArea();
  // The open channel's signal area, mapped writable, and what keeps it mapped (hold it while
  // writing); empty when no channel with one is open. A reopened channel has a new area.
  struct SignalArea {
    std::shared_ptr<const void> keep;
    absl::Span<uint8_t> bytes;
  };
  SignalArea signal_area() const;
  void CloseStepChannel();
  bool step_channel_open() const;
  // Batches answered through a step channel since Connect.
  uint64_t step_channel_batches() const;
  absl::StatusOr<CompressResult> Compress(uint64_t sequence_id, const CompressArgs& args,
                                          BlockTable* table = nullptr);
  // The whole table (positions when asked for): to attach to a sequence, or to recover.
  absl::StatusOr<BlockTable> GetBlockTable(uint64_t sequence_id, bool positions = true);
  // How often a kept table could not take its update (another caller changed the sequence
  // meanwhile, or the update did not check out) and was fetched again whole.
  uint64_t table_refetches() const;
  // Tables StepBatch brought current from the table area (AttachTableArea).
  uint64_t table_area_reads() const;
  // Retained K/V of `layers` (unset: all), if the table is at `epoch` (unset: the current
  // one); one StreamKv per stream, layer-major (the daemon's pieces of a stream joined).
  // FAILED_PRECONDITION when the table is not at `epoch`; ABORTED when it changed during
  // the read (another caller appended, stepped or compressed): read again.
  absl::StatusOr<std::vector<StreamKv>> ReadKv(uint64_t sequence_id,
                                               std::optional<uint64_t> epoch = std::nullopt,
                                               std::optional<LayerRange> layers = std::nullopt);
  // A copy-on-write child; `lease` unset: the daemon's --lease-seconds.
  absl::StatusOr<Sequence> Fork(uint64_t sequence_id,
                                std::optional<absl::Duration> lease = std::nullopt);
  absl::StatusOr<uint64_t> Release(uint64_t sequence_id);  // freed blocks
  // Renews each id's lease; one status per id, in order (OK, NOT_FOUND, DATA_LOSS). At most
  // GetInfo's max_sequences ids a call (INVALID_ARGUMENT beyond).
  absl::StatusOr<std::vector<absl::Status>> KeepAlive(absl::Span<const uint64_t> sequence_ids);
  // The daemon's counters and, with include_sequences, every sequence: the daemon answers
  // in pages, gathered here (counters as of the first page; a sequence created or released
  // meanwhile may or may not be listed, none twice).
  absl::StatusOr<Stats> GetStats(bool include_sequences);
  // Publishes the sequence's leading whole blocks (up to `up_to_tokens`; unset: all) for
  // later sequences with the same prompt prefix; returns the tokens it has published.
  absl::StatusOr<uint64_t> Publish(uint64_t sequence_id,
                                   std::optional<uint64_t> up_to_tokens = std::nullopt);
  // Publishes the sequence's whole cache, just compressed, as a shared compressed document
  // (Prompt::document_tokens); returns its tokens.
  absl::StatusOr<uint64_t> PublishDocument(uint64_t sequence_id);
  // How many tokens of the prompt a CreateSequence with `policy` would reuse now (pins
  // nothing).
  absl::StatusOr<uint64_t> Lookup(const Layout& layout, const Prompt& prompt,
                                  const PolicySpec& policy = {});
  // Makes kvmemd hold the longest prefix of the prompt another node of its fleet holds
  // (kvmemd --cluster-index), which the next CreateSequence with the prompt maps.
  absl::StatusOr<Pulled> PullPrefix(const Layout& layout, const Prompt& prompt,
                                    const PullOptions& options = PullOptions());
  // Moves sequence `sequence_id` of another node of kvmemd's fleet (`from_node`, one of its
  // --cluster-peers) to this kvmemd, whole: blocks at their precision, scores and history,
  // so that its next Step decides what the holder's would have. Returns the sequence here
  // (a new id and table: GetBlockTable it); the holder has released its copy unless
  // `source_released` says otherwise.
  // `transport`: how kvmemd gets the blocks ("attach": the holder's pool mapped, on the
  // same host; "ucx"; "grpc"; empty: the first of those it can).
  struct Moved {
    Sequence sequence;
    uint64_t bytes = 0;
    bool source_released = false;
    std::string transport;  // how the blocks came
  };
  absl::StatusOr<Moved> MoveSequence(const std::string& from_node, uint64_t sequence_id,
                                     std::optional<absl::Duration> lease = std::nullopt,
                                     const std::string& transport = "");

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // Sends `q` (an Append's request, filled but for the held table and request id).
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, v1::AppendRequest& q,
                                      BlockTable* table);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvmem::client
