#include "server/engine/batch_runner.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/common/parallel.h"
#include "server/engine/guard.h"
#include "server/engine/input_checks.h"

namespace kvmem::engine {

namespace {

// Calls run(i) once for every i < ran.size(): across cores when `parallel` (one index per
// task, the caller's thread included, isolated from other loops: ParallelFor), else in
// order. If a chunk throws, the indices not reached run here. `ran` is the caller's (all 0): so
// that a batch past its first commit allocates nothing here.
template <typename Run>
void EachIndex(bool parallel, std::vector<char>& ran, const Run& run) {
  const size_t n = ran.size();
  if (n < 2 || !parallel) {
    for (size_t i = 0; i < n; ++i) run(i);
    return;
  }
  try {
    ParallelFor(n, 1, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        ran[i] = 1;
        run(i);
      }
    });
  } catch (const std::exception&) {
    // No task ran, or some did: the rest run here.
  }
  for (size_t i = 0; i < n; ++i) {
    if (!ran[i]) run(i);
  }
}

}  // namespace

struct BatchRunner::Entry {
  explicit Entry(const StepCall& c) : call(c) {}
  const StepCall& call;
  StepOutcome out;
  std::optional<SequenceRef> ref;          // locked; the session takes it for an append
  std::unique_ptr<AppendSession> session;  // holding the lock to the end of the entry
  Sequence* seq = nullptr;                 // set while the entry holds its lock
  // For the update: a held version past it is a guess at this call's own (TableVersions).
  uint64_t version_before = 0;
  std::optional<CheckedStep> prepared;  // the step, checked, while nothing failed
  // Begun, in a batch (last: it goes before the lock it lives under).
  std::unique_ptr<PolicyDriver::PendingStep> pending;
};

bool BatchRunner::Admit(const StepCall& call, StepOutcome* out) const {
  if (!call.rejected.ok()) {
    out->status = call.rejected;
  } else if (!call.append && !call.step && call.plan_tokens == 0) {
    out->status = absl::InvalidArgumentError("neither an append nor a step (nor plan_tokens)");
  } else if ((call.plan_id != 0 || call.plan_tokens != 0) && rooms_->plans == nullptr) {
    out->status = absl::FailedPreconditionError(
        call.plan_id != 0 ? "append.plan_id: in-place writes are off (kvmemd --in_place_writes)"
                          : "plan_tokens: in-place writes are off (kvmemd --in_place_writes)");
  } else if (call.plan_id != 0 && !call.append) {
    out->status = absl::InvalidArgumentError("plan_id: set without the tokens written (append)");
  }
  return out->status.ok();
}

void BatchRunner::Open(Entry& e) {
  Sequence* seq = &**e.ref;
  seq->mu.AssertHeld();  // locked by the registry, then by the session or `ref`
  e.version_before = seq->version();
  if (e.call.append) {
    absl::StatusOr<std::unique_ptr<AppendSession>> begun =
        AppendSession::Begin(*rooms_, *std::move(e.ref), /*hold_lock=*/true, /*publish=*/false);
    e.ref.reset();
    if (!begun.ok()) {
      e.out.status = begun.status();  // the lock went with the ref: no update either
      return;
    }
    e.session = *std::move(begun);
    if (batched_) e.session->DeferWrites();  // RunBatched writes the batch's K/V at once
  }
  e.seq = seq;
}

void BatchRunner::Begin(Entry& e) {
  Sequence* seq = e.seq;
  seq->mu.AssertHeld();  // by the session or `ref`
  // Everything is checked before anything applies: the chunk (staged by the session, where
  // no table looks) and the step's signals over the tokens it adds.
  if (e.session) {
    if (absl::Status s = e.call.plan_id != 0 ? e.session->AddWritten(*e.call.append, e.call.plan_id)
                                             : e.session->Add(*e.call.append);
        !s.ok()) {
      e.out.status = s;
      return;
    }
  }
  if (e.call.step) {
    const size_t pending = e.call.append ? e.call.append->positions.size() : 0;
    absl::StatusOr<CheckedStep> p =
        CheckStep(*seq, *e.call.step, pending,
                  e.call.step->table_version != 0 ? e.call.step->table_version
                                                  : (e.call.held ? e.call.held->version : 0));
    if (!p.ok()) {
      e.out.status = p.status();
      return;
    }
    e.prepared = *std::move(p);
  }
  if (!e.session) return;
  if (batched_) {
    // The slot states' appends of the batch's commits run together (RunBatched).
    if (absl::Status s = e.session->PrepareCommit(); !s.ok()) {
      e.out.status = s;
      e.prepared.reset();
    }
    return;
  }
  CommitAppend(e);
}

