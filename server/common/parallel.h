#pragma once
// ParallelFor: the streams of one call (or the entries of one batch) split across cores.
//
// A stream's work is small (a few thousand slots: microseconds), so the streams go in
// chunks of about `grain` each (StreamGrain); the calling thread works too, with a fixed
// set of helper threads (one per core but the caller's), started on first use. Callers keep
// their per-chunk work independent (each chunk writes only its streams) and deterministic,
// so the result does not depend on how the chunks were spread.
//
// Why not oneTBB (which did this before): every gRPC thread that ran a loop became one of
// its external threads, and kvmemd's anonymous memory grew with the threads gRPC made and
// ended under load (hundreds of MiB against a heap of a few: bench/RESULTS.md). Here a loop
// allocates nothing: its job lives on the caller's stack, and the helpers are the only
// threads besides the callers.
//
// Isolated: while it waits for its chunks, the calling thread runs only those, never a
// chunk of another loop (another StepBatch entry, say) that may need a lock it holds (the
// sequence's, while it steps) and so deadlock. An exception in a chunk reaches the caller
// (the first one, after every chunk has stopped).
#include <algorithm>
#include <cstddef>
#include <exception>

namespace kvmem {
namespace internal {

// One loop: chunks of [0, n), claimed one at a time by the caller and the helpers.
struct ParallelJob {
  void (*call)(const void* fn, size_t begin, size_t end) = nullptr;
  const void* fn = nullptr;
  size_t n = 0, grain = 1, chunks = 0;
  size_t claimed = 0;           // guarded by the pool's lock
  size_t done = 0;              // guarded by the pool's other lock (done_mu)
  std::exception_ptr error;     // the first chunk's that threw; as `done`
  ParallelJob* next = nullptr;  // in the pool's queue; guarded by its lock
  bool queued = false;          // guarded by the pool's lock
};

// Runs `job` on the calling thread and the helpers; returns when every chunk is done.
void RunParallel(ParallelJob& job);

}  // namespace internal

// Calls fn(begin, end) for consecutive ranges covering [0, n) of at most `grain` items each,
// in parallel; returns when all are done. n <= grain runs on the calling thread.
template <typename Fn>
void ParallelFor(size_t n, size_t grain, const Fn& fn) {
  grain = std::max<size_t>(grain, 1);
  if (n <= grain) {
    if (n > 0) fn(size_t{0}, n);
    return;
  }
  internal::ParallelJob job;
  job.call = [](const void* f, size_t begin, size_t end) {
    (*static_cast<const Fn*>(f))(begin, end);
  };
  job.fn = &fn;
  job.n = n;
  job.grain = grain;
  job.chunks = (n + grain - 1) / grain;
  internal::RunParallel(job);
}

// A grain for per-stream work of `slots_per_stream` slots each: up to 32k slots a task,
// and a call with fewer slots in all stays on the calling thread. Smaller tasks cost more
// than they save: a chunk run on another core leaves its results (scores, keep-sets) in
// that core's cache for the serial rest of the step. On a 2-vCPU VM (bench/RESULTS.md,
// 2026-12-01) the SmolLM2 step (90 streams of 257 slots) took ~15 % longer split in tasks
// of 4k slots than on one thread.
inline size_t StreamGrain(size_t slots_per_stream) {
  constexpr size_t kSlotsPerTask = 32768;
  return std::max<size_t>(1, kSlotsPerTask / std::max<size_t>(slots_per_stream, 1));
}

}  // namespace kvmem
