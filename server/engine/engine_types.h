#pragma once
// The engine's plain data: its configuration and what its calls take and return.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/failpoints.h"
#include "server/engine/layout.h"
#include "server/engine/sequence.h"
#include "server/engine/write_plans.h"
#include "server/prefix/prefix_index.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

inline constexpr uint32_t kMaxRecentTokens = 1u << 20;
// Bytes of a cache salt or a model name (prefix sharing).
inline constexpr size_t kMaxSaltBytes = 256;
// Token ids of a prompt (prefix sharing).
inline constexpr size_t kMaxPromptTokens = size_t{1} << 20;

struct EngineConfig {
  uint64_t pool_bytes = 1ull << 30;
  uint64_t page_bytes = 64 * 1024;
  uint32_t default_block_tokens = 16;
  uint32_t max_sequences = 1024;
  absl::Duration default_lease = absl::Seconds(60);
  absl::Duration max_lease = absl::Hours(24);
  uint64_t max_append_bytes = 64ull << 20;  // K+V bytes of one Append message
  // Host memory for sequences' metadata outside the pool (per-stream and per-slot vectors:
  // positions, scores, signals, history, block lists); a call that would pass it is
  // RESOURCE_EXHAUSTED naming --host-metadata-bytes. 0 = pool_bytes / 2 + 64 MiB.
  uint64_t host_metadata_bytes = 0;
  // Device memory for the slot states of a GPU backend's device step (scores, positions,
  // flags: not host memory, not in the pool); RESOURCE_EXHAUSTED naming
  // --device-metadata-bytes past it. 0 = pool_bytes / 2 + 64 MiB.
  uint64_t device_metadata_bytes = 0;
  // Test hook (failpoints.h); null in production.
  Failpoints* failpoints = nullptr;
  // Free pages only quantization may take (BlockPool::Use::kReclaim), so that a full pool
  // can still quantize; -1 = about 1% of the pool's pages, at least one when it has 8.
  int64_t reclaim_reserve_pages = -1;
  // Policies with a kernel step keep their scores in the backend (store::SlotState: device
  // memory on a GPU) and run each Step there; false runs every policy on the host.
  bool device_step = true;
  // StepBatch entries may ask for write plans and commit tokens written in place
  // (WritePlans; kvmemd --in_place_writes): the clients then write into the pool, so the
  // daemon serves one trust domain.
  bool in_place_writes = false;
  // Bytes of the table area (TableBoard; kvmemd --table-area-bytes), a shared-memory
  // segment where same-host readers find every sequence's block table; 0: none.
  uint64_t table_area_bytes = 0;
  // StepBatch runs its entries on every core (oneTBB); false runs them one after another on
  // the caller's thread.
  bool parallel_batches = true;
  // The seed of the prefix hash chain (prefix_hash.h): vLLM's PYTHONHASHSEED, for a
  // deployment whose blocks should carry the same names as vLLM's.
  std::string prefix_hash_seed = "0";
  // Background reclaim of the prefix cache (Engine::ReclaimToWatermark): when more than
  // `high` of the pool's pages are in use, cached blocks (published, held by no sequence)
  // are given back until at most `low` are, so that allocations seldom wait for a reclaim.
  // Fractions in (0, 1], low <= high; high 1 leaves reclaiming to the allocations.
  double cache_high_watermark = 0.95;
  double cache_low_watermark = 0.85;
  // Pool bytes the sequences of one tenant may hold: the blocks they allocate, counted
  // until freed (published ones until reclaimed). 0: no quota. `tenant_quotas` overrides
  // it per tenant. A tenant is PromptPrefix::owner, else the cache salt ("" included).
  uint64_t tenant_quota_bytes = 0;
  std::vector<std::pair<std::string, uint64_t>> tenant_quotas;
  // Arenas (tenant, bytes): the pool's last pages, in order, each serving the blocks of its
  // tenant (a PromptPrefix::owner) alone (store::BlockPool). Each a whole number of pages;
  // the backend's pool must be cut the same way (store::Backend::pool_pieces).
  std::vector<std::pair<std::string, uint64_t>> tenant_arenas;
  // Sequences one tenant may hold at once (fork children included); 0: no limit but
  // max_sequences.
  uint32_t tenant_max_sequences = 0;
  // Host metadata the sequences of one tenant may hold, with what its calls in flight were
  // promised (HostShare), within host_metadata_bytes; 0: no limit apart.
  uint64_t tenant_host_metadata_bytes = 0;
};

