#include "server/engine/decision_applier.h"

#include <algorithm>
#include <utility>

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

absl::Status DecisionApplier::ExecuteMany(absl::Span<Pending* const> pending) {
  // The moves of different sequences touch different blocks (a sequence moves rows only
  // within blocks it holds alone, and into blocks it allocated), so they run as disjoint
  // batches; quantizations go by format. One sequence's writes (a unary call) are used as
  // they are.
  std::vector<absl::Span<const store::MoveOp>> moves;
  std::vector<store::WriteOp> writes;
  std::vector<std::pair<const Sequence*, std::vector<store::QuantizeOp>>> quantizes;
  const bool one = pending.size() == 1;
  uint64_t moved = 0;
  for (Pending* p : pending) {
    const OpBatch& b = p->batch_;
    for (const store::MoveOp& op : b.moves) moved += op.bytes;
    moves.push_back(b.moves);
    if (!one) writes.insert(writes.end(), b.writes.begin(), b.writes.end());
    if (b.quantizes.empty()) continue;
    const Sequence& seq = *p->seq_;
    auto same = std::find_if(quantizes.begin(), quantizes.end(), [&](const auto& q) {
      const kernels::QuantGeometry &a = q.first->format().quant_geometry(),
                                   &g = seq.format().quant_geometry();
      return q.first->format().elem() == seq.format().elem() && a.type == g.type &&
             a.block_tokens == g.block_tokens && a.head_dim == g.head_dim;
    });
    if (same == quantizes.end()) same = quantizes.insert(quantizes.end(), {&seq, {}});
    same->second.insert(same->second.end(), b.quantizes.begin(), b.quantizes.end());
  }
  absl::Status io = backend_->MoveDisjoint(moves);
  if (io.ok()) io = backend_->Write(one ? pending[0]->batch_.writes : writes);
  for (size_t q = 0; io.ok() && q < quantizes.size(); ++q) {
    const Sequence& seq = *quantizes[q].first;
    io =
        backend_->Quantize(seq.format().elem(), seq.format().quant_geometry(), quantizes[q].second);
  }
  if (io.ok()) io = backend_->Synchronize();
  if (!io.ok()) {
    for (Pending* p : pending) {
      pool_->Unref(p->batch_.allocated);
      p->settled_ = true;
    }
    return io;
  }
  telemetry_->bytes_moved += moved;
  return io;
}

DecisionApplier::Pending::Pending(DecisionApplier* applier, Sequence* seq,
                                  const policy::Decision* decision, CommitHook commit)
    : applier_(applier), seq_(seq), decision_(decision), commit_(std::move(commit)) {}

DecisionApplier::Pending::~Pending() {
  if (!settled_) applier_->pool_->Unref(batch_.allocated);
  // An open section poisons the sequence as it goes.
}

absl::StatusOr<DecisionApplier::Applied> DecisionApplier::Apply(Sequence& seq,
                                                                const policy::Decision& decision,
                                                                CommitHook commit) {
  absl::StatusOr<std::unique_ptr<Pending>> pending = Plan(seq, decision, std::move(commit));
  if (!pending.ok()) return pending.status();
  absl::Status executed = absl::OkStatus();
  // A throw: the Pending gives the plan back, and its section poisons the sequence.
  if ((*pending)->executes()) executed = ExecuteMany({pending->get()});
  return Finish(**pending, executed);
}

absl::StatusOr<std::unique_ptr<DecisionApplier::Pending>> DecisionApplier::Plan(
    Sequence& seq, const policy::Decision& decision, CommitHook commit) {
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
  // what the plan took (the Pending, however planning ends) and changes nothing.
  std::unique_ptr<Pending> p(new Pending(this, &seq, &decision, std::move(commit)));
  OpBatch& batch = p->batch_;
  StreamPlanner planner(seq.format(), pool_, &batch, failpoints_, seq.tenant());
  Applied& applied = p->applied_;
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
  p->changed_.assign(num_streams, false);
  p->from_.assign(num_streams, 0);
  p->old_to_.assign(num_streams, 0);
  p->to_.assign(num_streams, 0);
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
      p->changed_[s] = true;
    }
    const size_t quantized_before = batch.quantizes.size();
    if (planned.ok()) planned = planner.Quantize(blocks, seq.quant().recent_tokens);
    if (batch.quantizes.size() != quantized_before) p->changed_[s] = true;
    if (!planned.ok()) return planned;  // the Pending gives the plan back
    p->from_[s] = range.begin;
    p->old_to_[s] = range.end;
    p->to_[s] = range.begin + blocks.size();
  }
  applied.quantized = batch.quantized_slots;
  if (applied.evicted == 0 && applied.quantized == 0) {
    pool_->Unref(batch.allocated);  // nothing is allocated when nothing changes; kept exact
    batch.allocated.clear();
    p->settled_ = true;
    return p;
  }
  // The point of no return: readers of the old table see the odd word before any byte
  // moves and before any dropped block can be reused; from here a failure poisons.
  p->section_.emplace(versions_, &seq);
  return p;
}

absl::StatusOr<DecisionApplier::Applied> DecisionApplier::Finish(Pending& p,
                                                                 const absl::Status& executed) {
  Sequence& seq = *p.seq_;
  seq.mu.AssertHeld();  // a Pending lives inside its sequence's lock
  const policy::Decision& decision = *p.decision_;
  OpBatch& batch = p.batch_;
  if (!p.section_) {
    if (absl::Status s = p.commit_(); !s.ok()) return versions_->Poison(seq, s);
    return p.applied_;
  }
  if (!executed.ok()) {
    if (!p.settled_) pool_->Unref(batch.allocated);
    p.settled_ = true;
    return versions_->Poison(seq, executed);
  }
  p.settled_ = true;  // the streams take the batch's blocks below
  std::vector<std::vector<StreamBlock>>& new_blocks = seq.spare_lists();
  if (absl::Status s = p.commit_(); !s.ok()) {
    KeepOrphans(seq, batch, new_blocks, 0);  // the batch's new blocks: Release frees them
    return versions_->Poison(seq, s);
  }
  const uint32_t history_rows = seq.policy().history_rows();
  size_t swapped = 0;  // streams [0, swapped) are committed
  // Nothing below should throw; if something does, the sequence is poisoned and keeps the
  // references no stream names for Release, so that the pool's accounting stays exact.
  absl::Cleanup on_unwind = [&] {
    seq.mu.AssertHeld();
    KeepOrphans(seq, batch, new_blocks, swapped, p.from_, p.to_);
    versions_->Poison(seq, absl::InternalError("a step's commit was interrupted")).IgnoreError();
  };
  const uint64_t version = versions_->NewVersion(seq);
  for (; swapped < seq.streams().size(); ++swapped) {
    const size_t s = swapped;
    if (s == seq.streams().size() / 2) Failpoints::ThrowIfHit(failpoints_, Failpoints::kCommit);
    if (!p.changed_[s]) continue;
    if (decision.keep[s] && decision.keep[s]->size() < seq.streams()[s].size()) {
      seq.stream(s).KeepSlots(*decision.keep[s], history_rows);
    }
    seq.stream(s).SwapBlocks(new_blocks[s], version, p.from_[s], p.old_to_[s]);
  }
  std::move(on_unwind).Cancel();
  pool_->Unref(batch.dropped);
  p.section_->Commit();
  const Applied& applied = p.applied_;
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
