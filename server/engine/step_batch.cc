// The decode loop: a batch of folded steps (append, then step) across sequences, and the
// table updates that let a client keep its block tables without fetching them.
#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/common/parallel.h"
#include "server/engine/engine.h"

namespace kvmem::engine {

absl::Status Engine::StaleEpoch(const Sequence& seq, absl::string_view message,
                                absl::StatusCode code) {
  absl::Status status(code, message);
  status.SetPayload(kCurrentEpochPayload, absl::Cord(absl::StrCat(seq.epoch())));
  status.SetPayload(kCurrentVersionPayload, absl::Cord(absl::StrCat(seq.version())));
  return status;
}

TableUpdate Engine::TableDelta(const Sequence& seq, uint64_t known_version, bool positions,
                               uint64_t version_before) const {
  if (known_version > version_before) known_version = 0;  // a guess: none held
  TableUpdate update;
  update.base_version = known_version;
  update.version = seq.version();
  update.epoch = seq.epoch();
  // A version past every one a client was told of cannot be held: the whole table.
  const int which = known_version <= seq.answered_version() ? seq.PublishedSlot(known_version) : -1;
  if (which < 0) {
    update.table = TableOf(seq, positions);  // notes the version as answered
    return update;
  }
  seq.NoteAnswered(update.version);
  update.streams.reserve(seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const Stream& st = seq.streams()[s];
    if (st.changed_version() <= known_version) continue;
    const std::vector<StreamBlock>& blocks = st.blocks();
    StreamDelta delta;
    delta.stream = static_cast<uint32_t>(s);
    delta.block_count = static_cast<uint32_t>(blocks.size());
    absl::Span<const int64_t> all = st.positions();
    size_t slot = 0;  // the first slot of blocks[i]
    // Entries the changes since the client's version left untouched (an append's front, a step's
    // blocks between its head and its tail): where the client holds them, one run, without
    // walking them. The ends are checked all the same; positions need every block's slot
    // count: walk then.
    const Stream::UntouchedRun& run = st.untouched();
    const bool skip = !positions && run.size() > 0 && run.end <= blocks.size() &&
                      st.untouched_base() == known_version &&
                      blocks[run.begin].version <= known_version &&
                      blocks[run.end - 1].version <= known_version &&
                      static_cast<ptrdiff_t>(blocks[run.begin].published_index[which]) ==
                          static_cast<ptrdiff_t>(run.begin) - run.shift &&
                      static_cast<ptrdiff_t>(blocks[run.end - 1].published_index[which]) ==
                          static_cast<ptrdiff_t>(run.end - 1) - run.shift;
    // `count` entries from index `at` held by the client from its index `from` on.
    const auto keep = [&delta](size_t at, uint32_t from, uint32_t count) {
      KeptRun* last = delta.kept.empty() ? nullptr : &delta.kept.back();
      if (last != nullptr && last->at + last->count == at && last->from + last->count == from) {
        last->count += count;
      } else {
        delta.kept.push_back({static_cast<uint32_t>(at), from, count});
      }
    };
    for (size_t i = 0; i < blocks.size(); slot += blocks[i].count, ++i) {
      if (skip && i == run.begin) {
        keep(i, blocks[i].published_index[which], static_cast<uint32_t>(run.size()));
        i = run.end - 1;  // (`slot` goes wrong from here: it counts for positions only)
        continue;
      }
      const StreamBlock& b = blocks[i];
      if (b.version <= known_version) {  // held by the client: where it sits there
        keep(i, b.published_index[which], 1);
        continue;
      }
      delta.blocks.push_back({b.id, pool_->offset(b.id), b.start, b.count, b.precision});
      if (positions) {
        delta.positions.insert(delta.positions.end(), all.begin() + static_cast<ptrdiff_t>(slot),
                               all.begin() + static_cast<ptrdiff_t>(slot + b.count));
      }
    }
    update.streams.push_back(std::move(delta));
  }
  return update;
}

absl::StatusOr<TableUpdate> Engine::GetTableUpdate(uint64_t sequence_id, uint64_t known_version,
                                                   bool positions, uint64_t version_before) {
  return Guard("GetBlockTable", [&]() -> absl::StatusOr<TableUpdate> {
    absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Renew(**ref);
    return TableDelta(**ref, known_version, positions, version_before);
  });
}

absl::StatusOr<uint64_t> Engine::TableVersion(uint64_t sequence_id) {
  return Guard("TableVersion", [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<SequenceRef> ref = Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    return [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return (*ref)->version(); }();
  });
}

StepOutcome Engine::StepCallImpl(const StepCall& call) {
  StepOutcome out;
  if (!call.rejected.ok()) {
    out.status = call.rejected;
    return out;
  }
  if (!call.append && !call.step) {
    out.status = absl::InvalidArgumentError("neither an append nor a step");
    return out;
  }
  absl::StatusOr<SequenceRef> ref = LockForChange(call.sequence_id);
  if (!ref.ok()) {
    out.status = ref.status();
    return out;
  }
  // An append goes through a session holding the lock to the end of the call; the step and
  // the update then run on the same locked sequence.
  std::unique_ptr<AppendSession> session;
  Sequence* seq = &**ref;
  // For the update: a held version past it is a guess at this call's own (TableDelta).
  const uint64_t version_before = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return seq->version(); }();
  std::optional<SequenceRef> locked;
  if (call.append) {
    absl::StatusOr<std::unique_ptr<AppendSession>> begun =
        BeginAppendLocked(*std::move(ref), /*hold_lock=*/true);
    if (!begun.ok()) {
      out.status = begun.status();
      return out;
    }
    session = *std::move(begun);
    session->publish_ = false;
  } else {
    locked.emplace(*std::move(ref));
  }
  auto finish = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    seq->Publish();
    if (call.table_version && !seq->poisoned() && !seq->released()) {
      try {
        out.table = TableDelta(*seq, *call.table_version, call.positions, version_before);
      } catch (const std::bad_alloc&) {
        // Everything applied; the client goes without the update and fetches its table.
      }
    }
  };
  [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // Everything is checked before anything applies: the chunk (staged by the session,
    // where no table looks) and the step's signals over the tokens it adds.
    if (session) {
      if (absl::Status s = session->Add(*call.append); !s.ok()) {
        out.status = s;
        return;
      }
    }
    std::optional<PreparedStep> prepared;
    if (call.step) {
      const size_t pending = call.append ? call.append->positions.size() : 0;
      absl::StatusOr<PreparedStep> p =
          PrepareStep(*seq, *call.step, pending,
                      call.step->table_version != 0 ? call.step->table_version
                                                    : call.table_version.value_or(0));
      if (!p.ok()) {
        out.status = p.status();
        return;
      }
      prepared = *std::move(p);
    }
    if (session) {
      absl::StatusOr<AppendResult> appended = session->Commit();
      if (!appended.ok()) {
        out.status = appended.status();
        return;
      }
      out.appended = *appended;
    }
    if (prepared) {
      // Past the append's commit: host memory running out in the step must not hide that
      // the append applied (the step itself applies whole, poisons, or changes nothing).
      absl::StatusOr<StepResult> stepped = Guard("Step", [&] { return RunStep(*seq, *prepared); });
      if (!stepped.ok()) {
        out.status = stepped.status();
        return;
      }
      out.step = *stepped;
    }
  }();
  finish();
  if (out.appended) out.appended->version = seq->version();
  if (out.step) out.step->version = seq->version();
  return out;
}