// A new sequence's prompt, for prefix sharing: the longest published prefix of these tokens
// in the same namespace (model and layout) and salt is mapped into it at creation.
struct PromptPrefix {
  std::string model;  // names the namespace with the layout; empty is a namespace too
  std::string salt;   // the cache salt: only prompts with the same salt share
  absl::Span<const int32_t> token_ids;
  // Publishes every full prompt block as it is appended (while unevicted and unquantized),
  // as vLLM does by default; otherwise only Publish does.
  bool auto_publish = false;
  // The first `document_tokens` of token_ids are a document that may have been published
  // compressed (Publish with compressed_document) under this sequence's representation:
  // its policy, parameter overrides and quantization. Found, the whole compressed document
  // is mapped (reused_prefix_tokens = document_tokens); else nothing (no plain prefix:
  // the client computes the whole document, compresses it and may publish it).
  uint32_t document_tokens = 0;
  // The request's name for token_ids, in errors (CreateSequence's; Lookup's is token_ids).
  absl::string_view token_ids_field = "prompt_token_ids";
  // The authenticated tenant the sequence belongs to (service::Principal; "" on a daemon
  // without tokens): its quota key (else the salt's), and the owner calls are checked
  // against (Engine::CheckOwner).
  std::string owner;
};

struct AppendChunk {
  absl::Span<const int64_t> positions;
  absl::Span<const int32_t> token_ids;
  absl::string_view k;  // [L][H][n][D] in the layout dtype
  absl::string_view v;
  absl::Span<const float> token_entropy;
  absl::Span<const float> layer_distance;
};

struct TableBlock {
  store::BlockId id = 0;
  uint64_t offset = 0;  // bytes into the pool
  uint32_t start = 0;   // live slots [start, start + count) of the block
  uint32_t count = 0;
  Precision precision = Precision::kLayout;
};

struct StreamTable {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  std::vector<TableBlock> blocks;
  std::vector<int64_t> positions;
};

struct BlockTable {
  uint64_t sequence_id = 0;
  uint64_t epoch = 0;
  uint64_t version = 0;
  Layout layout;
  Precision quantization = Precision::kLayout;
  uint64_t quantized_block_bytes = 0;
  uint32_t epoch_slot = 0;
  bool positions = false;  // StreamTable::positions are filled
  std::vector<StreamTable> streams;
};

// One stream's retained K/V in the layout dtype, [n][D] each.
struct StreamKV {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  uint64_t epoch = 0;
  uint64_t first_slot = 0;  // the index in the stream of the first slot given here
  std::vector<int64_t> positions;
  std::string k;
  std::string v;
};

struct CreateResult {
  uint64_t sequence_id = 0;
  uint32_t lease_seconds = 0;
  uint32_t block_tokens = 0;
  uint32_t epoch_slot = 0;
  uint64_t epoch = 0;
  uint64_t version = 0;               // the table's version (a Fork's child: its parent's)
  uint64_t reused_prefix_tokens = 0;  // mapped from published blocks at creation
};

// Entries [from, from + count) of the list the client holds, unchanged, are entries
// [at, at + count) of the new list.
struct KeptRun {
  uint32_t at = 0;
  uint32_t from = 0;
  uint32_t count = 0;
};

// How one stream's list changed since the client's version: the new list has block_count
// entries; the kept runs come from the client's list, the others are `blocks`, in order.
// A decode step's delta names one or two runs and one or two entries per stream: inline,
// so that 90 streams' deltas cost no allocation each.
struct StreamDelta {
  uint32_t stream = 0;  // layer * H + kv_head
  uint32_t block_count = 0;
  absl::InlinedVector<KeptRun, 2> kept;
  absl::InlinedVector<TableBlock, 2> blocks;
  std::vector<int64_t> positions;  // of the live slots of `blocks`, when asked for
};

