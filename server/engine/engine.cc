// Engine: creation, the public entry points (each guarded against host memory exhaustion),
// sequence creation and Fork, Release, Stats and the test fingerprint.
#include "server/engine/engine.h"

#include <algorithm>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace kvmem::engine {

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
  if (!(config.cache_low_watermark > 0 &&
        config.cache_low_watermark <= config.cache_high_watermark &&
        config.cache_high_watermark <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache watermarks: low ", config.cache_low_watermark, " and high ",
                     config.cache_high_watermark, " must satisfy 0 < low <= high <= 1"));
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
  absl::StatusOr<prefix::BlockHash> root = prefix::RootHash(config.prefix_hash_seed);
  if (!root.ok()) return root.status();
  return std::unique_ptr<Engine>(
      new Engine(config, std::move(backend), *std::move(pool), *std::move(board), *root, clock));
}

Engine::Engine(const EngineConfig& config, std::unique_ptr<store::Backend> backend,
               std::unique_ptr<store::BlockPool> pool, std::unique_ptr<EpochBoard> board,
               prefix::BlockHash prefix_root, const Clock* clock)
    : config_(config),
      backend_(std::move(backend)),
      pool_(std::move(pool)),
      prefix_(std::make_unique<prefix::PrefixIndex>(pool_.get())),
      prefix_root_(prefix_root),
      board_(std::move(board)),
      clock_(clock),
      telemetry_([] {
        std::vector<std::string> names;
        for (const policy::PolicyDescriptor& d : policy::AllPolicies()) names.emplace_back(d.name);
        return names;
      }()) {
  // A full pool first gives back what only the prefix cache holds.
  pool_->set_reclaimer(
      [this](uint64_t bytes, store::TenantId tenant) { return prefix_->Reclaim(bytes, tenant); });
}

Engine::~Engine() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> all;
  {
    kvmem::MutexLock lock(&mu_);
    all.swap(sequences_);
  }
  for (auto& [id, seq] : all) {
    kvmem::MutexLock seq_lock(&seq->mu);
    ReleaseLocked(*seq);
  }
}

absl::StatusOr<CreateResult> Engine::CreateSequence(Layout layout, absl::string_view policy_name,
                                                    const policy::ParamOverrides& params,
                                                    QuantConfig quant, absl::Duration lease,
                                                    const PromptPrefix& prompt) {
  return Guard("CreateSequence", [&] {
    return CreateSequenceImpl(layout, policy_name, params, quant, lease, prompt);
  });
}

absl::StatusOr<uint64_t> Engine::Publish(uint64_t sequence_id,
                                         std::optional<uint64_t> up_to_tokens) {
  return Guard("Publish", [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Renew(**ref);
    return PublishLocked(**ref, up_to_tokens.value_or(UINT64_MAX));
  });
}

uint64_t Engine::ReclaimToWatermark() {
  try {
    return ReclaimToWatermarkImpl();
  } catch (const std::bad_alloc&) {
    return 0;  // out of host memory: reclaiming allocates nothing, so only the usage read
  }
}

uint64_t Engine::ReclaimToWatermarkImpl() {
  const store::PoolUsage usage = pool_->usage();
  const double total = static_cast<double>(usage.pages_total);
  if (static_cast<double>(usage.pages_used) <= config_.cache_high_watermark * total) return 0;
  const double excess = static_cast<double>(usage.pages_used) - config_.cache_low_watermark * total;
  return prefix_->Reclaim(static_cast<uint64_t>(excess * static_cast<double>(usage.page_bytes)));
}

absl::StatusOr<uint64_t> Engine::PublishDocument(uint64_t sequence_id) {
  return Guard("Publish", [&]() -> absl::StatusOr<uint64_t> {
    // As for every change: an open AppendStream may have written its chunks into the free
    // tails of the very blocks a document would share.
    absl::StatusOr<SequenceRef> ref = LockForChange(sequence_id);
    if (!ref.ok()) return ref.status();
    Renew(**ref);
    return PublishDocumentLocked(**ref);
  });
}

