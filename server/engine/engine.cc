#include "server/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace kvmem::engine {
namespace {

absl::Status CheckFinite(absl::Span<const float> values, const std::string& field, float min,
                         float max) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] < min || values[i] > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "]: ", values[i], " is not a finite value in [", min, ", ", max, "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                                       std::unique_ptr<store::Backend> backend,
                                                       const Clock* clock) {
  if (config.max_sequences == 0 || config.max_sequences > (1u << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sequences: ", config.max_sequences, " is outside [1, 1048576]"));
  }
  if (config.default_block_tokens == 0 || config.default_block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("block_tokens: ", config.default_block_tokens,
                                                   " is outside [1, ", kMaxBlockTokens, "]"));
  }
  if (config.default_lease <= absl::ZeroDuration() || config.default_lease > config.max_lease) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_seconds: ", absl::ToDoubleSeconds(config.default_lease),
                     " is outside (0, ", absl::ToDoubleSeconds(config.max_lease), "]"));
  }
  const uint64_t pool_bytes = std::min(config.pool_bytes, backend->pool_bytes());
  const uint64_t pages = config.page_bytes == 0 ? 0 : pool_bytes / config.page_bytes;
  const uint64_t reserve = config.reclaim_reserve_pages >= 0
                               ? static_cast<uint64_t>(config.reclaim_reserve_pages)
                               : (pages >= 8 ? std::clamp<uint64_t>(pages / 100, 1, 256) : 0);
  absl::StatusOr<std::unique_ptr<store::BlockPool>> pool = store::BlockPool::Create(
      pool_bytes, config.page_bytes, static_cast<uint32_t>(std::min<uint64_t>(reserve, 1u << 30)));
  if (!pool.ok()) return pool.status();
  absl::StatusOr<std::unique_ptr<EpochBoard>> board = EpochBoard::Create(config.max_sequences);
  if (!board.ok()) return board.status();
  return std::unique_ptr<Engine>(
      new Engine(config, std::move(backend), *std::move(pool), *std::move(board), clock));
}

Engine::Engine(const EngineConfig& config, std::unique_ptr<store::Backend> backend,
               std::unique_ptr<store::BlockPool> pool, std::unique_ptr<EpochBoard> board,
               const Clock* clock)
    : config_(config),
      backend_(std::move(backend)),
      pool_(std::move(pool)),
      board_(std::move(board)),
      clock_(clock) {}

Engine::~Engine() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(sequences_);
  }
  for (auto& [id, seq] : all) {
    absl::MutexLock seq_lock(&seq->mu);
    ReleaseLocked(*seq);
  }
}

Engine::SequenceRef::SequenceRef(SequenceRef&& other) noexcept
    : seq_(std::move(other.seq_)), locked_(other.locked_) {
  other.locked_ = false;
}

Engine::SequenceRef::~SequenceRef() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (seq_ == nullptr) return;
  if (locked_) seq_->mu.Unlock();
  seq_->calls_in_flight.fetch_sub(1, std::memory_order_acq_rel);
}

absl::StatusOr<Engine::SequenceRef> Engine::Find(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", sequence_id,
                                            " (never created, released, or its lease lapsed)"));
  }
  // Counted under the registry lock, which the reaper holds while it reads the count.
  it->second->calls_in_flight.fetch_add(1, std::memory_order_acq_rel);
  return SequenceRef(it->second);
}