void BatchRunner::CommitAppend(Entry& e) {
  absl::StatusOr<AppendResult> appended = e.session->Commit();
  if (!appended.ok()) {
    e.out.status = appended.status();
    e.prepared.reset();
    return;
  }
  e.out.appended = *appended;
}

void BatchRunner::BeginStep(Entry& e, PolicyDriver::Staged* staged) {
  if (!e.out.status.ok() || !e.prepared) return;
  Sequence* seq = e.seq;
  absl::StatusOr<std::unique_ptr<PolicyDriver::PendingStep>> begun = GuardHostMemory("Step", [&] {
    seq->mu.AssertHeld();  // held for the whole entry
    return driver_->BeginStep(*seq, *e.prepared, staged);
  });
  if (begun.ok()) {
    e.pending = *std::move(begun);
  } else {
    e.out.status = begun.status();
  }
}

void BatchRunner::Finish(Entry& e, const absl::Status* executed) {
  Sequence* seq = e.seq;
  seq->mu.AssertHeld();  // by the session or `ref`, to the end of the entry
  if (e.pending || (executed == nullptr && e.out.status.ok() && e.prepared)) {
    // Past the append's commit: host memory running out in the step must not hide that
    // the append applied (the step itself applies whole, poisons, or changes nothing).
    absl::StatusOr<StepResult> stepped = GuardHostMemory("Step", [&] {
      seq->mu.AssertHeld();  // held for the whole entry
      return e.pending ? driver_->EndStep(*e.pending, *executed)
                       : driver_->Step(*seq, *e.prepared, nullptr);
    });
    if (stepped.ok()) {
      e.out.step = *stepped;
    } else {
      e.out.status = stepped.status();
    }
  }
  // The next plan, after whatever of the entry applied, on the table the update answers.
  if (e.call.plan_tokens != 0 && !seq->poisoned() && !seq->released()) {
    e.out.plan = GuardHostMemory("StepBatch", [&] {
      seq->mu.AssertHeld();
      return rooms_->plans->Make(*seq, e.call.plan_tokens);
    });
    rooms_->budget->Account(*seq);
  }
  rooms_->versions->Publish(*seq);
  e.out.table = rooms_->versions->Answer(*seq, e.call.held, e.version_before);
  if (e.out.appended) e.out.appended->version = seq->version();
  if (e.out.step) e.out.step->version = seq->version();
}

StepOutcome BatchRunner::RunOne(const StepCall& call) {
  Entry e(call);
  if (!Admit(call, &e.out)) return std::move(e.out);
  absl::StatusOr<SequenceRef> ref = registry_->LockForChange(call.sequence_id);
  if (!ref.ok()) {
    e.out.status = ref.status();
    return std::move(e.out);
  }
  e.ref.emplace(*std::move(ref));
  Open(e);
  if (e.seq == nullptr) return std::move(e.out);
  Begin(e);
  Finish(e, nullptr);
  return std::move(e.out);
}

