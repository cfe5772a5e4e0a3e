// Append: all chunks of one call, planned and allocated before any byte is written, then
// committed into reserved capacity.
#include <cmath>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "server/engine/engine.h"

namespace kvmem::engine {

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

}  // namespace kvmem::engine