absl::Status Engine::Unusable(const Sequence& seq) {
  if (seq.released) {
    return absl::NotFoundError(absl::StrCat("sequence_id: sequence ", seq.id, " was released"));
  }
  if (!seq.poisoned.empty()) {
    return absl::DataLossError(absl::StrCat("sequence ", seq.id, " is poisoned (", seq.poisoned,
                                            "); its cache can no longer be trusted: release it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Engine::SequenceRef> Engine::Lock(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> found = Find(sequence_id);
  if (!found.ok()) return found.status();
  SequenceRef ref(std::move(*found));
  ref.LockNow();
  if (absl::Status s = Unusable(*ref); !s.ok()) return s;
  return ref;
}

absl::Status Engine::Poison(Sequence& seq, const absl::Status& why) {
  if (seq.poisoned.empty()) {
    seq.poisoned = std::string(why.message().substr(0, 512));
    if (seq.poisoned.empty()) seq.poisoned = "a mutation failed past its point of no return";
    ++sequences_poisoned_;
    spdlog::error("sequence {} poisoned: {}", seq.id, why.ToString());
  }
  // Odd for good: readers of any table of this sequence fail from now on.
  board_->BeginWrite(seq.epoch_slot, seq.epoch);
  return Unusable(seq);
}

void Engine::KeepOrphans(Sequence& seq, const OpBatch& batch,
                         const std::vector<std::vector<StreamBlock>>& other_lists, size_t swapped) {
  // References held = old lists + the batch's allocations (nothing dropped yet); streams
  // [0, swapped) hold their new list and other_lists[s] their old one, the rest still hold
  // the old list. What no stream names is kept for Release.
  absl::flat_hash_map<store::BlockId, int64_t> refs;
  for (store::BlockId id : batch.allocated) ++refs[id];
  for (size_t s = 0; s < swapped && s < seq.streams.size(); ++s) {
    for (const StreamBlock& b : other_lists[s]) ++refs[b.id];
    for (const StreamBlock& b : seq.streams[s].blocks) --refs[b.id];
  }
  for (const auto& [id, n] : refs) {
    for (int64_t i = 0; i < n; ++i) seq.orphan_blocks.push_back(id);
  }
}

Engine::WriteSection::WriteSection(Engine* engine, Sequence* seq) : engine_(engine), seq_(seq) {
  engine_->board_->BeginWrite(seq_->epoch_slot, seq_->epoch);
}

void Engine::WriteSection::Commit() {
  seq_->epoch = engine_->next_epoch_.fetch_add(1);
  engine_->board_->EndWrite(seq_->epoch_slot, seq_->epoch);
  committed_ = true;
}

Engine::WriteSection::~WriteSection() {
  if (!committed_) {
    engine_->Poison(*seq_, absl::InternalError("a write section ended without its commit"))
        .IgnoreError();
  }
}

absl::StatusOr<CreateResult> Engine::CreateSequence(Layout layout, absl::string_view policy_name,
                                                    const policy::ParamOverrides& params,
                                                    QuantConfig quant, absl::Duration lease) {
  return Guard("CreateSequence",
               [&] { return CreateSequenceImpl(layout, policy_name, params, quant, lease); });
}

absl::StatusOr<AppendResult> Engine::Append(uint64_t sequence_id,
                                            absl::Span<const AppendChunk> chunks) {
  return Guard("Append", [&] { return AppendImpl(sequence_id, chunks); });
}

absl::StatusOr<StepResult> Engine::Step(uint64_t sequence_id, const StepInput& input) {
  return Guard("Step", [&] { return StepImpl(sequence_id, input); });
}

absl::StatusOr<CompressResult> Engine::Compress(uint64_t sequence_id, const CompressInput& input) {
  return Guard("Compress", [&] { return CompressImpl(sequence_id, input); });
}

absl::StatusOr<CreateResult> Engine::Fork(uint64_t sequence_id, absl::Duration lease) {
  return Guard("Fork", [&] { return ForkImpl(sequence_id, lease); });
}

void Engine::CommitFailpoint() const {
  if (config_.failpoints != nullptr && config_.failpoints->Hit(Failpoints::kCommit)) {
    throw std::bad_alloc();
  }
}

absl::StatusOr<absl::Duration> Engine::ResolveLease(absl::Duration lease) const {
  if (lease == absl::ZeroDuration()) return config_.default_lease;
  if (lease < absl::ZeroDuration() || lease > config_.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat("lease_seconds: ", absl::ToDoubleSeconds(lease),
                                                   " is outside [1, ",
                                                   absl::ToDoubleSeconds(config_.max_lease), "]"));
  }
  return lease;
}

void Engine::Renew(Sequence& seq) {
  seq.lease_deadline_ns.store(absl::ToUnixNanos(clock_->Now() + seq.lease),
                              std::memory_order_relaxed);
}

absl::StatusOr<CreateResult> Engine::Register(const std::shared_ptr<Sequence>& seq) {
  Renew(*seq);
  CreateResult result{0, static_cast<uint32_t>(absl::ToInt64Seconds(seq->lease)),
                      seq->layout.block_tokens, seq->epoch_slot};
  absl::MutexLock lock(&mu_);
  result.sequence_id = seq->id;
  sequences_.emplace(seq->id, seq);
  return result;
}

absl::StatusOr<CreateResult> Engine::CreateSequenceImpl(Layout layout,
                                                        absl::string_view policy_name,
                                                        const policy::ParamOverrides& params,
                                                        QuantConfig quant, absl::Duration lease) {
  if (layout.block_tokens == 0) layout.block_tokens = config_.default_block_tokens;
  if (absl::Status s = ValidateLayout(layout, pool_->page_bytes()); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::CreatePolicy(policy_name, params);
  if (!policy.ok()) return policy.status();
  absl::StatusOr<absl::Duration> granted = ResolveLease(lease);
  if (!granted.ok()) return granted.status();
  if (quant.recent_tokens > kMaxRecentTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.quantization_recent_tokens: ", quant.recent_tokens, " exceeds ", kMaxRecentTokens));
  }
  if (quant.type) {
    const BlockFormat format(layout, quant.type);
    if (format.block_bytes(format.quant_precision()) > pool_->page_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("layout.block_tokens: a quantized block is ",
                                                     format.block_bytes(format.quant_precision()),
                                                     " bytes, more than the pool page of ",
                                                     pool_->page_bytes(), " bytes"));
    }
  }

  if (2 * layout.payload_bytes(1) > config_.max_append_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: one token's K+V is ", 2 * layout.payload_bytes(1),
                     " bytes, over the message limit of ", config_.max_append_bytes,
                     " bytes (--max-message-bytes): no Append could carry it"));
  }
  if (absl::Status s = CheckHostBudget(
          sizeof(Sequence) + uint64_t{layout.num_streams()} * sizeof(Stream), "CreateSequence");
      !s.ok()) {
    return s;
  }
  std::unique_ptr<store::SlotState> slots;
  if (config_.device_step && (*policy)->has_kernel_step()) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> created =
        backend_->CreateSlotState(layout.num_streams());
    if (!created.ok()) return created.status();
    slots = *std::move(created);
  }

  const uint64_t epoch = next_epoch_.fetch_add(1);
  absl::StatusOr<uint32_t> slot = board_->Acquire(epoch);
  if (!slot.ok()) return slot.status();
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = next_id_++;
  }
  std::string name((*policy)->descriptor().name);
  auto seq = std::make_shared<Sequence>(id, layout, std::move(name), params, *std::move(policy),
                                        quant, *granted, *slot);
  {
    absl::MutexLock lock(&seq->mu);
    seq->epoch = epoch;
    seq->streams.resize(layout.num_streams());
    seq->slots = std::move(slots);
    AccountSlotState(*seq);
  }
  spdlog::debug("sequence {} created: policy {}, {} streams", id, seq->policy_name,
                layout.num_streams());
  return Register(seq);
}

absl::Status Engine::ValidateChunk(const Sequence& seq, const AppendChunk& chunk, size_t index,
                                   int64_t* last_position) const {
  const std::string where = index == 0 ? "" : absl::StrCat("chunk ", index, ": ");
  const size_t n = chunk.positions.size();
  const Layout& layout = seq.layout;
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "positions: at least one token is required"));
  }
  const uint64_t max_tokens = config_.max_append_bytes / (2 * layout.payload_bytes(1));
  if (n > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "positions: ", n, " tokens exceed the per-message limit of ", max_tokens,
        " tokens (", config_.max_append_bytes, " bytes of K+V); split them with AppendStream"));
  }
  const uint64_t want = layout.payload_bytes(n);
  if (chunk.k.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "k: ", chunk.k.size(), " bytes, expected ", want, " = layers ", layout.num_layers,
        " x kv_heads ", layout.num_kv_heads, " x tokens ", n, " x head_dim ", layout.head_dim,
        " x ", DTypeBytes(layout.dtype), " bytes (", DTypeName(layout.dtype), ")"));
  }
  if (chunk.v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "v: ", chunk.v.size(), " bytes, expected ", want, " (same shape as k)"));
  }
  if (!chunk.token_ids.empty() && chunk.token_ids.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(where, "token_ids: ", chunk.token_ids.size(),
                                                   " ids for ", n, " positions (send 0 or ", n,
                                                   ")"));
  }
  for (size_t i = 0; i < chunk.token_ids.size(); ++i) {
    if (chunk.token_ids[i] < 0 || static_cast<uint32_t>(chunk.token_ids[i]) >= layout.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, "token_ids[", i,
                                                     "]: ", chunk.token_ids[i], " is outside [0, ",
                                                     layout.vocab_size, ")"));
    }
  }
  if (!chunk.token_entropy.empty() && chunk.token_entropy.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "token_entropy: ", chunk.token_entropy.size(), " values for ", n,
                     " positions (send 0 or ", n, ")"));
  }
  if (auto s = CheckFinite(chunk.token_entropy, where + "token_entropy", 0.0f, 1e6f); !s.ok()) {
    return s;
  }
  if (!chunk.layer_distance.empty() && chunk.layer_distance.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "layer_distance: ", chunk.layer_distance.size(), " values for ", n,
                     " positions (send 0 or ", n, ")"));
  }
  if (auto s = CheckFinite(chunk.layer_distance, where + "layer_distance", 0.0f, 2.0f); !s.ok()) {
    return s;
  }
  for (size_t i = 0; i < n; ++i) {
    if (chunk.positions[i] <= *last_position) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "positions[", i, "]: ", chunk.positions[i],
                       " must be greater than the previous position ", *last_position));
    }
    *last_position = chunk.positions[i];
  }
  return absl::OkStatus();
}

