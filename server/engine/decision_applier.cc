#include "server/engine/decision_applier.h"

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace kvmem::engine {

void KeepOrphans(Sequence& seq, const OpBatch& batch,
                 const std::vector<std::vector<StreamBlock>>& other_lists, size_t swapped,
                 const std::vector<size_t>& from, const std::vector<size_t>& to) {
  // References held = old lists + the batch's allocations (nothing dropped yet); streams
  // [0, swapped) hold their new entries in [from[s], to[s]) (0 and the list's end when not
  // given) and other_lists[s] the old ones, the rest still hold the old list. What no
  // stream names is kept for Release.
  absl::flat_hash_map<store::BlockId, int64_t> refs;
  for (store::BlockId id : batch.allocated) ++refs[id];
  for (size_t s = 0; s < swapped && s < seq.streams().size(); ++s) {
    for (const StreamBlock& b : other_lists[s]) ++refs[b.id];
    const std::vector<StreamBlock>& now = seq.streams()[s].blocks();
    const size_t end = to.empty() ? now.size() : std::min(to[s], now.size());
    for (size_t i = from.empty() ? 0 : from[s]; i < end; ++i) --refs[now[i].id];
  }
  for (const auto& [id, n] : refs) {
    for (int64_t i = 0; i < n; ++i) seq.AddOrphan(id);
  }
}

absl::Status DecisionApplier::Execute(const Sequence& seq, OpBatch& batch) {
  const kernels::QuantGeometry& geometry = seq.format().quant_geometry();
  absl::Status io = backend_->Move(batch.moves);
  if (io.ok()) io = backend_->Write(batch.writes);
  if (io.ok() && !batch.quantizes.empty()) {
    io = backend_->Quantize(seq.format().elem(), geometry, batch.quantizes);
  }
  if (io.ok()) io = backend_->Synchronize();
  if (!io.ok()) {
    pool_->Unref(batch.allocated);
    return io;
  }
  uint64_t moved = 0;
  for (const store::MoveOp& op : batch.moves) moved += op.bytes;
  telemetry_->bytes_moved += moved;
  return io;
}

absl::StatusOr<DecisionApplier::Applied> DecisionApplier::Apply(Sequence& seq,
                                                                const policy::Decision& decision,
                                                                const CommitHook& commit) {
  if (decision.keep.size() != seq.streams().size()) {
    return absl::InternalError(absl::StrCat("policy ", seq.policy_name(), " returned ",
                                            decision.keep.size(), " keep-sets for ",
                                            seq.streams().size(), " streams"));
  }
  // Validate the policy's output before touching anything.
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    if (decision.keep[s] && !decision.keep[s]->ValidFor(seq.streams()[s].size())) {
      return absl::InternalError(absl::StrCat("policy ", seq.policy_name(),
                                              " returned an invalid keep-set for stream ", s));
    }
  }

  // Plan: every allocation happens here, before the point of no return; a failure releases
  // what the plan took and changes nothing.
  OpBatch batch;
  StreamPlanner planner(seq.format(), pool_, &batch, failpoints_, seq.tenant());
  // What the plan took goes back however planning ends (an error, or a host allocation
  // that throws), until the point of no return hands it to the batch's execution.
  bool plan_settled = false;
  auto release_plan = [&] {
    plan_settled = true;
    pool_->Unref(batch.allocated);
  };
  absl::Cleanup release_unless_handed_over = [&] {
    if (!plan_settled) release_plan();
  };
  Applied applied;
  // The new entries go to the sequence's spare lists, whose room earlier steps left there
  // (empty for a stream that does not change: KeepOrphans reads them). Stream s replaces
  // its entries [from[s], old_to[s]) by new_blocks[s], which ends up at [from[s], to[s]):
  // without quantization, only the entries that lose slots and one neighbour on each side
  // (for merges) are planned, so a step that drops a slot or two per stream copies and
  // pairs a few entries, not the stream's whole list.
  const size_t num_streams = seq.streams().size();
  const uint64_t B = seq.layout().block_tokens;
  std::vector<std::vector<StreamBlock>>& new_blocks = seq.spare_lists();
  new_blocks.resize(num_streams);
  std::vector<bool> changed(num_streams, false);
  std::vector<size_t> from(num_streams, 0), old_to(num_streams, 0), to(num_streams, 0);
  for (size_t s = 0; s < num_streams; ++s) {
    const Stream& st = seq.streams()[s];
    std::vector<StreamBlock>& blocks = new_blocks[s];
    blocks.clear();
    const bool evicts = decision.keep[s] && decision.keep[s]->size() < st.size();
    if (!evicts && !seq.format().quantizes()) continue;  // nothing can change in this stream
    // The whole list when the format quantizes (Quantize walks it all) or when the list is
    // longer than a merged one can be (blocks left apart while shared: merge them all).
    EntryRange range{0, st.blocks().size(), 0};
    const uint64_t merged_most = 2 * ((st.size() + B - 1) / B) + 1;
    if (!seq.format().quantizes() && st.blocks().size() <= merged_most) {
      range = EvictedEntries(st.blocks(), st.size(), *decision.keep[s]);
    }
    blocks.assign(st.blocks().begin() + static_cast<ptrdiff_t>(range.begin),
                  st.blocks().begin() + static_cast<ptrdiff_t>(range.end));
    absl::Status planned = absl::OkStatus();
    if (evicts) {
      applied.evicted += st.size() - decision.keep[s]->size();
      planned = planner.Keep(blocks, *decision.keep[s], range.first_slot);
      if (planned.ok()) planned = planner.Merge(blocks);
      changed[s] = true;
    }
    const size_t quantized_before = batch.quantizes.size();
    if (planned.ok()) planned = planner.Quantize(blocks, seq.quant().recent_tokens);
    if (batch.quantizes.size() != quantized_before) changed[s] = true;
    if (!planned.ok()) return planned;  // release_unless_handed_over gives the plan back
    from[s] = range.begin;
    old_to[s] = range.end;
    to[s] = range.begin + blocks.size();
  }
  applied.quantized = batch.quantized_slots;
  if (applied.evicted == 0 && applied.quantized == 0) {
    release_plan();  // nothing is allocated when nothing changes; kept exact
    if (absl::Status s = commit(); !s.ok()) return versions_->Poison(seq, s);
    return applied;
  }

  // The point of no return: readers of the old table see the odd word before any byte
  // moves and before any dropped block can be reused; from here a failure poisons.
  TableVersions::WriteSection section(versions_, &seq);
  const absl::Status io = Execute(seq, batch);  // a throw: the cleanup gives the plan back
  plan_settled = true;  // Execute gave it back if it failed; else the streams take it below
  if (!io.ok()) return versions_->Poison(seq, io);
  if (absl::Status s = commit(); !s.ok()) {
    KeepOrphans(seq, batch, new_blocks, 0);  // the batch's new blocks: Release frees them
    return versions_->Poison(seq, s);
  }
  const uint32_t history_rows = seq.policy().history_rows();
  size_t swapped = 0;  // streams [0, swapped) are committed
  // Nothing below should throw; if something does, the sequence is poisoned and keeps the
  // references no stream names for Release, so that the pool's accounting stays exact.
  absl::Cleanup on_unwind = [&] {
    seq.mu.AssertHeld();
    KeepOrphans(seq, batch, new_blocks, swapped, from, to);
    versions_->Poison(seq, absl::InternalError("a step's commit was interrupted")).IgnoreError();
  };
  const uint64_t version = versions_->NewVersion(seq);
  for (; swapped < seq.streams().size(); ++swapped) {
    const size_t s = swapped;
    if (s == seq.streams().size() / 2) Failpoints::ThrowIfHit(failpoints_, Failpoints::kCommit);
    if (!changed[s]) continue;
    if (decision.keep[s] && decision.keep[s]->size() < seq.streams()[s].size()) {
      seq.stream(s).KeepSlots(*decision.keep[s], history_rows);
    }
    seq.stream(s).SwapBlocks(new_blocks[s], version, from[s], old_to[s]);
  }
  std::move(on_unwind).Cancel();
  pool_->Unref(batch.dropped);
  section.Commit();
  telemetry_->stream_slots_evicted += applied.evicted;
  telemetry_->stream_slots_quantized += applied.quantized;
  if (PolicyTelemetry* t = telemetry_->For(seq.policy_name())) {
    const double streams = static_cast<double>(seq.streams().size());
    t->stream_slots_evicted += applied.evicted;
    t->stream_slots_quantized += applied.quantized;
    t->tokens_evicted.Add(static_cast<double>(applied.evicted) / streams);
    t->tokens_quantized.Add(static_cast<double>(applied.quantized) / streams);
  }
  return applied;
}

}  // namespace kvmem::engine