absl::StatusOr<uint64_t> Engine::Lookup(Layout layout, const PromptPrefix& prompt,
                                        absl::string_view policy_name,
                                        const policy::ParamOverrides& params, QuantConfig quant) {
  return Guard("Lookup", [&]() -> absl::StatusOr<uint64_t> {
    if (layout.block_tokens == 0) layout.block_tokens = config_.default_block_tokens;
    if (absl::Status s = ValidateLayout(layout, pool_->page_bytes()); !s.ok()) return s;
    if (absl::Status s = CheckPrompt(layout, prompt); !s.ok()) return s;
    if (prompt.document_tokens >= prompt.token_ids.size() && prompt.document_tokens > 0) {
      return absl::InvalidArgumentError(absl::StrCat("document_tokens: ", prompt.document_tokens,
                                                     " must be less than the prompt's ",
                                                     prompt.token_ids.size(), " tokens"));
    }
    if (prompt.document_tokens > 0) {
      absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
          policy::CreatePolicy(policy_name, params);  // its own name, and checked parameters
      if (!policy.ok()) return policy.status();
      // What CreateSequence would never map (CreateSequenceImpl) is not reported either:
      // nothing for a policy that needs per-token signals, no document for a device step.
      if ((*policy)->descriptor().append_signals != 0) return uint64_t{0};
      if (!(config_.device_step && (*policy)->has_kernel_step())) {
        absl::StatusOr<prefix::BlockHash> key =
            DocumentKey(prompt.token_ids.first(prompt.document_tokens),
                        Representation((*policy)->descriptor().name, params, quant), prompt.salt);
        if (!key.ok()) return key.status();
        if (prefix_->ContainsDocument(PrefixNamespace(layout, prompt.model), *key)) {
          return uint64_t{prompt.document_tokens};
        }
      }
    }
    absl::StatusOr<std::vector<prefix::BlockHash>> hashes = PublishedPrefix(layout, prompt);
    if (!hashes.ok()) return hashes.status();
    const size_t matched = prefix_->Match(PrefixNamespace(layout, prompt.model), *hashes);
    return uint64_t{matched} * layout.block_tokens;
  });
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

absl::StatusOr<CreateResult> Engine::CreateSequenceImpl(Layout layout,
                                                        absl::string_view policy_name,
                                                        const policy::ParamOverrides& params,
                                                        QuantConfig quant, absl::Duration lease,
                                                        const PromptPrefix& prompt) {
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
  // The prompt (checked first: a bad prompt changes nothing) and its published prefix.
  // A policy that needs per-token signals on every append gets none mapped: the worker
  // appends the whole prompt with its signals.
  if (absl::Status s = CheckPrompt(layout, prompt); !s.ok()) return s;
  std::vector<prefix::BlockHash> hashes;
  std::optional<prefix::BlockHash> document;
  if (prompt.document_tokens >= prompt.token_ids.size() && prompt.document_tokens > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "document_tokens: ", prompt.document_tokens, " must be less than the prompt's ",
        prompt.token_ids.size(), " tokens (the question follows the document)"));
  }
  if ((*policy)->descriptor().append_signals == 0) {
    absl::StatusOr<std::vector<prefix::BlockHash>> h = PublishedPrefix(layout, prompt);
    if (!h.ok()) return h.status();
    hashes = *std::move(h);
    // Compressed documents are host state: not for policies that step on the device.
    if (prompt.document_tokens > 0 && !(config_.device_step && (*policy)->has_kernel_step())) {
      absl::StatusOr<prefix::BlockHash> key =
          DocumentKey(prompt.token_ids.first(prompt.document_tokens),
                      Representation((*policy)->descriptor().name, params, quant), prompt.salt);
      if (!key.ok()) return key.status();
      document = *key;
    }
  }
  absl::StatusOr<HostReservation> host = ReserveHost(
      sizeof(Sequence) + uint64_t{layout.num_streams()} * sizeof(Stream), "CreateSequence");
  if (!host.ok()) return host.status();
  std::unique_ptr<store::SlotState> slots;
  if (config_.device_step && (*policy)->has_kernel_step()) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> created =
        backend_->CreateSlotState(layout.num_streams());
    if (!created.ok()) return created.status();
    slots = *std::move(created);
  }
  // Registered only now that the request is known good (a tenant stays registered).
  absl::StatusOr<store::TenantId> tenant = TenantFor(prompt.salt);
  if (!tenant.ok()) return tenant.status();

  const uint64_t epoch = next_epoch_.fetch_add(1);
  absl::StatusOr<uint32_t> slot = board_->Acquire(epoch);
  if (!slot.ok()) return slot.status();
  // Until the sequence owns it (an exception below would leak it for good).
  absl::Cleanup give_back_slot = [this, &slot] { board_->Release(*slot); };
  uint64_t id;
  {
    kvmem::MutexLock lock(&mu_);
    id = next_id_++;
  }
  std::string name((*policy)->descriptor().name);
  auto seq = std::make_shared<Sequence>(id, layout, std::move(name), params, *std::move(policy),
                                        quant, *granted, *slot, /*parent_id=*/0, *tenant);
  uint64_t reused = 0;
  {
    kvmem::MutexLock lock(&seq->mu);
    seq->set_epoch(epoch);
    const uint64_t version = NewVersion(*seq);
    seq->set_slots(std::move(slots));
    Sequence::PrefixState& state = seq->mutable_prefix();
    state.ns = PrefixNamespace(layout, prompt.model);
    state.salt = prompt.salt;
    state.auto_publish = prompt.auto_publish;
    if (document) {
      prefix::PrefixIndex::MappedDocument doc =
          prefix_->MapDocument(state.ns, *document, prompt.document_tokens);
      if (doc.payload != nullptr) {
        // Given back unless the sequence takes them (an error, or an exception).
        absl::Cleanup unref_doc = [&] { pool_->Unref(doc.blocks); };
        absl::Status s = host->Grow(doc.payload->host_bytes(), "CreateSequence");
        if (!s.ok()) return s;
        if (s = AdoptDocument(*seq, *doc.payload, version); !s.ok()) return s;
        std::move(unref_doc).Cancel();
        reused = prompt.document_tokens;
        hashes.clear();  // the whole document is there
      }
    }
    if (!hashes.empty()) {
      // Pinned from here by the sequence's references (its lease), never by the lookup.
      std::vector<std::vector<store::BlockId>> mapped =
          prefix_->Map(state.ns, hashes, hashes.size(), layout.block_tokens);
      if (!mapped.empty()) {
        // Given back unless the sequence takes them (an error, or an exception).
        absl::Cleanup unref_mapped = [&] {
          for (const auto& blocks : mapped) pool_->Unref(blocks);
        };
        const uint64_t tokens = uint64_t{mapped.size()} * layout.block_tokens;
        // What MapPrefix's room takes, exactly (as an Append reserves: append.cc): every
        // stream's columns, its list of mapped.size() entries, the token ids, the slot state.
        uint64_t growth = seq->SlotGrowth(tokens);
        for (const Stream& st : seq->streams()) {
          growth += st.BlockListGrowth(0, mapped.size(), mapped.size());
        }
        absl::Status s = host->Grow(growth, "CreateSequence");
        if (!s.ok()) return s;
        state.hashes.assign(hashes.begin(), hashes.begin() + mapped.size());
        state.published_blocks = mapped.size();
        if (s = MapPrefix(*seq, mapped, prompt.token_ids, version); !s.ok()) return s;
        std::move(unref_mapped).Cancel();
        state.mapped_prefix = true;
        reused = tokens;
      }
    }
    seq->Publish();
    AccountSlotState(*seq);
  }
  std::move(give_back_slot).Cancel();
  spdlog::debug("sequence {} created: policy {}, {} streams, {} prompt tokens reused", id,
                seq->policy_name(), layout.num_streams(), reused);
  absl::StatusOr<CreateResult> result = RegisterOrRelease(seq);
  if (result.ok()) result->reused_prefix_tokens = reused;
  return result;
}