absl::StatusOr<AppendResult> Engine::AppendImpl(uint64_t sequence_id,
                                                absl::Span<const AppendChunk> chunks) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  const Layout& layout = seq.layout;
  int64_t last_position = seq.last_position;
  uint64_t total = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (absl::Status s = ValidateChunk(seq, chunks[c], c, &last_position); !s.ok()) return s;
    total += chunks[c].positions.size();
  }
  if (total == 0) return absl::InvalidArgumentError("positions: at least one token is required");
  const policy::SignalSet needs = seq.policy->descriptor().append_signals;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if ((needs & policy::kTokenEntropy) && chunks[c].token_entropy.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(c == 0 ? "" : absl::StrCat("chunk ", c, ": "),
                                                     "token_entropy: policy ", seq.policy_name,
                                                     " needs one value per appended token"));
    }
    if ((needs & policy::kLayerDistance) && chunks[c].layer_distance.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(c == 0 ? "" : absl::StrCat("chunk ", c, ": "),
                                                     "layer_distance: policy ", seq.policy_name,
                                                     " needs one value per appended token"));
    }
  }

  // Plan every stream's writes (and copy-on-write of a shared last block); allocation is
  // all-or-nothing because an abandoned batch releases what it took.
  OpBatch batch;
  StreamPlanner planner(seq.format, pool_.get(), &batch, config_.failpoints);
  uint64_t needed = 0;
  for (const Stream& st : seq.streams) needed += planner.BlocksForAppend(st.blocks, total);
  std::vector<store::BlockId> reserve;
  if (config_.failpoints != nullptr && needed > 0 &&
      config_.failpoints->Hit(Failpoints::kAllocate)) {
    return absl::ResourceExhaustedError("pool: allocation failed (failpoint)");
  }
  if (absl::Status s = pool_->AllocateMany(
          static_cast<uint32_t>(seq.format.block_bytes(Precision::kLayout)), needed, &reserve);
      !s.ok()) {
    return s;
  }
  batch.allocated = reserve;
  planner.Reserve(std::move(reserve));
  const uint64_t row = layout.row_bytes();
  std::vector<std::vector<StreamBlock>> new_blocks(seq.streams.size());
  std::vector<AppendRun> runs(chunks.size());
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    for (size_t c = 0; c < chunks.size(); ++c) {
      const uint64_t n = chunks[c].positions.size();
      const uint64_t src = uint64_t{s} * n * row;  // stream s of [L][H][n][D]
      runs[c] = {chunks[c].k.data() + src, chunks[c].v.data() + src, static_cast<uint32_t>(n)};
    }
    new_blocks[s] = seq.streams[s].blocks;
    if (absl::Status st = planner.Append(new_blocks[s], runs); !st.ok()) {
      pool_->Unref(batch.allocated);
      return st;
    }
  }
  if (!planner.unused_reserve().empty()) {  // the count above and the plan disagree: a bug
    pool_->Unref(batch.allocated);
    return absl::InternalError("append: block reservation does not match the plan");
  }
  const float initial_score = seq.policy->descriptor().initial_score;
  const uint32_t history_rows = seq.policy->history_rows();
  // Per slot: position, arrival (8 each), score and its staging, entropy, distance (4 each),
  // the history rows (4 each); vectors may double, so twice that is what may be taken.
  const uint64_t slot_bytes = 8 + 8 + 4 * 4 + 4 * uint64_t{history_rows};
  if (absl::Status s = CheckHostBudget(2 * total * seq.streams.size() * slot_bytes, "Append");
      !s.ok()) {
    pool_->Unref(batch.allocated);
    return s;
  }
  // Room for the new slots in every per-slot vector, before anything changes: the commit
  // below then only fills reserved capacity and cannot throw.
  for (Stream& st : seq.streams) {
    const size_t n = st.size() + total;
    st.positions.reserve(n);
    if (!seq.slots) st.scores.reserve(n);
    st.history.reserve(n * history_rows);
    st.token_entropy.reserve(n);
    st.layer_distance.reserve(n);
    st.arrival_step.reserve(n);
  }
  seq.token_ids.reserve(seq.token_ids.size() + total);
  if (seq.slots) {
    std::vector<int64_t> positions;
    positions.reserve(total);
    for (const AppendChunk& chunk : chunks) {
      positions.insert(positions.end(), chunk.positions.begin(), chunk.positions.end());
    }
    if (absl::Status s = seq.slots->Append(positions, initial_score); !s.ok()) {
      pool_->Unref(batch.allocated);
      return s;
    }
  }
  // Writes land in new blocks or past the live slots of a private last block, so a failed
  // batch leaves every table-visible byte as it was. A copy-on-write, though, makes the
  // table stop naming a shared block: then the epoch must change (a reader of the old
  // table must fail before the block's other owners free it), in a write section.
  std::optional<WriteSection> section;
  if (!batch.dropped.empty()) section.emplace(this, &seq);
  if (absl::Status io = Execute(seq, batch); !io.ok()) {
    if (seq.slots) seq.slots->DropNewest(static_cast<uint32_t>(total));
    if (section) section->Commit();  // nothing a table names changed: a fresh epoch is enough
    return io;
  }

  // Commit metadata (into reserved capacity). Nothing here should throw; if something
  // does, the streams may disagree, so the sequence is poisoned on the way out.
  size_t swapped = 0;  // streams [0, swapped) hold their new block list
  absl::Cleanup poison_on_unwind = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    KeepOrphans(seq, batch, new_blocks, swapped);
    Poison(seq, absl::InternalError("append: its commit was interrupted")).IgnoreError();
  };
  const int64_t arrival = static_cast<int64_t>(seq.steps);
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    if (s == seq.streams.size() / 2) CommitFailpoint();
    Stream& st = seq.streams[s];
    st.blocks.swap(new_blocks[s]);
    swapped = s + 1;
    for (const AppendChunk& chunk : chunks) {
      const size_t n = chunk.positions.size();
      st.positions.insert(st.positions.end(), chunk.positions.begin(), chunk.positions.end());
      if (!seq.slots) st.scores.insert(st.scores.end(), n, initial_score);
      st.history.insert(st.history.end(), n * history_rows, 0.0f);
      if (chunk.token_entropy.empty()) {
        st.token_entropy.insert(st.token_entropy.end(), n, std::nanf(""));
      } else {
        st.token_entropy.insert(st.token_entropy.end(), chunk.token_entropy.begin(),
                                chunk.token_entropy.end());
      }
      if (chunk.layer_distance.empty()) {
        st.layer_distance.insert(st.layer_distance.end(), n, std::nanf(""));
      } else {
        st.layer_distance.insert(st.layer_distance.end(), chunk.layer_distance.begin(),
                                 chunk.layer_distance.end());
      }
      st.arrival_step.insert(st.arrival_step.end(), n, arrival);
    }
  }
  for (const AppendChunk& chunk : chunks) {
    if (chunk.token_ids.empty()) {
      seq.token_ids.insert(seq.token_ids.end(), chunk.positions.size(), -1);
    } else {
      seq.token_ids.insert(seq.token_ids.end(), chunk.token_ids.begin(), chunk.token_ids.end());
    }
  }
  seq.last_position = last_position;
  seq.appended += total;
  // Inside the section: readers of the old table already see the odd word.
  pool_->Unref(batch.dropped);
  std::move(poison_on_unwind).Cancel();
  if (section) section->Commit();
  AccountSlotState(seq);
  tokens_appended_ += total;
  Renew(seq);
  return AppendResult{seq.appended, seq.max_stream_tokens(), seq.epoch, seq.kv_bytes()};
}