// A table update: the streams that changed since the client's version (base_version), or
// the whole table when that version was too old or unknown.
struct TableUpdate {
  uint64_t base_version = 0;
  uint64_t version = 0;
  uint64_t epoch = 0;
  std::optional<BlockTable> table;   // the whole table (`streams` is then empty)
  std::vector<StreamDelta> streams;  // else the streams that changed
  // Neither: the table at `version` is in the table area, where the client reads it.
  bool in_area = false;
  bool full() const { return table.has_value(); }
};

// The table a client holds (its ClientTable): a mutation given one answers the update from
// it, computed under the mutation's own lock.
struct HeldTable {
  uint64_t version = 0;    // 0: none held (the whole table)
  bool positions = false;  // the update carries positions
  // The client reads the table area (StepBatch's ClientTable.from_area): an answer names
  // the version to read there instead of carrying the update, when the area holds it.
  bool from_area = false;
};

struct AppendResult {
  uint64_t appended_tokens = 0;
  uint32_t max_stream_tokens = 0;
  uint64_t epoch = 0;
  uint64_t kv_bytes = 0;
  uint64_t version = 0;              // table version after the call
  std::optional<TableUpdate> table;  // from the HeldTable the call was given
};

// One per-stream signal vector (attention row or window scores).
struct StreamSignal {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  absl::Span<const float> values;
};

struct RawLogitStats {
  float entropy = 0, p1 = 0, p2 = 0;
  std::vector<float> top_logprobs;  // alternative to the three numbers
};

struct StepInput {
  uint64_t epoch = 0;
  // The version of the client's table the rows were computed on (0: not said). Rows whose
  // length misses a slot count because the table changed since (another client appended:
  // the epoch stays) are then FAILED_PRECONDITION, as for a stale epoch.
  uint64_t table_version = 0;
  std::optional<RawLogitStats> logits;
  std::vector<StreamSignal> attention;
};

struct StepResult {
  double confidence = 0;
  uint32_t budget_tokens = 0;
  uint64_t evicted_tokens = 0;
  uint64_t quantized_tokens = 0;
  uint64_t kv_bytes_before = 0;
  uint64_t kv_bytes_after = 0;
  uint64_t epoch = 0;
  uint64_t step = 0;
  uint64_t version = 0;              // table version after the call
  std::optional<TableUpdate> table;  // from the HeldTable the call was given
};

struct CompressInput {
  uint64_t epoch = 0;
  uint64_t table_version = 0;  // as StepInput's
  uint32_t target_tokens = 0;
  std::vector<StreamSignal> window_scores;
  std::vector<StreamSignal> attention;
};

struct LayerKept {
  uint32_t layer = 0;
  uint64_t kept_tokens = 0;
  uint64_t before_tokens = 0;
};

struct CompressResult {
  std::vector<LayerKept> layers;
  uint64_t evicted_tokens = 0;
  uint64_t quantized_tokens = 0;
  uint64_t kv_bytes_before = 0;
  uint64_t kv_bytes_after = 0;
  uint64_t epoch = 0;
  uint64_t version = 0;              // table version after the call
  std::optional<TableUpdate> table;  // from the HeldTable the call was given
};

// One entry of a batched step: the new token(s) appended, then the step, on one sequence.
struct StepCall {
  uint64_t sequence_id = 0;
  std::optional<AppendChunk> append;  // applied first; the step's rows cover these tokens
  std::optional<StepInput> step;      // absent: the call only appends
  // The table the client holds: the outcome carries the update from it.
  std::optional<HeldTable> held;
  // In-place writes (WritePlans): the append's K/V was written at this plan (0: the chunk
  // carries it); after the entry, a new plan for this many tokens (0: none).
  uint64_t plan_id = 0;
  uint32_t plan_tokens = 0;
  // Set by the caller when the entry could not be read (a malformed row, say): the entry is
  // answered with it and nothing of it runs; the other entries run as ever.
  absl::Status rejected;
};