absl::StatusOr<CreateResult> Engine::ForkImpl(uint64_t sequence_id, absl::Duration lease) {
  absl::StatusOr<absl::Duration> granted = ResolveLease(lease);
  if (!granted.ok()) return granted.status();
  absl::StatusOr<SequenceRef> ref = LockForChange(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& parent = **ref;
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::CreatePolicy(parent.policy_name(), parent.policy_params());
  if (!policy.ok()) return policy.status();
  // The child copies the parent's host metadata and slot state: both count against the
  // host budget (beam search forks a lot).
  absl::StatusOr<HostReservation> host =
      ReserveHost(parent.host_bytes() + parent.slot_bytes_accounted(), "Fork");
  if (!host.ok()) return host.status();
  std::unique_ptr<store::SlotState> slots;
  if (parent.slots()) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> copy = parent.slots()->Clone();
    if (!copy.ok()) return copy.status();
    slots = *std::move(copy);
  }
  // The child's tables name the parent's blocks but live under an epoch of their own, never
  // used before: a reader holding a table of an earlier child that had this epoch slot must
  // never validate against this one.
  const uint64_t epoch = next_epoch_.fetch_add(1);
  absl::StatusOr<uint32_t> slot = board_->Acquire(epoch);
  if (!slot.ok()) return slot.status();
  absl::Cleanup give_back_slot = [this, &slot] { board_->Release(*slot); };
  uint64_t id;
  {
    kvmem::MutexLock lock(&mu_);
    id = next_id_++;
  }
  auto child = std::make_shared<Sequence>(
      id, parent.layout(), parent.policy_name(), parent.policy_params(), *std::move(policy),
      parent.quant(), *granted, *slot, parent.id(), parent.tenant());
  {
    kvmem::MutexLock lock(&child->mu);
    child->CopyStateFrom(parent, std::move(slots));
    child->set_epoch(epoch);
    AccountSlotState(*child);
    for (const Stream& st : child->streams()) {
      for (const StreamBlock& b : st.blocks()) pool_->Ref({b.id});
    }
  }
  std::move(give_back_slot).Cancel();
  Renew(parent);
  return RegisterOrRelease(child);
}

