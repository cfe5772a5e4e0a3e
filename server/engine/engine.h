#pragma once
// Engine: the request-level façade over the engine's rooms. It owns them and the backend,
// and composes them per call; none reaches into another:
//   SequenceRegistry  ids, lookup, calls in flight, leases         (sequence_registry.h)
//   TableVersions     epochs, versions, deltas, write sections, poisoning (table_versions.h)
//     TableBoard      its table area: every table in shared memory  (table_board.h)
//   HostBudget        host memory outside the pool                  (host_budget.h)
//   AppendSession     the append transaction                        (append_session.h)
//   input checks      every check of a Step/Compress/Append input   (input_checks.h)
//   PolicyDriver      signals -> policy decision -> DecisionApplier (policy_driver.h)
//   PrefixPublisher   publishing and mapping shared prefixes        (prefix_publisher.h)
//   BatchRunner       StepBatch's entries across cores, their device
//                     work batched where slot states step together (batch_runner.h)
//   KvReader          ReadKV in pieces                              (kv_reader.h)
//   Tenants           a cache salt's pool quota                     (tenants.h)
//   WritePlans        where in-place K/V goes, and its commits      (write_plans.h)
//   SequenceImport    a sequence moved here from another kvmemd     (sequence_move.h)
// Who calls whom (nothing calls the Engine back): BatchRunner -> AppendSession, input
// checks, PolicyDriver; PolicyDriver -> DecisionApplier -> TableVersions; AppendSession ->
// PrefixPublisher, TableVersions, HostBudget; every room -> SequenceRegistry (lookups,
// leases) and the store (pool, backend).
//
// Lock order: Sequence::mu -> the registry's -> BlockPool's; TableBoard's (its heap's free
// list) is taken under Sequence::mu and takes none. Several Sequence::mu are held at once
// only by a batched StepBatch, taken in the order of sequence ids. Calls on different sequences
// run in parallel; calls on one sequence are serialized. Every call validates its whole
// input before changing anything (an error return means no state changed), and a mutation
// given the client's held table answers its update under the same lock.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/append_session.h"
#include "server/engine/batch_runner.h"
#include "server/engine/clock.h"
#include "server/engine/decision_applier.h"
#include "server/engine/engine_types.h"
#include "server/engine/epoch_board.h"
#include "server/engine/host_budget.h"
#include "server/engine/kv_reader.h"
#include "server/engine/layout.h"
#include "server/engine/policy_driver.h"
#include "server/engine/prefix_publisher.h"
#include "server/engine/sequence_move.h"
#include "server/engine/sequence_registry.h"
#include "server/engine/table_versions.h"
#include "server/engine/telemetry.h"
#include "server/engine/tenants.h"
#include "server/engine/write_plans.h"
#include "server/policy/policy.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                        std::unique_ptr<store::Backend> backend,
                                                        const Clock* clock);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Who hears of the prefix index's entries (PrefixIndex::set_events); set before serving.
  void set_index_events(prefix::IndexEvents* events) { publisher_.index().set_events(events); }
  // PrefixIndex::Blocks.
  std::vector<std::pair<std::string, std::vector<prefix::BlockHash>>> PublishedBlocks() const {
    return publisher_.index().Blocks();
  }
  const EngineConfig& config() const { return config_; }
  const store::Backend& backend() const { return *backend_; }
  const EpochBoard& epoch_board() const { return versions_.board(); }
  const TableBoard* table_board() const { return versions_.tables(); }
  store::PoolUsage PoolUsage() const { return pool_->usage(); }
  uint64_t PoolFreeBytes() const { return pool_->free_bytes(); }
  // Counters and histograms since the daemon started (server/metrics reads them).
  const Telemetry& telemetry() const { return telemetry_; }

  // With a prompt (PromptPrefix::token_ids), the longest published prefix of it in the
  // same namespace and salt is mapped into the new sequence (CreateResult::
  // reused_prefix_tokens): whole blocks, leaving at least the prompt's last token to the
  // worker, so that it has logits to sample from.
  absl::StatusOr<CreateResult> CreateSequence(Layout layout, absl::string_view policy_name,
                                              const policy::ParamOverrides& params,
                                              QuantConfig quant, absl::Duration lease,
                                              const PromptPrefix& prompt = {});
  absl::StatusOr<CreateResult> Fork(uint64_t sequence_id, absl::Duration lease);
  // Returns the number of blocks whose last reference this dropped.
  absl::StatusOr<uint64_t> Release(uint64_t sequence_id);

  // PrefixPublisher::Publish (unset: every token), PublishDocument, Lookup.
  absl::StatusOr<uint64_t> Publish(uint64_t sequence_id, std::optional<uint64_t> up_to_tokens);
  absl::StatusOr<uint64_t> PublishDocument(uint64_t sequence_id);
  // With PromptPrefix::document_tokens, the representation is that of `policy_name`,
  // `params` and `quant`.
  absl::StatusOr<uint64_t> Lookup(Layout layout, const PromptPrefix& prompt,
                                  absl::string_view policy_name = "full",
                                  const policy::ParamOverrides& params = {},
                                  QuantConfig quant = {});

  // PrefixPublisher::FleetChain, after Lookup's checks of the layout.
  absl::StatusOr<PrefixPublisher::Chain> FleetChain(Layout layout, const PromptPrefix& prompt,
                                                    size_t max_blocks);

  // Appends the chunks in order, atomically: all are validated and their blocks allocated
  // before any byte is written.
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, absl::Span<const AppendChunk> chunks,
                                      const std::optional<HeldTable>& held = std::nullopt);
  // A streamed append (AppendStream): AppendSession.
  absl::StatusOr<std::unique_ptr<AppendSession>> BeginAppend(uint64_t sequence_id);
  absl::StatusOr<StepResult> Step(uint64_t sequence_id, const StepInput& input,
                                  const std::optional<HeldTable>& held = std::nullopt);
  absl::StatusOr<CompressResult> Compress(uint64_t sequence_id, const CompressInput& input,
                                          const std::optional<HeldTable>& held = std::nullopt);
  // The decode loop's call: per entry, the new token(s) appended and the step, with the
  // table update from the client's held table (BatchRunner).
  absl::StatusOr<std::vector<StepOutcome>> StepBatch(absl::Span<const StepCall> calls);

  // What changed in the sequence's tables since `known_version` (TableVersions::Update), for
  // a client that lost a call's answer (a replayed retry). `version_before`: see there.
  static constexpr uint64_t kNoCall = ~uint64_t{0};
  absl::StatusOr<TableUpdate> GetTableUpdate(uint64_t sequence_id, uint64_t known_version,
                                             bool positions, uint64_t version_before = kNoCall);
  // The sequence's table version now.
  absl::StatusOr<uint64_t> TableVersion(uint64_t sequence_id);
  // Layers [layer_begin, layer_end) (both 0: every layer). With `max_bytes`, a table whose
  // answer would take more (its block entries and positions, as packed in a message) is
  // RESOURCE_EXHAUSTED: a huge sequence's table is asked for in pieces.
  absl::StatusOr<BlockTable> GetBlockTable(uint64_t sequence_id, bool positions = true,
                                           uint32_t layer_begin = 0, uint32_t layer_end = 0,
                                           uint64_t max_bytes = 0);
  // KvReader::Read.
  absl::Status ReadKV(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                      uint32_t layer_end, const std::function<absl::Status(StreamKV&&)>& sink,
                      uint64_t piece_bytes = 0);

  // SequenceRegistry::CheckOwner: NOT_FOUND, as for an unknown id, unless the sequence is
  // `owner`'s.
  absl::Status CheckOwner(uint64_t sequence_id, absl::string_view owner) const {
    return registry_.CheckOwner(sequence_id, owner);
  }
  // The layout sequence `sequence_id` was created with (fixed for its life); NOT_FOUND if
  // it is gone.
  absl::StatusOr<Layout> LayoutOf(uint64_t sequence_id) {
    absl::StatusOr<SequenceRef> ref = registry_.Find(sequence_id);
    if (!ref.ok()) return ref.status();
    return (*ref)->layout();
  }
  // Tenants holding a sequence or pool bytes now (Tenants::registered).
  size_t tenants_registered() const { return tenants_.registered(); }
  // The pool arena of an authenticated tenant (0: none: its blocks are in the shared part).
  uint32_t ArenaOf(absl::string_view tenant) const { return tenants_.ArenaOf(tenant); }
  // SequenceRegistry::KeepAlive.
  std::vector<absl::Status> KeepAlive(absl::Span<const uint64_t> sequence_ids,
                                      const std::string* owner = nullptr);
  // Releases every sequence whose lease has lapsed; returns how many. Gives back the blocks
  // of released sequences' exports whose hold lapsed.
  uint32_t ExpireLeases();
  // Runs ExpireLeases every `period` until `stop` is notified.
  void RunLeaseReaper(absl::Duration period, absl::Notification* stop);
  // Past the high watermark of pages in use, gives cached prefix blocks back down to the
  // low one (EngineConfig::cache_high_watermark); returns the pool bytes freed. The daemon
  // runs it with the lease reaper.
  uint64_t ReclaimToWatermark();

  // Locks each sequence in turn (the memory totals are kept per stream): for Stats and
  // /metrics. With `owner`, a tenant's view: the pool's size, and that owner's sequences
  // and what they hold (pool bytes as the blocks they name, shared ones counted by each);
  // nothing summed over other tenants (usage, counters since the start, prefix hits, the
  // table area) is in it.
  EngineStats Stats(bool include_sequences, const std::string* owner = nullptr);
  // Everything a sequence holds, as text (per-slot metadata and scores, block list, K/V),
  // without the epoch: equal before and after a call exactly when the call changed nothing
  // a later call could see. For tests (state fingerprints around failures).
  absl::StatusOr<std::string> Fingerprint(uint64_t sequence_id);

  // A sequence moved to or from another kvmemd (sequence_move.h). The holder's side:
  // BeginExport freezes the sequence for `hold` and describes it (`scores`: each stream's,
  // none when its policy keeps none); ExportPiece fills the piece at `cursor` and advances
  // it (false: none left; ABORTED once the export ended or its hold lapsed); FinishExport
  // releases the sequence (`moved`: the receiver committed; ABORTED when the hold lapsed
  // first) or unfreezes it.
  absl::StatusOr<MovedHeader> BeginExport(uint64_t sequence_id, absl::Duration hold,
                                          std::vector<std::vector<float>>* scores);
  // `by_offset`: the piece names its blocks' pool offsets instead of carrying their bytes,
  // and the blocks are held until the export ends (FinishExport, a Release, the next export).
  absl::StatusOr<bool> ExportPiece(uint64_t sequence_id, uint64_t export_id,
                                   const std::vector<std::vector<float>>& scores, bool by_offset,
                                   ExportCursor* cursor, MovedPiece* piece);
  absl::StatusOr<uint64_t> FinishExport(uint64_t sequence_id, uint64_t export_id, bool moved);
  // Whether export `export_id` of sequence `sequence_id` ended in a move a short while ago
  // (a FinishExport repeated after its answer was lost); `owner` null: any owner's.
  bool ExportMoved(uint64_t sequence_id, uint64_t export_id, const std::string* owner) const {
    return moved_exports_.Moved(export_id, sequence_id, owner);
  }
  // The receiver's side: an import of the header's sequence for `owner` (the authenticated
  // tenant, "" for none; the header's salt checked against it by the caller), its host
  // memory and tenant held; its pieces come through SequenceImport::Add; CommitImport makes
  // it a sequence with `lease`.
  absl::StatusOr<std::unique_ptr<SequenceImport>> BeginImport(MovedHeader header,
                                                              const std::string& owner);
  absl::StatusOr<CreateResult> CommitImport(SequenceImport& import, absl::Duration lease);

 private:
  Engine(const EngineConfig& config, std::unique_ptr<store::Backend> backend,
         std::unique_ptr<store::BlockPool> pool, std::unique_ptr<EpochBoard> board,
         prefix::BlockHash prefix_root, const Clock* clock);
  absl::StatusOr<CreateResult> CreateSequenceImpl(Layout layout, absl::string_view policy_name,
                                                  const policy::ParamOverrides& params,
                                                  QuantConfig quant, absl::Duration lease,
                                                  const PromptPrefix& prompt);
  absl::StatusOr<CreateResult> ForkImpl(uint64_t sequence_id, absl::Duration lease);
  // Registers a new sequence; if that throws, the sequence gives back what it holds (its
  // blocks, its epoch slot) before the exception goes on.
  absl::StatusOr<CreateResult> Register(const std::shared_ptr<Sequence>& seq);
  uint64_t ReleaseLocked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The key Tenants counts the sequence under (Tenants).
  static std::string TenantKey(const Sequence& seq) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  uint64_t ReclaimToWatermarkImpl();

  const EngineConfig config_;
  const std::unique_ptr<store::Backend> backend_;
  const std::unique_ptr<store::BlockPool> pool_;
  Telemetry telemetry_;
  PrefixPublisher publisher_;  // holds pool references: declared after the pool
  HostBudget budget_;
  TableVersions versions_;
  SequenceRegistry registry_;
  Tenants tenants_;
  DecisionApplier applier_;
  PolicyDriver driver_;
  KvReader reader_;
  std::optional<WritePlans> plans_;  // with EngineConfig::in_place_writes
  const AppendRooms append_rooms_;
  BatchRunner batches_;
  MovedExports moved_exports_;
  // The blocks of exports by offsets whose sequence was released before the export ended: a
  // receiver may still be getting them, so they stay out of circulation until the hold the
  // export promised lapses (ExpireLeases gives them back).
  struct Lingering {
    int64_t until_ns;
    std::vector<store::BlockId> held;
    std::string tenant_key;  // Tenants' hold, kept until then
  };
  absl::Mutex lingering_mu_;
  std::vector<Lingering> lingering_ ABSL_GUARDED_BY(lingering_mu_);
};

}  // namespace kvmem::engine
