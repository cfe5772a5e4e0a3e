#include "server/engine/write_plans.h"

#include "absl/strings/str_cat.h"

namespace kvmem::engine {

absl::StatusOr<PlanView> WritePlans::Make(Sequence& seq, uint32_t tokens) {
  const uint32_t B = seq.format().block_tokens();
  if (tokens == 0 || tokens > B) {
    return absl::InvalidArgumentError(absl::StrCat("plan_tokens: ", tokens, " is outside [1, ", B,
                                                   "] (the sequence's block_tokens)"));
  }
  Drop(seq);
  const size_t S = seq.num_streams();
  Sequence::WritePlan plan;
  plan.version = seq.version();
  plan.tokens = tokens;
  plan.streams.resize(S);
  plan.held.reserve(S);  // every allocation before the pool's: nothing to undo after
  PlanView view;
  view.tokens = tokens;
  view.block_offsets.resize(S);
  view.first_slots.resize(S);
  size_t fresh = 0;
  for (size_t s = 0; s < S; ++s) {
    Sequence::WritePlan::Target& target = plan.streams[s];
    const std::vector<StreamBlock>& blocks = seq.streams()[s].blocks();
    if (!blocks.empty()) {
      const StreamBlock& last = blocks.back();
      if (last.precision == Precision::kLayout && last.start + last.count + tokens <= B &&
          pool_->refs(last.id) == 1) {
        target = {last.id, last.start + last.count, false};
        plan.held.push_back(last.id);
        continue;
      }
    }
    target.fresh = true;
    ++fresh;
  }
  std::vector<store::BlockId> ids;
  if (fresh > 0) {
    ids.reserve(fresh);
    if (failpoints_ != nullptr && failpoints_->Hit(Failpoints::kAllocate)) {
      return absl::ResourceExhaustedError("pool: allocation failed (failpoint)");
    }
    if (absl::Status s =
            pool_->AllocateMany(static_cast<uint32_t>(seq.format().block_bytes(Precision::kLayout)),
                                fresh, &ids, store::BlockPool::Use::kGrow, seq.tenant());
        !s.ok()) {
      return s;
    }
  }
  pool_->Ref(plan.held);  // the tails: referenced by their stream and by the plan
  size_t next = 0;
  for (Sequence::WritePlan::Target& target : plan.streams) {
    if (target.fresh) {
      target.block = ids[next++];
      plan.held.push_back(target.block);
    }
  }
  for (size_t s = 0; s < S; ++s) {
    view.block_offsets[s] = pool_->offset(plan.streams[s].block);
    view.first_slots[s] = plan.streams[s].slot;
  }
  plan.id = next_id_.fetch_add(1, std::memory_order_relaxed);
  view.id = plan.id;
  seq.set_plan(std::move(plan));
  return view;
}

absl::Status WritePlans::CheckCommit(const Sequence& seq, uint64_t id, size_t n) const {
  const std::optional<Sequence::WritePlan>& plan = seq.plan();
  if (!plan) {
    return absl::FailedPreconditionError(
        absl::StrCat("append.plan_id: plan ", id,
                     " is not this sequence's: it has no write plan (ask for one with "
                     "plan_tokens, then write the tokens again)"));
  }
  if (plan->id != id) {
    return absl::FailedPreconditionError(
        absl::StrCat("append.plan_id: plan ", id, " is not this sequence's current plan (",
                     plan->id, "); write the tokens again at the current one"));
  }
  if (n > plan->tokens) {
    return absl::InvalidArgumentError(absl::StrCat("append.positions: ", n,
                                                   " tokens written at plan ", id,
                                                   ", which has room for ", plan->tokens));
  }
  const auto stale = [&](absl::string_view why) {
    return absl::FailedPreconditionError(
        absl::StrCat("append.plan_id: plan ", id, " is stale: ", why,
                     "; ask for a new plan and write the tokens again"));
  };
  if (plan->version != seq.version()) {
    return stale(absl::StrCat("it was made on table version ", plan->version,
                              " and the table has changed since (version ", seq.version(), ")"));
  }
  for (size_t s = 0; s < plan->streams.size(); ++s) {
    const Sequence::WritePlan::Target& target = plan->streams[s];
    if (target.fresh) continue;
    const std::vector<StreamBlock>& blocks = seq.streams()[s].blocks();
    // The same version means the same lists; a tail shared since (a Fork) is immutable.
    if (blocks.empty() || blocks.back().id != target.block ||
        blocks.back().start + blocks.back().count != target.slot ||
        pool_->refs(target.block) != 2) {
      return stale(absl::StrCat("the last block of stream ", s, " is shared or moved since"));
    }
  }
  return absl::OkStatus();
}

void WritePlans::Drop(Sequence& seq) { pool_->Unref(seq.TakePlan()); }

}  // namespace kvmem::engine