absl::StatusOr<uint64_t> Engine::Release(uint64_t sequence_id) {
  std::shared_ptr<Sequence> seq;
  {
    kvmem::MutexLock lock(&mu_);
    auto it = sequences_.find(sequence_id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", sequence_id,
                                              " (never created, released, or its lease lapsed)"));
    }
    seq = std::move(it->second);
    sequences_.erase(it);
  }
  kvmem::MutexLock lock(&seq->mu);
  return ReleaseLocked(*seq);
}

EngineStats Engine::Stats(bool include_sequences) {
  EngineStats stats;
  stats.pool = pool_->usage();
  stats.pool_free_bytes = pool_->free_bytes();
  stats.tokens_appended = tokens_appended_;
  stats.stream_slots_evicted = tokens_evicted_;
  stats.stream_slots_quantized = tokens_quantized_;
  stats.bytes_moved = bytes_moved_;
  stats.slot_state_bytes = slot_state_bytes_;
  stats.host_metadata_bytes = host_bytes_;
  stats.host_metadata_budget_bytes = host_budget();
  stats.steps = steps_;
  stats.leases_expired = leases_expired_;
  stats.prefix = prefix_->stats();
  stats.sequences_poisoned = sequences_poisoned_;
  stats.sequences_created = telemetry_.sequences_created;
  for (const auto& t : telemetry_.policies()) {
    PolicyCounts c;
    c.policy = t->policy;
    c.tokens_appended = t->tokens_appended;
    c.tokens_evicted = t->tokens_evicted.Read();
    c.stream_slots_evicted = t->stream_slots_evicted;
    c.tokens_quantized = t->tokens_quantized.Read();
    c.stream_slots_quantized = t->stream_slots_quantized;
    c.steps = t->step_seconds[0].Read().count + t->step_seconds[1].Read().count;
    stats.policies.push_back(std::move(c));
  }
  std::vector<std::shared_ptr<Sequence>> all;
  {
    kvmem::MutexLock lock(&mu_);
    stats.sequences_active = static_cast<uint32_t>(sequences_.size());
    all.reserve(sequences_.size());
    for (const auto& [id, seq] : sequences_) all.push_back(seq);
  }
  // Table bytes by precision: the layout's dtype, then the quantized formats.
  absl::flat_hash_map<std::string, uint64_t> by_precision;
  const absl::Time now = clock_->Now();
  for (const auto& seq : all) {
    kvmem::MutexLock lock(&seq->mu);
    if (seq->released()) continue;
    // O(streams) per sequence: every figure here is kept per stream.
    stats.kv_bytes += seq->kv_bytes();
    stats.full_cache_bytes += seq->appended() * 2 * seq->layout().payload_bytes(1);
    const BlockFormat& format = seq->format();
    uint64_t layout_blocks = 0, quantized_blocks = 0;
    for (const Stream& st : seq->streams()) {
      layout_blocks += st.blocks().size() - st.quantized_blocks();
      quantized_blocks += st.quantized_blocks();
    }
    by_precision[std::string(DTypeName(seq->layout().dtype))] +=
        layout_blocks * format.block_bytes(Precision::kLayout);
    if (quantized_blocks > 0) {
      by_precision[std::string(PrecisionName(format.quant_precision()))] +=
          quantized_blocks * format.block_bytes(format.quant_precision());
    }
    if (!include_sequences) continue;
    SequenceSummary sum;
    sum.sequence_id = seq->id();
    sum.policy = seq->policy_name();
    sum.appended_tokens = seq->appended();
    sum.max_stream_tokens = seq->max_stream_tokens();
    sum.kv_bytes = seq->kv_bytes();
    sum.blocks = seq->block_count();
    sum.pool_bytes_held = seq->block_bytes_held();
    sum.slot_state_bytes = seq->slot_bytes_accounted();
    sum.quantization =
        seq->quant().type ? std::string(PrecisionName(seq->format().quant_precision())) : "none";
    sum.epoch = seq->epoch();
    sum.steps = seq->steps();
    sum.lease_remaining_seconds =
        absl::ToDoubleSeconds(absl::FromUnixNanos(seq->lease_deadline_ns()) - now);
    sum.parent_id = seq->parent_id();
    stats.sequences.push_back(std::move(sum));
  }
  std::sort(stats.sequences.begin(), stats.sequences.end(),
            [](const SequenceSummary& a, const SequenceSummary& b) {
              return a.sequence_id < b.sequence_id;
            });
  for (const char* name : {"f32", "f16", "bf16", "int8", "int4", "nf4"}) {
    auto it = by_precision.find(name);
    stats.block_bytes_by_precision.emplace_back(name, it == by_precision.end() ? 0 : it->second);
  }
  return stats;
}