absl::StatusOr<std::vector<StepOutcome>> Engine::StepBatch(absl::Span<const StepCall> calls) {
  return Guard("StepBatch", [&]() -> absl::StatusOr<std::vector<StepOutcome>> {
    absl::flat_hash_set<uint64_t> seen;
    seen.reserve(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!seen.insert(calls[i].sequence_id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("entries[", i, "].sequence_id: sequence ", calls[i].sequence_id,
                         " appears twice in one batch (one entry per sequence)"));
      }
    }
    std::vector<StepOutcome> outcomes(calls.size());
    // Whether entry i ran: once one has, the batch answers per entry whatever happens.
    std::vector<char> ran(calls.size(), 0);
    auto run = [&](size_t i) noexcept {
      ran[i] = 1;
      try {
        outcomes[i] = StepCallImpl(calls[i]);
      } catch (const std::bad_alloc&) {
        // Before its first commit (StepCallImpl keeps what applied after it).
        outcomes[i].status = absl::ResourceExhaustedError(
            "StepBatch: out of host memory (kvmemd could not allocate)");
      }
    };
    // Entries name different sequences, so they take different locks: they run on every
    // core TBB has (the caller's thread included), one entry per task, isolated from other
    // loops (ParallelFor), and in order under ThreadSanitizer, which cannot see oneTBB.
    if (calls.size() < 2 || !config_.parallel_batches) {
      for (size_t i = 0; i < calls.size(); ++i) run(i);
    } else {
      try {
        ParallelFor(calls.size(), 1, [&](size_t begin, size_t end) {
          for (size_t i = begin; i < end; ++i) run(i);
        });
      } catch (const std::exception&) {
        // The scheduler itself failed (no task ran, or some did): the rest run here.
      }
      for (size_t i = 0; i < calls.size(); ++i) {
        if (!ran[i]) run(i);
      }
    }
    return outcomes;
  });
}

}  // namespace kvmem::engine