absl::StatusOr<std::vector<absl::Span<const float>>> Engine::IndexSignals(
    const Sequence& seq, absl::Span<const StreamSignal> signals, const char* field,
    bool require_all, absl::string_view why) const {
  const Layout& layout = seq.layout;
  std::vector<absl::Span<const float>> by_stream(seq.streams.size());
  std::vector<bool> seen(seq.streams.size(), false);
  for (size_t i = 0; i < signals.size(); ++i) {
    const StreamSignal& sig = signals[i];
    if (sig.layer >= layout.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "].layer: ", sig.layer,
                                                     " is outside [0, ", layout.num_layers, ")"));
    }
    if (sig.kv_head >= layout.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "].kv_head: ", sig.kv_head,
                                                     " is outside [0, ", layout.num_kv_heads, ")"));
    }
    const size_t s = size_t{sig.layer} * layout.num_kv_heads + sig.kv_head;
    if (seen[s]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: stream (layer ", sig.layer,
                                                     ", kv_head ", sig.kv_head, ") appears twice"));
    }
    seen[s] = true;
    const std::string name = absl::StrCat(field, "[", i, "]");
    if (sig.values.size() != seq.streams[s].size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", sig.values.size(), " values but stream (layer ", sig.layer,
                       ", kv_head ", sig.kv_head, ") retains ", seq.streams[s].size(), " slots"));
    }
    if (auto st = CheckFinite(sig.values, name, 0.0f, 1e30f); !st.ok()) return st;
    by_stream[s] = sig.values;
  }
  if (require_all && signals.size() != seq.streams.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", why, " needs one entry per stream (", seq.streams.size(),
                     " = layers x kv_heads), got ", signals.size()));
  }
  return by_stream;
}

policy::CallContext Engine::Context(const Sequence& seq) const {
  policy::CallContext ctx;
  ctx.step = seq.steps;
  ctx.num_layers = seq.layout.num_layers;
  ctx.num_kv_heads = seq.layout.num_kv_heads;
  ctx.vocab_size = seq.layout.vocab_size;
  ctx.history_rows = seq.policy->history_rows();
  ctx.mark = seq.policy_mark;
  return ctx;
}

std::vector<policy::StreamState> Engine::StagedStreamStates(Sequence& seq) {
  std::vector<policy::StreamState> states(seq.streams.size());
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    Stream& st = seq.streams[s];
    st.next_scores.resize(st.scores.size());
    policy::StreamState& state = states[s];
    state.layer = static_cast<uint32_t>(s / seq.layout.num_kv_heads);
    state.kv_head = static_cast<uint32_t>(s % seq.layout.num_kv_heads);
    state.positions = st.positions;
    state.scores = st.scores;
    state.next_scores = absl::MakeSpan(st.next_scores);
    state.history = st.history;
    state.token_entropy = st.token_entropy;
    state.layer_distance = st.layer_distance;
    state.arrival_step = st.arrival_step;
  }
  return states;
}

Engine::CommitHook Engine::CommitPolicyState(Sequence& seq, const policy::Decision& decision,
                                             const std::vector<absl::Span<const float>>* rows) {
  return [this, &seq, &decision, rows]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const uint32_t R = seq.policy->history_rows();
    for (size_t s = 0; s < seq.streams.size(); ++s) {
      Stream& st = seq.streams[s];
      if (decision.scores_written) st.scores.swap(st.next_scores);
      if (R > 0 && rows != nullptr) {
        // This step's row goes where the row of step - R was (policy.h).
        const size_t column = seq.steps % R;
        const absl::Span<const float> row = (*rows)[s];
        for (size_t j = 0; j < st.size(); ++j) {
          st.history[j * R + column] = j < row.size() ? row[j] : 0.0f;
        }
      }
    }
    if (decision.mark) seq.policy_mark = *decision.mark;
    return absl::OkStatus();
  };
}

absl::Status Engine::Execute(Sequence& seq, OpBatch& batch) {
  const kernels::QuantGeometry& geometry = seq.format.quant_geometry();
  absl::Status io = backend_->Move(batch.moves);
  if (io.ok()) io = backend_->Write(batch.writes);
  if (io.ok() && !batch.quantizes.empty()) {
    io = backend_->Quantize(seq.format.elem(), geometry, batch.quantizes);
  }
  if (io.ok()) io = backend_->Synchronize();
  if (!io.ok()) {
    pool_->Unref(batch.allocated);
    return io;
  }
  uint64_t moved = 0;
  for (const store::MoveOp& op : batch.moves) moved += op.bytes;
  bytes_moved_ += moved;
  return io;
}

