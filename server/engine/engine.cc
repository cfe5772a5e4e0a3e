// Engine: creation, and each call composed of the rooms' work, guarded against host memory
// exhaustion (guard.h).
#include "server/engine/engine.h"

#include <algorithm>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/engine/guard.h"
#include "server/engine/input_checks.h"
#include "server/engine/sequence_report.h"
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
  std::vector<store::ArenaSpec> arenas;
  for (const auto& [tenant, bytes] : config.tenant_arenas) {
    const uint64_t arena_pages = config.page_bytes == 0 ? 0 : bytes / config.page_bytes;
    if (arena_pages == 0 || arena_pages * config.page_bytes != bytes || arena_pages >= (1u << 31)) {
      return absl::InvalidArgumentError(absl::StrCat("--tenant-arena: ", tenant, "'s ", bytes,
                                                     " bytes are not a whole number of pages of ",
                                                     config.page_bytes, " bytes"));
    }
    const uint64_t arena_reserve =
        config.reclaim_reserve_pages >= 0
            ? static_cast<uint64_t>(config.reclaim_reserve_pages)
            : (arena_pages >= 8 ? std::clamp<uint64_t>(arena_pages / 100, 1, 256) : 0);
    arenas.push_back({absl::StrCat("the arena of tenant '", tenant.substr(0, 64), "'"),
                      static_cast<uint32_t>(arena_pages),
                      static_cast<uint32_t>(std::min<uint64_t>(arena_reserve, 1u << 30))});
  }
  // The shared part's pages (the pool's, less the arenas'): its reserve is its own.
  uint64_t pages = config.page_bytes == 0 ? 0 : pool_bytes / config.page_bytes;
  for (const store::ArenaSpec& a : arenas) pages -= std::min<uint64_t>(pages, a.pages);
  const uint64_t reserve = config.reclaim_reserve_pages >= 0
                               ? static_cast<uint64_t>(config.reclaim_reserve_pages)
                               : (pages >= 8 ? std::clamp<uint64_t>(pages / 100, 1, 256) : 0);
  if (!arenas.empty() && pool_bytes % config.page_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tenant-arena: the pool's ", pool_bytes,
                                                   " bytes are not a whole number of pages of ",
                                                   config.page_bytes, " bytes"));
  }
  const size_t num_arenas = arenas.size();
  absl::StatusOr<std::unique_ptr<store::BlockPool>> pool = store::BlockPool::Create(
      pool_bytes, config.page_bytes, static_cast<uint32_t>(std::min<uint64_t>(reserve, 1u << 30)),
      std::move(arenas));
  if (!pool.ok()) return pool.status();
  if (num_arenas > 0) {
    // Each arena must be a segment of its own where the pool's pages put it: what a tenant's
    // client maps is then its arena's blocks and nothing else.
    const std::vector<store::SharedMemoryExport> pieces = backend->pool_pieces();
    bool cut_alike = pieces.size() == num_arenas + 1;
    for (uint32_t a = 1; cut_alike && a <= num_arenas; ++a) {
      const std::shared_ptr<const transport::SharedSegment> segment = pieces[a].segment.lock();
      cut_alike = segment != nullptr && pieces[a].offset == (*pool)->arena_offset(a) &&
                  segment->bytes() == (*pool)->arena_bytes(a);
    }
    if (!cut_alike) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tenant-arena: the ", backend->kind(), " backend's pool is not cut into the ",
          num_arenas, " arenas (only the CPU backend's is)"));
    }
  }
  absl::StatusOr<std::unique_ptr<EpochBoard>> board = EpochBoard::Create(config.max_sequences);
  if (!board.ok()) return board.status();
  absl::StatusOr<prefix::BlockHash> root = prefix::RootHash(config.prefix_hash_seed);
  if (!root.ok()) return root.status();
  std::unique_ptr<TableBoard> tables;
  if (config.table_area_bytes > 0) {
    absl::StatusOr<std::unique_ptr<TableBoard>> made =
        TableBoard::Create(config.max_sequences, config.table_area_bytes);
    if (!made.ok()) return made.status();
    tables = *std::move(made);
  }
  std::unique_ptr<Engine> engine(
      new Engine(config, std::move(backend), *std::move(pool), *std::move(board), *root, clock));
  engine->versions_.set_tables(std::move(tables));
  return engine;
}