std::vector<StepOutcome> BatchRunner::RunBatched(absl::Span<const StepCall> calls) {
  // Everything the phases keep, allocated before any entry applies: from the first commit
  // on, a throw must fail entries, not the batch.
  std::vector<Entry> entries;
  entries.reserve(calls.size());
  for (const StepCall& call : calls) entries.emplace_back(call);
  std::vector<size_t> order(calls.size()), staged_of(calls.size(), SIZE_MAX);
  std::vector<AppendSession*> sessions;
  std::vector<Sequence*> seqs;
  std::vector<const CheckedStep*> steps;
  std::vector<PolicyDriver::PendingStep*> pending;
  std::vector<StepOutcome> outcomes;
  sessions.reserve(calls.size());
  seqs.reserve(calls.size());
  steps.reserve(calls.size());
  pending.reserve(calls.size());
  outcomes.reserve(calls.size());
  // A throw (host memory) fails the entry as RunOne's caller fails it; what applied of it
  // before stays applied.
  auto guarded = [](Entry& e, auto&& phase) {
    try {
      phase();
    } catch (const std::bad_alloc&) {
      e.out = StepOutcome{};
      e.out.status =
          absl::ResourceExhaustedError("StepBatch: out of host memory (kvmemd could not allocate)");
      e.prepared.reset();
      e.pending.reset();  // undone, or its sequence poisoned
      e.seq = nullptr;    // nothing more of it runs (its lock goes with the entry)
    }
  };
  // A phase's host work on every entry it concerns, across cores when parallel_ (entries
  // name different sequences, all locked by this thread for the whole batch: the phases
  // use the locks, never take or drop them).
  std::vector<char> ran(calls.size());
  auto for_each = [&](auto&& concerns, auto&& phase) {
    std::fill(ran.begin(), ran.end(), 0);
    EachIndex(parallel_, ran, [&](size_t i) {
      Entry& e = entries[i];
      if (concerns(e)) guarded(e, [&] { phase(e); });
    });
  };
  // The locks, in the order of sequence ids: two batches naming the same sequences cannot
  // each hold one the other waits for.
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return calls[a].sequence_id < calls[b].sequence_id; });
  for (size_t i : order) {
    Entry& e = entries[i];
    if (!Admit(e.call, &e.out)) continue;
    absl::StatusOr<SequenceRef> ref = registry_->LockForChange(e.call.sequence_id);
    if (!ref.ok()) {
      e.out.status = ref.status();
      continue;
    }
    e.ref.emplace(*std::move(ref));
    guarded(e, [&] { Open(e); });  // here: a session that cannot begin drops the lock
  }
  for_each([](const Entry& e) { return e.seq != nullptr; }, [&](Entry& e) { Begin(e); });
  // The appends' commits: their K/V writes together, their slot states' appends together,
  // then each.
  auto appending = [](const Entry& e) {
    return e.seq != nullptr && e.session != nullptr && e.out.status.ok();
  };
  for (Entry& e : entries) {
    if (appending(e)) sessions.push_back(e.session.get());
  }
  AppendSession::WriteMany(sessions);
  try {
    AppendSession::AppendSlotsOfMany(sessions);
  } catch (const std::bad_alloc&) {
    // Before any slot state appended: each commit appends its own.
  }
  for_each(appending, [&](Entry& e) { CommitAppend(e); });
  // The slot-state halves of the kernel steps, together.
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& e = entries[i];
    if (e.seq == nullptr || !e.out.status.ok() || !e.prepared) continue;
    e.seq->mu.AssertHeld();
    if (!e.seq->kernel_step()) continue;
    staged_of[i] = seqs.size();
    seqs.push_back(e.seq);
    steps.push_back(&*e.prepared);
  }
  std::vector<PolicyDriver::Staged> staged;
  try {
    staged = driver_->StageKernelSteps(seqs, steps);
  } catch (const std::bad_alloc&) {
    // Before any slot state stepped: those steps fail (their appends stand).
    for (size_t i = 0; i < entries.size(); ++i) {
      if (staged_of[i] == SIZE_MAX) continue;
      entries[i].out.status = absl::ResourceExhaustedError("Step: out of host memory");
      entries[i].prepared.reset();
      staged_of[i] = SIZE_MAX;
    }
  }
  // Each step up to its op batch, every op batch in one execution, then each commit.
  for_each([](const Entry& e) { return e.seq != nullptr; },
           [&](Entry& e) {
             const size_t at = staged_of[static_cast<size_t>(&e - entries.data())];
             BeginStep(e, at == SIZE_MAX ? nullptr : &staged[at]);
           });
  for (Entry& e : entries) {
    if (e.pending) pending.push_back(e.pending.get());
  }
  // A throw here (host memory) is past every begun step's point of no return: each is
  // poisoned by its end, as for a failed execution.
  const absl::Status executed =
      GuardHostMemory("StepBatch", [&] { return driver_->ExecuteSteps(pending); });
  for_each([](const Entry& e) { return e.seq != nullptr; },
           [&](Entry& e) { Finish(e, &executed); });
  for (Entry& e : entries) outcomes.push_back(std::move(e.out));
  return outcomes;
}

absl::StatusOr<std::vector<StepOutcome>> BatchRunner::Run(absl::Span<const StepCall> calls) {
  return GuardHostMemory("StepBatch", [&]() -> absl::StatusOr<std::vector<StepOutcome>> {
    absl::flat_hash_set<uint64_t> seen;
    seen.reserve(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!seen.insert(calls[i].sequence_id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("entries[", i, "].sequence_id: sequence ", calls[i].sequence_id,
                         " appears twice in one batch (one entry per sequence)"));
      }
    }
    if (batched_) return RunBatched(calls);
    std::vector<StepOutcome> outcomes(calls.size());
    // Entries name different sequences, so they take different locks. Once one has run,
    // the batch answers per entry whatever happens.
    std::vector<char> ran(calls.size(), 0);
    EachIndex(parallel_, ran, [&](size_t i) noexcept {
      try {
        outcomes[i] = RunOne(calls[i]);
      } catch (const std::bad_alloc&) {
        // Before its first commit (RunOne keeps what applied after it).
        outcomes[i].status = absl::ResourceExhaustedError(
            "StepBatch: out of host memory (kvmemd could not allocate)");
      }
    });
    return outcomes;
  });
}

}  // namespace kvmem::engine