absl::StatusOr<std::string> Engine::Fingerprint(uint64_t sequence_id) {
  std::string out;
  {
    absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    if (absl::Status s = seq.CheckInvariants(); !s.ok()) return s;
    std::vector<std::vector<float>> slot_scores;
    std::vector<std::vector<int64_t>> slot_positions;
    if (seq.slots()) {
      if (absl::Status s = seq.slots()->ReadScores(&slot_scores); !s.ok()) return s;
      if (absl::Status s = seq.slots()->ReadPositions(&slot_positions); !s.ok()) return s;
    }
    auto floats = [&out](absl::string_view name, absl::Span<const float> v) {
      absl::StrAppend(&out, name, ":");
      for (float x : v) {  // bit patterns: NaN marks "not scored yet"
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        absl::StrAppend(&out, " ", bits);
      }
      out += "\n";
    };
    absl::StrAppend(&out, "appended ", seq.appended(), " last ", seq.last_position(), " steps ",
                    seq.steps(), " mark ", seq.policy_mark(), " tokens ",
                    absl::StrJoin(seq.token_ids(), ","), "\n");
    for (size_t s = 0; s < seq.streams().size(); ++s) {
      const Stream& st = seq.streams()[s];
      absl::StrAppend(&out, "stream ", s, " positions ", absl::StrJoin(st.positions(), ","),
                      " arrival ", absl::StrJoin(st.arrival_step(), ","), "\nblocks");
      for (const StreamBlock& b : st.blocks()) {
        absl::StrAppend(&out, " ", b.id, "@", pool_->offset(b.id), "[", b.start, "+", b.count, "]p",
                        static_cast<int>(b.precision));
      }
      out += "\n";
      floats("scores", seq.slots() ? absl::MakeConstSpan(slot_scores[s]) : st.scores());
      floats("history", st.history());
      floats("entropy", st.token_entropy());
      floats("distance", st.layer_distance());
      if (seq.slots()) {
        absl::StrAppend(&out, "slot positions ", absl::StrJoin(slot_positions[s], ","), "\n");
      }
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