absl::StatusOr<Engine::Applied> Engine::ApplyDecision(Sequence& seq,
                                                      const policy::Decision& decision,
                                                      const CommitHook& commit) {
  if (decision.keep.size() != seq.streams.size()) {
    return absl::InternalError(absl::StrCat("policy ", seq.policy_name, " returned ",
                                            decision.keep.size(), " keep-sets for ",
                                            seq.streams.size(), " streams"));
  }
  // Validate the policy's output before touching anything.
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    if (!decision.keep[s]) continue;
    const std::vector<uint32_t>& keep = *decision.keep[s];
    for (size_t j = 0; j < keep.size(); ++j) {
      if (keep[j] >= seq.streams[s].size() || (j > 0 && keep[j] <= keep[j - 1])) {
        return absl::InternalError(absl::StrCat("policy ", seq.policy_name,
                                                " returned an invalid keep-set for stream ", s));
      }
    }
  }

  // Plan: every allocation happens here, before the point of no return; a failure releases
  // what the plan took and changes nothing.
  OpBatch batch;
  StreamPlanner planner(seq.format, pool_.get(), &batch, config_.failpoints);
  Applied applied;
  std::vector<std::vector<StreamBlock>> new_blocks(seq.streams.size());
  std::vector<bool> changed(seq.streams.size(), false);
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    const Stream& st = seq.streams[s];
    const bool evicts = decision.keep[s] && decision.keep[s]->size() < st.size();
    if (!evicts && !seq.format.quantizes()) continue;  // nothing can change in this stream
    std::vector<StreamBlock>& blocks = new_blocks[s];
    blocks = st.blocks;
    absl::Status planned = absl::OkStatus();
    if (evicts) {
      applied.evicted += st.size() - decision.keep[s]->size();
      planned = planner.Keep(blocks, *decision.keep[s]);
      if (planned.ok()) planned = planner.Merge(blocks);
      changed[s] = true;
    }
    const size_t quantized_before = batch.quantizes.size();
    if (planned.ok()) planned = planner.Quantize(blocks, seq.quant.recent_tokens);
    if (batch.quantizes.size() != quantized_before) changed[s] = true;
    if (!planned.ok()) {
      pool_->Unref(batch.allocated);
      return planned;
    }
  }
  applied.quantized = batch.quantized_slots;
  if (applied.evicted == 0 && applied.quantized == 0) {
    pool_->Unref(batch.allocated);  // nothing is allocated when nothing changes; kept exact
    if (absl::Status s = commit(); !s.ok()) return Poison(seq, s);
    return applied;
  }

  // The point of no return: readers of the old table see the odd word before any byte
  // moves and before any dropped block can be reused; from here a failure poisons.
  WriteSection section(this, &seq);
  if (absl::Status io = Execute(seq, batch); !io.ok()) return Poison(seq, io);
  if (absl::Status s = commit(); !s.ok()) return Poison(seq, s);
  const uint32_t history_rows = seq.policy->history_rows();
  size_t swapped = 0;  // streams [0, swapped) are committed
  // Nothing below should throw; if something does, the sequence is poisoned and keeps the
  // references no stream names for Release, so that the pool's accounting stays exact.
  absl::Cleanup on_unwind = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    KeepOrphans(seq, batch, new_blocks, swapped);
    Poison(seq, absl::InternalError("a step's commit was interrupted")).IgnoreError();
  };
  for (; swapped < seq.streams.size(); ++swapped) {
    const size_t s = swapped;
    if (s == seq.streams.size() / 2) CommitFailpoint();
    if (!changed[s]) continue;
    if (decision.keep[s] && decision.keep[s]->size() < seq.streams[s].size()) {
      seq.streams[s].KeepSlots(*decision.keep[s], history_rows);
    }
    seq.streams[s].blocks.swap(new_blocks[s]);
  }
  std::move(on_unwind).Cancel();
  pool_->Unref(batch.dropped);
  section.Commit();
  tokens_evicted_ += applied.evicted;
  tokens_quantized_ += applied.quantized;
  return applied;
}

absl::StatusOr<Engine::Applied> Engine::KernelStep(Sequence& seq, const policy::CallContext& ctx,
                                                   absl::Span<const absl::Span<const float>> rows,
                                                   policy::Decision* decision) {
  const policy::KernelStep plan = seq.policy->PlanKernelStep(ctx);
  const uint32_t H = seq.layout.num_kv_heads;
  std::vector<uint32_t> budget(seq.streams.size());
  for (size_t s = 0; s < budget.size(); ++s) budget[s] = plan.layer_budget[s / H];
  decision->confidence = plan.confidence;
  decision->budget_tokens = plan.budget_tokens;
  // The slot state stages the step (new scores, keep flags) until CommitStep; AbortStep
  // puts the scores back when the step fails before its point of no return.
  if (absl::Status s = seq.slots->Step(plan.op, rows, budget, plan.protect, &decision->keep);
      !s.ok()) {
    seq.slots->AbortStep();
    return s;
  }
  absl::StatusOr<Applied> done = ApplyDecision(
      seq, *decision, [&seq]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return seq.slots->CommitStep(); });
  if (!done.ok()) {
    if (seq.poisoned.empty()) seq.slots->AbortStep();
    return done.status();
  }
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    if (seq.slots->length(static_cast<uint32_t>(s)) != seq.streams[s].size()) {
      return Poison(seq, absl::InternalError(absl::StrCat(
                             "slot state of stream ", s, " holds ", seq.slots->length(s),
                             " slots, the table ", seq.streams[s].size())));
    }
  }
  return done;
}