// What one StepCall did. The append and the step are each atomic; a step that fails after
// its append applied leaves the append applied (appended is set, status is the step's
// error) and nothing of the step. An error before the append changes nothing.
struct StepOutcome {
  absl::Status status;
  std::optional<AppendResult> appended;
  std::optional<StepResult> step;
  std::optional<TableUpdate> table;  // when a table was held and the sequence serves
  // When asked for: where the next tokens go, or why there is no plan (the rest of the
  // entry applied or not regardless: `status` is not this one).
  std::optional<absl::StatusOr<PlanView>> plan;
};

struct SequenceSummary {
  uint64_t sequence_id = 0;
  std::string owner;  // Sequence::owner
  std::string policy;
  uint64_t appended_tokens = 0;
  uint32_t max_stream_tokens = 0;
  uint64_t kv_bytes = 0;
  uint64_t blocks = 0;
  uint64_t epoch = 0;
  uint64_t steps = 0;
  double lease_remaining_seconds = 0;
  uint64_t parent_id = 0;
  uint64_t pool_bytes_held = 0;
  std::string quantization;
  uint64_t slot_state_bytes = 0;
};

// Counts per policy since the daemon started (Telemetry), in the units a person reads:
// tokens are positions of a sequence; stream slots are tokens times the streams they were
// taken from (a token evicted from all 90 streams of SmolLM2 is 1 token, 90 stream slots).
struct PolicyCounts {
  std::string policy;
  uint64_t tokens_appended = 0;
  double tokens_evicted = 0;  // stream slots evicted / the sequence's streams
  uint64_t stream_slots_evicted = 0;
  double tokens_quantized = 0;
  uint64_t stream_slots_quantized = 0;
  uint64_t steps = 0;
};

// A tenant's arena (EngineConfig::tenant_arenas): its size and the bytes of its free pages.
struct ArenaUsage {
  std::string tenant;
  uint64_t bytes = 0;
  uint64_t free_bytes = 0;
};

struct EngineStats {
  store::PoolUsage pool;
  uint64_t pool_free_bytes = 0;
  // Every arena, or with an owner that owner's alone.
  std::vector<ArenaUsage> arenas;
  uint32_t sequences_active = 0;
  uint64_t sequences_created = 0;
  uint64_t tokens_appended = 0;
  uint64_t stream_slots_evicted = 0;    // all policies
  uint64_t stream_slots_quantized = 0;  // all policies
  std::vector<PolicyCounts> policies;   // every policy, registration order
  // Over the sequences held now: the K/V bytes their tables hold (a shared block counted
  // by each sequence that names it), the bytes a full cache of the same tokens at the
  // layout's dtype would take, and table block bytes by storage precision.
  uint64_t kv_bytes = 0;
  uint64_t full_cache_bytes = 0;
  std::vector<std::pair<std::string, uint64_t>> block_bytes_by_precision;
  uint64_t bytes_moved = 0;              // pool bytes moved by compaction, merges and copy-on-write
  uint64_t slot_state_bytes = 0;         // SlotState memory of all sequences (outside the pool)
  uint64_t device_slot_state_bytes = 0;  // of it, in device memory
  uint64_t device_metadata_budget_bytes = 0;  // --device-metadata-bytes
  uint64_t host_metadata_bytes = 0;           // sequences' host metadata (outside the pool)
  uint64_t host_metadata_budget_bytes = 0;
  // The table area (--table_area_bytes): its heap, the bytes of it the records take, and the
  // writes that found no room.
  uint64_t table_area_heap_bytes = 0;
  uint64_t table_area_used_bytes = 0;
  uint64_t table_area_misses = 0;
  uint64_t steps = 0;
  uint64_t leases_expired = 0;
  uint64_t sequences_poisoned = 0;
  // Blocks (and their pool bytes) a move's receiver kept out of circulation for good: a
  // get abandoned in flight might still write into them. Charged to their tenant.
  uint64_t blocks_forsaken = 0, bytes_forsaken = 0;
  prefix::PrefixStats prefix;
  std::vector<SequenceSummary> sequences;
};

}  // namespace kvmem::engine