namespace {

// Bytes of `v` as a protobuf varint.
uint64_t VarintBytes(uint64_t v) {
  uint64_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

uint64_t HostBudgetBytes(const EngineConfig& config) {
  return config.host_metadata_bytes > 0 ? config.host_metadata_bytes
                                        : config.pool_bytes / 2 + (64ull << 20);
}

uint64_t DeviceBudgetBytes(const EngineConfig& config) {
  return config.device_metadata_bytes > 0 ? config.device_metadata_bytes
                                          : config.pool_bytes / 2 + (64ull << 20);
}

std::vector<std::string> ArenaTenants(const EngineConfig& config) {
  std::vector<std::string> names;
  for (const auto& [tenant, bytes] : config.tenant_arenas) names.push_back(tenant);
  return names;
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (const policy::PolicyDescriptor& d : policy::AllPolicies()) names.emplace_back(d.name);
  return names;
}

}  // namespace

Engine::Engine(const EngineConfig& config, std::unique_ptr<store::Backend> backend,
               std::unique_ptr<store::BlockPool> pool, std::unique_ptr<EpochBoard> board,
               prefix::BlockHash prefix_root, const Clock* clock)
    : config_(config),
      backend_(std::move(backend)),
      pool_(std::move(pool)),
      telemetry_(PolicyNames()),
      publisher_(pool_.get(), prefix_root),
      budget_(
          HostBudgetBytes(config), [this] { return publisher_.index().host_bytes(); },
          config.tenant_host_metadata_bytes, DeviceBudgetBytes(config)),
      versions_(std::move(board), pool_.get(), &telemetry_),
      registry_(clock, config.default_lease, config.max_lease),
      tenants_(pool_.get(), config.tenant_quota_bytes, config.tenant_quotas,
               config.tenant_max_sequences, ArenaTenants(config)),
      applier_(pool_.get(), backend_.get(), &versions_, &telemetry_, config.failpoints),
      driver_(&applier_, &versions_, &budget_, &registry_, &telemetry_, config.failpoints),
      reader_(&registry_, pool_.get(), backend_.get()),
      plans_(config.in_place_writes ? std::make_optional<WritePlans>(pool_.get(), config.failpoints)
                                    : std::nullopt),
      append_rooms_{pool_.get(),
                    backend_.get(),
                    &budget_,
                    &versions_,
                    &registry_,
                    &publisher_,
                    &telemetry_,
                    config.failpoints,
                    plans_ ? &*plans_ : nullptr,
                    config.max_append_bytes},
      batches_(&append_rooms_, &registry_, &driver_, config.parallel_batches,
               config.device_step && backend_->steps_slot_states_together()) {
  publisher_.set_budget(&budget_);
  registry_.set_unref([this](const std::vector<store::BlockId>& ids) { pool_->Unref(ids); });
  // A full pool first gives back what only the prefix cache holds.
  pool_->set_reclaimer([this](uint64_t bytes, store::TenantId tenant) {
    return publisher_.index().Reclaim(bytes, tenant);
  });
}

Engine::~Engine() {
  for (const std::shared_ptr<Sequence>& seq : registry_.TakeAll()) {
    kvmem::MutexLock seq_lock(&seq->mu);
    ReleaseLocked(*seq);
  }
}

absl::StatusOr<CreateResult> Engine::CreateSequence(Layout layout, absl::string_view policy_name,
                                                    const policy::ParamOverrides& params,
                                                    QuantConfig quant, absl::Duration lease,
                                                    const PromptPrefix& prompt) {
  return GuardHostMemory("CreateSequence", [&] {
    return CreateSequenceImpl(layout, policy_name, params, quant, lease, prompt);
  });
}

absl::StatusOr<uint64_t> Engine::Publish(uint64_t sequence_id,
                                         std::optional<uint64_t> up_to_tokens) {
  return GuardHostMemory("Publish", [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();  // locked by the registry (SequenceRef)
    registry_.Renew(seq);
    return publisher_.Publish(seq, up_to_tokens.value_or(UINT64_MAX));
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
  // Each part of the pool on its own (the shared part, each arena: one full arena is no
  // reason to drop another tenant's cache); an arena's cache is its tenant's.
  uint64_t freed = 0;
  for (uint32_t r = 0; r <= pool_->arenas(); ++r) {
    const store::BlockPool::RegionUsage usage = pool_->region_usage(r);
    const auto total = static_cast<double>(usage.pages);
    const auto used = static_cast<double>(usage.pages_used);
    if (used <= config_.cache_high_watermark * total || (r != 0 && usage.tenant == 0)) continue;
    const double excess = used - config_.cache_low_watermark * total;
    freed += publisher_.index().Reclaim(
        static_cast<uint64_t>(excess * static_cast<double>(pool_->page_bytes())), usage.tenant);
  }
  return freed;
}

absl::StatusOr<uint64_t> Engine::PublishDocument(uint64_t sequence_id) {
  return GuardHostMemory("Publish", [&]() -> absl::StatusOr<uint64_t> {
    // As for every change: an open AppendStream may have written its chunks into the free
    // tails of the very blocks a document would share.
    absl::StatusOr<SequenceRef> ref = registry_.LockForChange(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    registry_.Renew(seq);
    return publisher_.PublishDocument(seq);
  });
}

absl::StatusOr<uint64_t> Engine::Lookup(Layout layout, const PromptPrefix& prompt,
                                        absl::string_view policy_name,
                                        const policy::ParamOverrides& params, QuantConfig quant) {
  return GuardHostMemory("Lookup", [&]() -> absl::StatusOr<uint64_t> {
    if (layout.block_tokens == 0) layout.block_tokens = config_.default_block_tokens;
    if (absl::Status s = ValidateLayout(layout, pool_->page_bytes()); !s.ok()) return s;
    // The policy is refused as CreateSequence refuses it (though only a document's lookup
    // depends on it), after the prompt's own errors (the publisher checks the prompt).
    absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
        policy::CreatePolicy(policy_name, params);
    if (!policy.ok()) {
      if (absl::Status s = PrefixPublisher::CheckPrompt(layout, prompt); !s.ok()) return s;
      return policy.status();
    }
    const bool document =
        prompt.document_tokens > 0 && prompt.document_tokens < prompt.token_ids.size();
    return publisher_.Lookup(layout, prompt, document ? policy->get() : nullptr, params, quant,
                             config_.device_step);
  });
}

absl::StatusOr<PrefixPublisher::Chain> Engine::FleetChain(Layout layout, const PromptPrefix& prompt,
                                                          size_t max_blocks) {
  return GuardHostMemory("Lookup", [&]() -> absl::StatusOr<PrefixPublisher::Chain> {
    if (layout.block_tokens == 0) layout.block_tokens = config_.default_block_tokens;
    if (absl::Status s = ValidateLayout(layout, pool_->page_bytes()); !s.ok()) return s;
    return publisher_.FleetChain(layout, prompt, max_blocks);
  });
}

absl::StatusOr<AppendResult> Engine::Append(uint64_t sequence_id,
                                            absl::Span<const AppendChunk> chunks,
                                            const std::optional<HeldTable>& held) {
  return GuardHostMemory("Append", [&]() -> absl::StatusOr<AppendResult> {
    // One call: the session keeps the sequence locked throughout, so concurrent calls on the
    // sequence wait for it (as for any mutation) instead of finding an append open.
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    absl::StatusOr<std::unique_ptr<AppendSession>> session =
        AppendSession::Begin(append_rooms_, *std::move(ref), /*hold_lock=*/true);
    if (!session.ok()) return session.status();
    for (const AppendChunk& chunk : chunks) {
      if (absl::Status s = (*session)->Add(chunk); !s.ok()) return s;
    }
    return (*session)->Commit(held);
  });
}

absl::StatusOr<std::unique_ptr<AppendSession>> Engine::BeginAppend(uint64_t sequence_id) {
  return GuardHostMemory("Append", [&]() -> absl::StatusOr<std::unique_ptr<AppendSession>> {
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    return AppendSession::Begin(append_rooms_, *std::move(ref), /*hold_lock=*/false);
  });
}

absl::StatusOr<StepResult> Engine::Step(uint64_t sequence_id, const StepInput& input,
                                        const std::optional<HeldTable>& held) {
  return GuardHostMemory("Step", [&]() -> absl::StatusOr<StepResult> {
    absl::StatusOr<SequenceRef> ref = registry_.LockForChange(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    const uint64_t version_before = seq.version();
    absl::StatusOr<CheckedStep> checked = CheckStep(seq, input, 0, input.table_version);
    if (!checked.ok()) return checked.status();
    absl::StatusOr<StepResult> result = driver_.Step(seq, *checked);
    versions_.Publish(seq);
    if (result.ok()) {
      result->version = seq.version();
      result->table = versions_.Answer(seq, held, version_before);
    }
    return result;
  });
}

absl::StatusOr<CompressResult> Engine::Compress(uint64_t sequence_id, const CompressInput& input,
                                                const std::optional<HeldTable>& held) {
  return GuardHostMemory("Compress", [&]() -> absl::StatusOr<CompressResult> {
    absl::StatusOr<SequenceRef> ref = registry_.LockForChange(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    const uint64_t version_before = seq.version();
    absl::StatusOr<CheckedCompress> checked = CheckCompress(seq, input);
    if (!checked.ok()) return checked.status();
    absl::StatusOr<CompressResult> result = driver_.Compress(seq, *checked, input.target_tokens);
    if (result.ok()) result->table = versions_.Answer(seq, held, version_before);
    return result;
  });
}

absl::StatusOr<std::vector<StepOutcome>> Engine::StepBatch(absl::Span<const StepCall> calls) {
  return batches_.Run(calls);
}

absl::StatusOr<TableUpdate> Engine::GetTableUpdate(uint64_t sequence_id, uint64_t known_version,
                                                   bool positions, uint64_t version_before) {
  return GuardHostMemory("GetBlockTable", [&]() -> absl::StatusOr<TableUpdate> {
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    registry_.Renew(seq);
    return versions_.Update(seq, known_version, positions, version_before);
  });
}

absl::StatusOr<uint64_t> Engine::TableVersion(uint64_t sequence_id) {
  absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  seq.mu.AssertHeld();
  return seq.version();
}

absl::StatusOr<BlockTable> Engine::GetBlockTable(uint64_t sequence_id, bool positions,
                                                 uint32_t layer_begin, uint32_t layer_end,
                                                 uint64_t max_bytes) {
  return GuardHostMemory("GetBlockTable", [&]() -> absl::StatusOr<BlockTable> {
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    const uint32_t layers = seq.layout().num_layers;
    if (layer_begin == 0 && layer_end == 0) layer_end = layers;
    if (layer_end > layers || layer_begin >= layer_end) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer_begin/layer_end: [", layer_begin, ", ", layer_end,
                       ") is not a non-empty range within [0, ", layers, ")"));
    }
    if (max_bytes > 0) {
      // As packed, at most: per block entry its id (5 bytes), offset (as the pool's size),
      // precision (1), start and count (3 each); per position the last one's size (they
      // increase); per stream 32 more, and 256 for the table's own fields.
      const uint64_t per_block = 5 + VarintBytes(pool_->usage().pool_bytes) + 1 + 3 + 3;
      const size_t heads = seq.layout().num_kv_heads;
      uint64_t bytes = 256;
      for (size_t s = layer_begin * heads; s < layer_end * heads; ++s) {
        const Stream& st = seq.streams()[s];
        bytes += 32 + per_block * st.blocks().size();
        if (positions && st.size() > 0) {
          bytes += VarintBytes(static_cast<uint64_t>(st.positions().back())) * st.size();
        }
      }
      if (bytes > max_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("layer_begin/layer_end: the table of layers [", layer_begin, ", ",
                         layer_end, ") takes up to ", bytes, " bytes, past the message limit of ",
                         max_bytes, " (--max-message-bytes); ask for fewer layers at a time"));
      }
    }
    registry_.Renew(seq);
    return versions_.Table(seq, positions, layer_begin, layer_end);
  });
}

absl::Status Engine::ReadKV(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                            uint32_t layer_end, const std::function<absl::Status(StreamKV&&)>& sink,
                            uint64_t piece_bytes) {
  return GuardHostMemory("ReadKV", [&] {
    return reader_.Read(sequence_id, epoch, layer_begin, layer_end, sink, piece_bytes);
  });
}

absl::StatusOr<CreateResult> Engine::Fork(uint64_t sequence_id, absl::Duration lease) {
  return GuardHostMemory("Fork", [&] { return ForkImpl(sequence_id, lease); });
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
  absl::StatusOr<absl::Duration> granted = registry_.ResolveLease(lease);
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
  const bool device_step = config_.device_step && (*policy)->has_kernel_step();
  absl::StatusOr<PrefixPublisher::MapPlan> plan =
      publisher_.Plan(layout, prompt, **policy, params, quant, device_step);
  if (!plan.ok()) return plan.status();
  const std::string tenant_key = prompt.owner.empty() ? prompt.salt : prompt.owner;
  std::shared_ptr<HostShare> share = budget_.ShareOf(tenant_key);
  absl::StatusOr<HostReservation> host = budget_.Reserve(
      sizeof(Sequence) + uint64_t{layout.num_streams()} * sizeof(Stream), "CreateSequence", share);
  if (!host.ok()) return host.status();
  // The scores' one home (Sequence::slots): where the policy steps.
  std::unique_ptr<store::SlotState> slots;
  if (device_step) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> created =
        backend_->CreateSlotState(layout.num_streams());
    if (!created.ok()) return created.status();
    slots = *std::move(created);
  } else if ((*policy)->descriptor().initial_score) {
    slots = store::MakeHostScoreState(layout.num_streams());
  }
  // Held only now that the request is known good; the sequence gives the hold back when
  // it is released (ReleaseLocked).
  absl::StatusOr<store::TenantId> tenant = tenants_.Acquire(tenant_key);
  if (!tenant.ok()) return tenant.status();
  absl::Cleanup give_back_tenant = [this, &tenant_key] { tenants_.Release(tenant_key); };

  absl::StatusOr<TableVersions::Claimed> claimed = versions_.ClaimSlot();
  if (!claimed.ok()) return claimed.status();
  // Until the sequence owns it (an exception below would leak it for good).
  absl::Cleanup give_back_slot = [this, &claimed] { versions_.ReturnSlot(claimed->slot); };
  const uint64_t id = registry_.NewId();
  std::string name((*policy)->descriptor().name);
  auto seq =
      std::make_shared<Sequence>(id, layout, std::move(name), params, *std::move(policy), quant,
                                 *granted, claimed->slot, /*parent_id=*/0, *tenant, prompt.owner);
  seq->set_host_share(std::move(share));
  uint64_t reused = 0;
  {
    kvmem::MutexLock lock(&seq->mu);
    seq->set_epoch(claimed->epoch);
    const uint64_t version = versions_.NewVersion(*seq);
    seq->set_slots(std::move(slots), device_step);
    Sequence::PrefixState& state = seq->mutable_prefix();
    state.ns = PrefixPublisher::Namespace(layout, prompt.model);
    state.model = prompt.model;
    state.salt = prompt.salt;
    state.auto_publish = prompt.auto_publish;
    absl::StatusOr<uint64_t> mapped = publisher_.Map(*seq, prompt, *plan, &*host, version);
    if (!mapped.ok()) return mapped.status();
    reused = *mapped;
    seq->Publish();
    budget_.Account(*seq);
  }
  std::move(give_back_slot).Cancel();
  std::move(give_back_tenant).Cancel();  // the sequence's now (Register releases it on a throw)
  spdlog::debug("sequence {} created: policy {}, {} streams, {} prompt tokens reused", id,
                seq->policy_name(), layout.num_streams(), reused);
  absl::StatusOr<CreateResult> result = Register(seq);
  if (result.ok()) result->reused_prefix_tokens = reused;
  return result;
}

absl::StatusOr<CreateResult> Engine::ForkImpl(uint64_t sequence_id, absl::Duration lease) {
  absl::StatusOr<absl::Duration> granted = registry_.ResolveLease(lease);
  if (!granted.ok()) return granted.status();
  absl::StatusOr<SequenceRef> ref = registry_.LockForChange(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& parent = **ref;
  parent.mu.AssertHeld();
  absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
      policy::CreatePolicy(parent.policy_name(), parent.policy_params());
  if (!policy.ok()) return policy.status();
  // The child is the parent's tenant's: one more of its sequences.
  const std::string tenant_key = TenantKey(parent);
  if (absl::Status s = tenants_.AddHold(tenant_key); !s.ok()) return s;
  absl::Cleanup give_back_tenant = [this, &tenant_key] { tenants_.Release(tenant_key); };
  // The child copies the parent's host metadata and slot state: both count against the
  // host budget (beam search forks a lot), a slot state in device memory against the
  // device budget.
  const bool device_slots = parent.slots_accounted_on_device();
  absl::StatusOr<HostReservation> host =
      budget_.Reserve(parent.host_bytes() + (device_slots ? 0 : parent.slot_bytes_accounted()),
                      "Fork", parent.shared_host_share());
  if (!host.ok()) return host.status();
  absl::StatusOr<HostReservation> device =
      budget_.ReserveDevice(device_slots && parent.slots() ? parent.slots()->bytes() : 0, "Fork",
                            parent.shared_host_share());
  if (!device.ok()) return device.status();
  std::unique_ptr<store::SlotState> slots;
  if (parent.slots()) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> copy = parent.slots()->Clone();
    if (!copy.ok()) return copy.status();
    slots = *std::move(copy);
  }
  // The child's tables name the parent's blocks but live under an epoch of their own, never
  // used before: a reader holding a table of an earlier child that had this epoch slot must
  // never validate against this one.
  absl::StatusOr<TableVersions::Claimed> claimed = versions_.ClaimSlot();
  if (!claimed.ok()) return claimed.status();
  absl::Cleanup give_back_slot = [this, &claimed] { versions_.ReturnSlot(claimed->slot); };
  const uint64_t id = registry_.NewId();
  auto child = std::make_shared<Sequence>(
      id, parent.layout(), parent.policy_name(), parent.policy_params(), *std::move(policy),
      parent.quant(), *granted, claimed->slot, parent.id(), parent.tenant(), parent.owner());
  child->set_host_share(parent.shared_host_share());
  {
    kvmem::MutexLock lock(&child->mu);
    child->CopyStateFrom(parent, std::move(slots));
    child->set_epoch(claimed->epoch);
    budget_.Account(*child);
    for (const Stream& st : child->streams()) {
      for (const StreamBlock& b : st.blocks()) pool_->Ref({b.id});
    }
  }
  std::move(give_back_slot).Cancel();
  std::move(give_back_tenant).Cancel();  // the child's now: released with it
  registry_.Renew(parent);
  return Register(child);
}

std::string Engine::TenantKey(const Sequence& seq) {
  return seq.owner().empty() ? seq.prefix().salt : seq.owner();
}

absl::StatusOr<CreateResult> Engine::Register(const std::shared_ptr<Sequence>& seq) {
  try {
    registry_.Renew(*seq);
    CreateResult result{seq->id(), static_cast<uint32_t>(absl::ToInt64Seconds(seq->lease())),
                        seq->layout().block_tokens, seq->epoch_slot()};
    {
      kvmem::MutexLock lock(&seq->mu);
      result.epoch = seq->epoch();
      result.version = seq->version();
      seq->NoteAnswered(result.version);  // the client is told it: it may hold it
      versions_.Mirror(*seq);
    }
    registry_.Insert(seq);
    ++telemetry_.sequences_created;
    return result;
  } catch (...) {
    kvmem::MutexLock lock(&seq->mu);
    ReleaseLocked(*seq);
    throw;
  }
}

uint64_t Engine::ReleaseLocked(Sequence& seq) {
  if (seq.released()) return 0;
  // The word odd first: no reader accepts the tables once their blocks can be reused.
  versions_.Seal(seq);
  uint64_t freed = pool_->Unref(seq.TakeOrphans());
  freed += pool_->Unref(seq.TakePlan());  // blocks a write plan holds
  // Blocks a move's reader may still get: out of circulation until the export's hold lapses,
  // and the tenant's hold with them (its sequences counted until then).
  const int64_t hold_until = seq.move_export().until_ns;
  bool lingers = false;
  if (std::vector<store::BlockId> held = seq.EndMoveExport();
      !held.empty() && hold_until > absl::ToUnixNanos(registry_.Now())) {
    lingers = true;
    try {
      kvmem::MutexLock lock(&lingering_mu_);
      lingering_.reserve(lingering_.size() + 1);
      lingering_.push_back({hold_until, std::move(held), TenantKey(seq)});
    } catch (const std::bad_alloc&) {
      // Kept out of circulation for good rather than handed to another sequence under a read.
      spdlog::error("{} blocks of a released sequence's export kept (out of host memory)",
                    held.size());
    }
  } else {
    freed += pool_->Unref(held);
  }
  for (const Stream& st : seq.streams()) {
    for (const StreamBlock& b : st.blocks()) freed += pool_->Unref({b.id});
  }
  seq.Clear();
  budget_.Account(seq);
  versions_.ReturnSlot(seq.epoch_slot());
  if (!lingers) tenants_.Release(TenantKey(seq));  // after its blocks: a tenant holding none may go
  return freed;
}

std::vector<absl::Status> Engine::KeepAlive(absl::Span<const uint64_t> sequence_ids,
                                            const std::string* owner) {
  return registry_.KeepAlive(sequence_ids, owner);
}

uint32_t Engine::ExpireLeases() {
  const std::vector<std::shared_ptr<Sequence>> expired = registry_.TakeExpired();
  for (const auto& seq : expired) {
    kvmem::MutexLock lock(&seq->mu);
    const uint64_t freed = ReleaseLocked(*seq);
    spdlog::info("sequence {} released: lease of {}s lapsed ({} blocks freed)", seq->id(),
                 absl::ToInt64Seconds(seq->lease()), freed);
  }
  telemetry_.leases_expired += expired.size();
  std::vector<Lingering> lapsed;
  {
    const int64_t now = absl::ToUnixNanos(registry_.Now());
    kvmem::MutexLock lock(&lingering_mu_);
    lapsed.reserve(lingering_.size());  // before any is taken: the moves below cannot throw
    for (auto it = lingering_.begin(); it != lingering_.end();) {
      if (it->until_ns > now) {
        ++it;
        continue;
      }
      lapsed.push_back(std::move(*it));
      it = lingering_.erase(it);
    }
  }
  for (const Lingering& l : lapsed) {
    pool_->Unref(l.held);
    tenants_.Release(l.tenant_key);  // after its blocks: a tenant holding none may go
  }
  return static_cast<uint32_t>(expired.size());
}

void Engine::RunLeaseReaper(absl::Duration period, absl::Notification* stop) {
  while (!stop->WaitForNotificationWithTimeout(period)) ExpireLeases();
}

absl::StatusOr<uint64_t> Engine::Release(uint64_t sequence_id) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = registry_.Take(sequence_id);
  if (!seq.ok()) return seq.status();
  kvmem::MutexLock lock(&(*seq)->mu);
  return ReleaseLocked(**seq);
}

EngineStats Engine::Stats(bool include_sequences, const std::string* owner) {
  EngineStats stats;
  stats.pool = pool_->usage();
  for (uint32_t a = 1; a <= pool_->arenas(); ++a) {
    const std::string& tenant = config_.tenant_arenas[a - 1].first;
    if (owner != nullptr && *owner != tenant) continue;
    stats.arenas.push_back({tenant, pool_->arena_bytes(a), pool_->region_free_bytes(a)});
  }
  if (owner != nullptr) {  // the pool's size and the owner's sequences (below), nothing more
    stats.pool =
        store::PoolUsage{stats.pool.pool_bytes, stats.pool.page_bytes, stats.pool.pages_total};
  } else {
    stats.pool_free_bytes = pool_->free_bytes();
    stats.tokens_appended = telemetry_.tokens_appended;
    stats.stream_slots_evicted = telemetry_.stream_slots_evicted;
    stats.stream_slots_quantized = telemetry_.stream_slots_quantized;
    stats.bytes_moved = telemetry_.bytes_moved;
    stats.device_slot_state_bytes = budget_.device_slot_state_bytes();
    stats.slot_state_bytes = budget_.slot_state_bytes() + stats.device_slot_state_bytes;
    stats.host_metadata_bytes = budget_.host_bytes();
    stats.host_metadata_budget_bytes = budget_.budget();
    stats.device_metadata_budget_bytes = budget_.device_budget();
    if (const TableBoard* tables = versions_.tables()) {
      stats.table_area_heap_bytes = tables->heap_bytes();
      stats.table_area_used_bytes = tables->heap_bytes_in_use();
      stats.table_area_misses = tables->misses();
    }
    stats.steps = telemetry_.steps;
    stats.leases_expired = telemetry_.leases_expired;
    stats.prefix = publisher_.index().stats();
    stats.sequences_poisoned = telemetry_.sequences_poisoned;
    stats.blocks_forsaken = telemetry_.blocks_forsaken;
    stats.bytes_forsaken = telemetry_.bytes_forsaken;
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
  }
  const std::vector<std::shared_ptr<Sequence>> all = registry_.All();
  if (owner == nullptr) stats.sequences_active = static_cast<uint32_t>(all.size());
  // Table bytes by precision: the layout's dtype, then the quantized formats.
  absl::flat_hash_map<std::string, uint64_t> by_precision;
  const absl::Time now = registry_.Now();
  for (const auto& seq : all) {
    kvmem::MutexLock lock(&seq->mu);
    if (seq->released() || (owner != nullptr && seq->owner() != *owner)) continue;
    // O(streams) per sequence: every figure here is kept per stream.
    stats.kv_bytes += seq->kv_bytes();
    stats.full_cache_bytes += seq->appended() * 2 * seq->layout().payload_bytes(1);
    AddBlockBytes(*seq, &by_precision);
    if (owner == nullptr && !include_sequences) continue;
    SequenceSummary summary = Summarize(*seq, now);
    if (owner != nullptr) {  // the totals of a tenant's view are its sequences'
      ++stats.sequences_active;
      stats.tokens_appended += summary.appended_tokens;
      stats.steps += summary.steps;
      stats.slot_state_bytes += summary.slot_state_bytes;
      if (seq->slots_accounted_on_device()) {
        stats.device_slot_state_bytes += summary.slot_state_bytes;
      }
      stats.pool.blocks_used += summary.blocks;
      stats.pool.block_bytes_used += summary.pool_bytes_held;
    }
    if (include_sequences) stats.sequences.push_back(std::move(summary));
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
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    if (absl::Status s = seq.CheckInvariants(); !s.ok()) return s;
    absl::StatusOr<std::string> state = DescribeState(seq, *pool_);
    if (!state.ok()) return state.status();
    out = *std::move(state);
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