absl::StatusOr<StepResult> Engine::StepImpl(uint64_t sequence_id, const StepInput& input) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  const policy::PolicyDescriptor& desc = seq.policy->descriptor();
  const std::string why = absl::StrCat("policy ", desc.name);

  if (!input.attention.empty() && input.epoch != seq.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "epoch: attention rows were computed on epoch ", input.epoch,
        " but the block table is at epoch ", seq.epoch, "; fetch the block table again"));
  }
  absl::StatusOr<std::vector<absl::Span<const float>>> rows = IndexSignals(
      seq, input.attention, "attention", (desc.step_signals & policy::kAttentionRows) != 0, why);
  if (!rows.ok()) return rows.status();

  policy::CallContext ctx = Context(seq);
  if (input.logits) {
    absl::StatusOr<policy::LogitStats> stats =
        input.logits->top_logprobs.empty()
            ? policy::CheckLogitStats({input.logits->entropy, input.logits->p1, input.logits->p2},
                                      seq.layout.vocab_size)
            : policy::LogitStatsFromTopLogprobs(input.logits->top_logprobs);
    if (!stats.ok()) return stats.status();
    ctx.logits = *stats;
  } else if (desc.step_signals & policy::kLogitStats) {
    return absl::InvalidArgumentError(absl::StrCat("logit_stats: ", why, " needs them every step"));
  }

  const uint64_t before = seq.kv_bytes();
  policy::Decision decision;
  absl::StatusOr<Applied> applied;
  if (seq.slots) {
    applied = KernelStep(seq, ctx, *rows, &decision);
  } else {
    // The policy reads the committed state and stages the next (policy.h); it becomes the
    // sequence's only if the whole step applies.
    std::vector<policy::StreamState> states = StagedStreamStates(seq);
    for (size_t s = 0; s < states.size(); ++s) states[s].attention = (*rows)[s];
    decision = seq.policy->Step(ctx, absl::MakeSpan(states));
    applied = ApplyDecision(seq, decision, CommitPolicyState(seq, decision, &*rows));
  }
  if (!applied.ok()) return applied.status();

  StepResult result;
  result.confidence = decision.confidence;
  result.budget_tokens = decision.budget_tokens;
  result.evicted_tokens = applied->evicted;
  result.quantized_tokens = applied->quantized;
  result.kv_bytes_before = before;
  result.kv_bytes_after = seq.kv_bytes();
  result.epoch = seq.epoch;
  result.step = seq.steps++;
  ++steps_;
  AccountSlotState(seq);
  Renew(seq);
  return result;
}

absl::StatusOr<CompressResult> Engine::CompressImpl(uint64_t sequence_id,
                                                    const CompressInput& input) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  const policy::PolicyDescriptor& desc = seq.policy->descriptor();
  const std::string why = absl::StrCat("policy ", desc.name);
  if ((!input.attention.empty() || !input.window_scores.empty()) && input.epoch != seq.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "epoch: signals were computed on epoch ", input.epoch, " but the block table is at epoch ",
        seq.epoch, "; fetch the block table again"));
  }
  absl::StatusOr<std::vector<absl::Span<const float>>> rows =
      IndexSignals(seq, input.attention, "attention",
                   (desc.compress_signals & policy::kAttentionRows) != 0, why);
  if (!rows.ok()) return rows.status();
  absl::StatusOr<std::vector<absl::Span<const float>>> window =
      IndexSignals(seq, input.window_scores, "window_scores",
                   (desc.compress_signals & policy::kWindowScores) != 0, why);
  if (!window.ok()) return window.status();

  policy::CallContext ctx = Context(seq);
  ctx.target_tokens = input.target_tokens;

  CompressResult result;
  result.kv_bytes_before = seq.kv_bytes();
  result.layers.resize(seq.layout.num_layers);
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    LayerKept& layer = result.layers[s / seq.layout.num_kv_heads];
    layer.layer = static_cast<uint32_t>(s / seq.layout.num_kv_heads);
    layer.before_tokens += seq.streams[s].size();
  }
  // Compress runs on the host: scores kept in a SlotState come over for the call (into the
  // streams' host scores, which are empty between calls) and go back, compacted, after it
  // (once per prompt, not per step).
  if (seq.slots) {
    std::vector<std::vector<float>> scores;
    if (absl::Status s = seq.slots->ReadScores(&scores); !s.ok()) return s;
    for (size_t s = 0; s < seq.streams.size(); ++s) seq.streams[s].scores = std::move(scores[s]);
  }
  std::vector<policy::StreamState> states = StagedStreamStates(seq);
  for (size_t s = 0; s < states.size(); ++s) {
    states[s].attention = (*rows)[s];
    states[s].window_scores = (*window)[s];
  }
  const policy::Decision decision = seq.policy->Compress(ctx, absl::MakeSpan(states));
  absl::StatusOr<Applied> applied =
      ApplyDecision(seq, decision, CommitPolicyState(seq, decision, nullptr));
  if (seq.slots) {
    std::vector<std::vector<float>> scores(seq.streams.size());
    for (size_t s = 0; s < seq.streams.size(); ++s) {
      scores[s].swap(seq.streams[s].scores);
      seq.streams[s].next_scores = {};
    }
    if (applied.ok()) {
      absl::Status synced = seq.slots->Keep(decision.keep);
      if (synced.ok()) synced = seq.slots->WriteScores(scores);
      AccountSlotState(seq);  // a compression may have given capacity back
      if (!synced.ok()) return Poison(seq, synced);
    }
  }
  if (!applied.ok()) return applied.status();
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    result.layers[s / seq.layout.num_kv_heads].kept_tokens += seq.streams[s].size();
  }
  result.evicted_tokens = applied->evicted;
  result.quantized_tokens = applied->quantized;
  result.kv_bytes_after = seq.kv_bytes();
  result.epoch = seq.epoch;
  AccountSlotState(seq);
  Renew(seq);
  return result;
}

absl::StatusOr<BlockTable> Engine::GetBlockTable(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  BlockTable table;
  table.sequence_id = seq.id;
  table.epoch = seq.epoch;
  table.layout = seq.layout;
  table.epoch_slot = seq.epoch_slot;
  table.quantization = seq.format.quant_precision();
  table.quantized_block_bytes =
      seq.quant.type ? seq.format.block_bytes(seq.format.quant_precision()) : 0;
  table.streams.resize(seq.streams.size());
  for (size_t s = 0; s < seq.streams.size(); ++s) {
    const Stream& st = seq.streams[s];
    StreamTable& out = table.streams[s];
    out.layer = static_cast<uint32_t>(s / seq.layout.num_kv_heads);
    out.kv_head = static_cast<uint32_t>(s % seq.layout.num_kv_heads);
    out.blocks.reserve(st.blocks.size());
    for (const StreamBlock& b : st.blocks) {
      out.blocks.push_back({b.id, pool_->offset(b.id), b.start, b.count, b.precision});
    }
    out.positions = st.positions;
  }
  Renew(seq);
  return table;
}

