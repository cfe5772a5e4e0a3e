#include "server/engine/batch_runner.h"

#include <memory>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/common/parallel.h"
#include "server/engine/guard.h"
#include "server/engine/input_checks.h"

namespace kvmem::engine {

StepOutcome BatchRunner::RunOne(const StepCall& call) {
  StepOutcome out;
  if (!call.rejected.ok()) {
    out.status = call.rejected;
    return out;
  }
  if (!call.append && !call.step && call.plan_tokens == 0) {
    out.status = absl::InvalidArgumentError("neither an append nor a step (nor plan_tokens)");
    return out;
  }
  if ((call.plan_id != 0 || call.plan_tokens != 0) && rooms_->plans == nullptr) {
    out.status = absl::FailedPreconditionError(
        call.plan_id != 0 ? "append.plan_id: in-place writes are off (kvmemd --in_place_writes)"
                          : "plan_tokens: in-place writes are off (kvmemd --in_place_writes)");
    return out;
  }
  if (call.plan_id != 0 && !call.append) {
    out.status = absl::InvalidArgumentError("plan_id: set without the tokens written (append)");
    return out;
  }
  absl::StatusOr<SequenceRef> ref = registry_->LockForChange(call.sequence_id);
  if (!ref.ok()) {
    out.status = ref.status();
    return out;
  }
  // An append goes through a session holding the lock to the end of the call; the step and
  // the update then run on the same locked sequence.
  std::unique_ptr<AppendSession> session;
  Sequence* seq = &**ref;
  seq->mu.AssertHeld();  // locked by the registry, then by the session or `locked` below
  // For the update: a held version past it is a guess at this call's own (TableVersions).
  const uint64_t version_before = seq->version();
  std::optional<SequenceRef> locked;
  if (call.append) {
    absl::StatusOr<std::unique_ptr<AppendSession>> begun =
        AppendSession::Begin(*rooms_, *std::move(ref), /*hold_lock=*/true, /*publish=*/false);
    if (!begun.ok()) {
      out.status = begun.status();
      return out;
    }
    session = *std::move(begun);
  } else {
    locked.emplace(*std::move(ref));
  }
  auto finish = [&] {
    seq->mu.AssertHeld();
    rooms_->versions->Publish(*seq);
    out.table = rooms_->versions->Answer(*seq, call.held, version_before);
  };
  [&] {
    seq->mu.AssertHeld();
    // Everything is checked before anything applies: the chunk (staged by the session,
    // where no table looks) and the step's signals over the tokens it adds.
    if (session) {
      if (absl::Status s = call.plan_id != 0 ? session->AddWritten(*call.append, call.plan_id)
                                             : session->Add(*call.append);
          !s.ok()) {
        out.status = s;
        return;
      }
    }
    std::optional<CheckedStep> prepared;
    if (call.step) {
      const size_t pending = call.append ? call.append->positions.size() : 0;
      absl::StatusOr<CheckedStep> p =
          CheckStep(*seq, *call.step, pending,
                    call.step->table_version != 0 ? call.step->table_version
                                                  : (call.held ? call.held->version : 0));
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
      absl::StatusOr<StepResult> stepped = GuardHostMemory("Step", [&] {
        seq->mu.AssertHeld();  // held for the whole entry
        return driver_->Step(*seq, *prepared);
      });
      if (!stepped.ok()) {
        out.status = stepped.status();
        return;
      }
      out.step = *stepped;
    }
  }();
  // The next plan, after whatever of the entry applied, on the table the update answers.
  if (call.plan_tokens != 0 && !seq->poisoned() && !seq->released()) {
    out.plan = GuardHostMemory("StepBatch", [&] {
      seq->mu.AssertHeld();
      return rooms_->plans->Make(*seq, call.plan_tokens);
    });
    rooms_->budget->Account(*seq);
  }
  finish();
  seq->mu.AssertHeld();  // by the session or `locked`, to the end of the entry
  if (out.appended) out.appended->version = seq->version();
  if (out.step) out.step->version = seq->version();
  return out;
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
    std::vector<StepOutcome> outcomes(calls.size());
    // Whether entry i ran: once one has, the batch answers per entry whatever happens.
    std::vector<char> ran(calls.size(), 0);
    auto run = [&](size_t i) noexcept {
      ran[i] = 1;
      try {
        outcomes[i] = RunOne(calls[i]);
      } catch (const std::bad_alloc&) {
        // Before its first commit (RunOne keeps what applied after it).
        outcomes[i].status = absl::ResourceExhaustedError(
            "StepBatch: out of host memory (kvmemd could not allocate)");
      }
    };
    // Entries name different sequences, so they take different locks: they run on every
    // core TBB has (the caller's thread included), one entry per task, isolated from other
    // loops (ParallelFor), and in order under ThreadSanitizer, which cannot see oneTBB.
    if (calls.size() < 2 || !parallel_) {
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