absl::Status Engine::ReadKV(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                            uint32_t layer_end,
                            const std::function<absl::Status(StreamKV&&)>& sink) {
  absl::StatusOr<SequenceRef> seq_or = Find(sequence_id);
  if (!seq_or.ok()) return seq_or.status();
  Sequence& seq = **seq_or;
  const Layout& layout = seq.layout;
  if (layer_begin == 0 && layer_end == 0) layer_end = layout.num_layers;
  if (layer_end > layout.num_layers || layer_begin >= layer_end) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer_begin/layer_end: [", layer_begin, ", ", layer_end,
                     ") is not a non-empty range within [0, ", layout.num_layers, ")"));
  }
  uint64_t read_epoch = epoch;
  for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
    for (uint32_t head = 0; head < layout.num_kv_heads; ++head) {
      StreamKV out;
      {
        absl::MutexLock lock(&seq.mu);
        if (absl::Status s = Unusable(seq); !s.ok()) return s;
        if (read_epoch == 0) read_epoch = seq.epoch;
        if (seq.epoch != read_epoch) {
          return layer == layer_begin && head == 0
                     ? absl::FailedPreconditionError(
                           absl::StrCat("epoch: asked for epoch ", read_epoch,
                                        " but the block table is at epoch ", seq.epoch))
                     : absl::AbortedError(absl::StrCat("epoch: the block table changed from epoch ",
                                                       read_epoch, " to ", seq.epoch,
                                                       " during the read; read again"));
        }
        const Stream& st = seq.streams[size_t{layer} * layout.num_kv_heads + head];
        const uint64_t row = layout.row_bytes();
        const uint32_t B = layout.block_tokens;
        out.layer = layer;
        out.kv_head = head;
        out.epoch = seq.epoch;
        out.positions = st.positions;
        out.k.resize(st.size() * row);
        out.v.resize(st.size() * row);
        std::vector<store::ReadOp> reads;
        std::vector<store::DequantizeOp> dequantizes;
        uint64_t first = 0;
        for (const StreamBlock& b : st.blocks) {
          const uint64_t off = pool_->offset(b.id);
          if (b.precision == Precision::kLayout) {
            reads.push_back({off + b.start * row, out.k.data() + first * row, b.count * row});
            reads.push_back(
                {off + (uint64_t{B} + b.start) * row, out.v.data() + first * row, b.count * row});
          } else {
            dequantizes.push_back(
                {off, b.start, b.count, out.k.data() + first * row, out.v.data() + first * row});
          }
          first += b.count;
        }
        absl::Status io = backend_->Read(reads);
        if (io.ok() && !dequantizes.empty()) {
          io = backend_->Dequantize(seq.format.quant_geometry(), seq.format.elem(), dequantizes);
        }
        if (io.ok()) io = backend_->Synchronize();
        if (!io.ok()) return io;
        Renew(seq);
      }
      if (absl::Status s = sink(std::move(out)); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CreateResult> Engine::ForkImpl(uint64_t sequence_id, absl::Duration lease) {
  absl::StatusOr<absl::Duration> granted = ResolveLease(lease);
  if (!granted.ok()) return granted.status();
  absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& parent = **ref;
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::CreatePolicy(parent.policy_name, parent.policy_params);
  if (!policy.ok()) return policy.status();
  std::unique_ptr<store::SlotState> slots;
  if (parent.slots) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> copy = parent.slots->Clone();
    if (!copy.ok()) return copy.status();
    slots = *std::move(copy);
  }
  // The child's tables name the parent's blocks but live under an epoch of their own, never
  // used before: a reader holding a table of an earlier child that had this epoch slot must
  // never validate against this one.
  const uint64_t epoch = next_epoch_.fetch_add(1);
  absl::StatusOr<uint32_t> slot = board_->Acquire(epoch);
  if (!slot.ok()) return slot.status();
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = next_id_++;
  }
  auto child =
      std::make_shared<Sequence>(id, parent.layout, parent.policy_name, parent.policy_params,
                                 *std::move(policy), parent.quant, *granted, *slot);
  child->parent_id = parent.id;
  {
    absl::MutexLock lock(&child->mu);
    child->streams = parent.streams;
    for (Stream& st : child->streams) st.next_scores = {};
    child->slots = std::move(slots);
    AccountSlotState(*child);
    child->token_ids = parent.token_ids;
    child->last_position = parent.last_position;
    child->appended = parent.appended;
    child->epoch = epoch;
    child->steps = parent.steps;
    child->policy_mark = parent.policy_mark;
    for (const Stream& st : child->streams) {
      for (const StreamBlock& b : st.blocks) pool_->Ref({b.id});
    }
  }
  Renew(parent);
  return Register(child);
}

uint64_t Engine::ReleaseLocked(Sequence& seq) {
  uint64_t freed = 0;
  board_->BeginWrite(seq.epoch_slot, seq.epoch);
  freed += pool_->Unref(seq.orphan_blocks);
  seq.orphan_blocks.clear();
  for (Stream& st : seq.streams) {
    for (const StreamBlock& b : st.blocks) freed += pool_->Unref({b.id});
    st = Stream{};
  }
  seq.slots.reset();
  seq.released = true;
  AccountSlotState(seq);
  board_->Release(seq.epoch_slot);
  return freed;
}

void Engine::AccountSlotState(Sequence& seq) {
  const uint64_t now = seq.slots ? seq.slots->bytes() : 0;
  slot_state_bytes_ += now - seq.slot_bytes_accounted;  // modular: shrinking subtracts
  seq.slot_bytes_accounted = now;
  const uint64_t host = seq.released ? 0 : seq.host_bytes();
  host_bytes_ += host - seq.host_bytes_accounted;
  seq.host_bytes_accounted = host;
}

uint64_t Engine::host_budget() const {
  return config_.host_metadata_bytes > 0 ? config_.host_metadata_bytes
                                         : config_.pool_bytes / 2 + (64ull << 20);
}

absl::Status Engine::CheckHostBudget(uint64_t more, absl::string_view what) const {
  const uint64_t used = host_bytes_.load() + slot_state_bytes_.load();
  if (used + more > host_budget()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": needs ", more, " more bytes of host metadata; ", used, " of the budget of ",
        host_budget(), " bytes are in use (--host-metadata-bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Release(uint64_t sequence_id) {
  std::shared_ptr<Sequence> seq;
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(sequence_id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", sequence_id,
                                              " (never created, released, or its lease lapsed)"));
    }
    seq = std::move(it->second);
    sequences_.erase(it);
  }
  absl::MutexLock lock(&seq->mu);
  return ReleaseLocked(*seq);
}

std::vector<absl::Status> Engine::KeepAlive(absl::Span<const uint64_t> sequence_ids) {
  std::vector<absl::Status> results;
  results.reserve(sequence_ids.size());
  // Renewed under the registry lock: the reaper, which takes it too, sees either the
  // sequence gone (NOT_FOUND here) or its new deadline.
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    auto it = sequences_.find(sequence_ids[i]);
    if (it == sequences_.end()) {
      results.push_back(
          absl::NotFoundError(absl::StrCat("sequence_ids[", i, "]: no sequence ", sequence_ids[i],
                                           " (never created, released, or its lease lapsed)")));
      continue;
    }
    Sequence& seq = *it->second;
    seq.lease_deadline_ns.store(absl::ToUnixNanos(now + seq.lease), std::memory_order_relaxed);
    results.push_back(absl::OkStatus());
  }
  return results;
}

uint32_t Engine::ExpireLeases() {
  const int64_t now = absl::ToUnixNanos(clock_->Now());
  std::vector<std::shared_ptr<Sequence>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      // A sequence with calls in flight is left alone: each renews it when it finishes.
      // Calls take their count under this lock, so none can start on a sequence taken here.
      if (it->second->lease_deadline_ns.load(std::memory_order_relaxed) < now &&
          it->second->calls_in_flight.load(std::memory_order_acquire) == 0) {
        expired.push_back(std::move(it->second));
        sequences_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (const auto& seq : expired) {
    absl::MutexLock lock(&seq->mu);
    const uint64_t freed = ReleaseLocked(*seq);
    spdlog::info("sequence {} released: lease of {}s lapsed ({} blocks freed)", seq->id,
                 absl::ToInt64Seconds(seq->lease), freed);
  }
  leases_expired_ += expired.size();
  return static_cast<uint32_t>(expired.size());
}

void Engine::RunLeaseReaper(absl::Duration period, absl::Notification* stop) {
  while (!stop->WaitForNotificationWithTimeout(period)) ExpireLeases();
}

EngineStats Engine::Stats(bool include_sequences) {
  EngineStats stats;
  stats.pool = pool_->usage();
  stats.pool_free_bytes = pool_->free_bytes();
  stats.tokens_appended = tokens_appended_;
  stats.tokens_evicted = tokens_evicted_;
  stats.tokens_quantized = tokens_quantized_;
  stats.bytes_moved = bytes_moved_;
  stats.slot_state_bytes = slot_state_bytes_;
  stats.host_metadata_bytes = host_bytes_;
  stats.host_metadata_budget_bytes = host_budget();
  stats.steps = steps_;
  stats.leases_expired = leases_expired_;
  stats.sequences_poisoned = sequences_poisoned_;
  std::vector<std::shared_ptr<Sequence>> all;
  {
    absl::MutexLock lock(&mu_);
    stats.sequences_active = static_cast<uint32_t>(sequences_.size());
    if (include_sequences) {
      for (const auto& [id, seq] : sequences_) all.push_back(seq);
    }
  }
  const absl::Time now = clock_->Now();
  for (const auto& seq : all) {
    absl::MutexLock lock(&seq->mu);
    if (seq->released) continue;
    SequenceSummary sum;
    sum.sequence_id = seq->id;
    sum.policy = seq->policy_name;
    sum.appended_tokens = seq->appended;
    sum.max_stream_tokens = seq->max_stream_tokens();
    sum.kv_bytes = seq->kv_bytes();
    sum.blocks = seq->block_count();
    sum.pool_bytes_held = seq->block_bytes_held();
    sum.slot_state_bytes = seq->slot_bytes_accounted;
    sum.quantization =
        seq->quant.type ? std::string(PrecisionName(seq->format.quant_precision())) : "none";
    sum.epoch = seq->epoch;
    sum.steps = seq->steps;
    sum.lease_remaining_seconds = absl::ToDoubleSeconds(
        absl::FromUnixNanos(seq->lease_deadline_ns.load(std::memory_order_relaxed)) - now);
    sum.parent_id = seq->parent_id;
    stats.sequences.push_back(std::move(sum));
  }
  std::sort(stats.sequences.begin(), stats.sequences.end(),
            [](const SequenceSummary& a, const SequenceSummary& b) {
              return a.sequence_id < b.sequence_id;
            });
  return stats;
}

absl::StatusOr<std::string> Engine::Fingerprint(uint64_t sequence_id) {
  std::string out;
  {
    absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    std::vector<std::vector<float>> slot_scores;
    std::vector<std::vector<int64_t>> slot_positions;
    if (seq.slots) {
      if (absl::Status s = seq.slots->ReadScores(&slot_scores); !s.ok()) return s;
      if (absl::Status s = seq.slots->ReadPositions(&slot_positions); !s.ok()) return s;
    }
    auto floats = [&out](absl::string_view name, const std::vector<float>& v) {
      absl::StrAppend(&out, name, ":");
      for (float x : v) {  // bit patterns: NaN marks "not scored yet"
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        absl::StrAppend(&out, " ", bits);
      }
      out += "\n";
    };
    absl::StrAppend(&out, "appended ", seq.appended, " last ", seq.last_position, " steps ",
                    seq.steps, " mark ", seq.policy_mark, " tokens ",
                    absl::StrJoin(seq.token_ids, ","), "\n");
    for (size_t s = 0; s < seq.streams.size(); ++s) {
      const Stream& st = seq.streams[s];
      absl::StrAppend(&out, "stream ", s, " positions ", absl::StrJoin(st.positions, ","),
                      " arrival ", absl::StrJoin(st.arrival_step, ","), "\nblocks");
      for (const StreamBlock& b : st.blocks) {
        absl::StrAppend(&out, " ", b.id, "@", pool_->offset(b.id), "[", b.start, "+", b.count, "]p",
                        static_cast<int>(b.precision));
      }
      out += "\n";
      floats("scores", seq.slots ? slot_scores[s] : st.scores);
      floats("history", st.history);
      floats("entropy", st.token_entropy);
      floats("distance", st.layer_distance);
      if (seq.slots)
        absl::StrAppend(&out, "slot positions ", absl::StrJoin(slot_positions[s], ","), "\n");
    }
  }
  absl::Status read = ReadKV(sequence_id, 0, 0, 0, [&out](StreamKV&& kv) {
    absl::StrAppend(&out, "kv ", kv.layer, ".", kv.kv_head, " ", absl::BytesToHexString(kv.k), " ",
                    absl::BytesToHexString(kv.v), "\n");
    return absl::OkStatus();
  });
  if (!read.ok()) return read;
  return out;
}

}  // namespace kvmem::engine
