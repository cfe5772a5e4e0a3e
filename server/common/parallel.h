#pragma once
// ParallelFor: the streams of one call split across cores with oneTBB.
//
// A stream's work is small (a few thousand slots: microseconds), so the streams go in
// chunks of about `grain` each (StreamGrain), one task per chunk; the calling thread works
// too. Callers keep their per-stream work independent (each chunk writes only its streams)
// and deterministic, so the result does not depend on how the chunks were spread.
//
// Not for code past a point of no return: tbb::parallel_for allocates its tasks and may
// throw std::bad_alloc; an exception in a chunk reaches the caller (the first one, after
// every chunk has stopped).
#include <algorithm>
#include <cstddef>

#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_for.h"
#include "oneapi/tbb/partitioner.h"
#include "oneapi/tbb/task_arena.h"

namespace kvmem {

// Calls fn(begin, end) for consecutive ranges covering [0, n) of at most `grain` items each,
// in parallel; returns when all are done. n <= grain runs on the calling thread.
template <typename Fn>
void ParallelFor(size_t n, size_t grain, const Fn& fn) {
  grain = std::max<size_t>(grain, 1);
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer cannot see how libtbb (Debian's, not instrumented) hands tasks between
  // threads and would report every chunk as a race: under it the chunks run here, in order.
  for (size_t begin = 0; begin < n; begin += grain) fn(begin, std::min(n, begin + grain));
#else
  if (n <= grain) {
    if (n > 0) fn(size_t{0}, n);
    return;
  }
  // Isolated: while it waits for its chunks, the calling thread runs only those, never a
  // task of another loop (another StepBatch entry, say) that may need a lock it holds (the
  // sequence's, while it steps) and so deadlock.
  oneapi::tbb::this_task_arena::isolate([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<size_t>(0, n, grain),
        [&](const oneapi::tbb::blocked_range<size_t>& r) { fn(r.begin(), r.end()); },
        oneapi::tbb::simple_partitioner());
  });
#endif
}

// A grain for per-stream work of `slots_per_stream` slots each: up to 32k slots a task
// (ParallelFor halves ranges until they fit: 16k-32k), and a call with fewer slots in all
// stays on the calling thread. Smaller tasks cost more than they save: a chunk run on
// another core leaves its results (scores, keep-sets) in that core's cache for the serial
// rest of the step. On a 2-vCPU VM (bench/RESULTS.md, 2026-12-01) the SmolLM2 step (90
// streams of 257 slots) took ~15 % longer split in tasks of 4k slots than on one thread.
inline size_t StreamGrain(size_t slots_per_stream) {
  constexpr size_t kSlotsPerTask = 32768;
  return std::max<size_t>(1, kSlotsPerTask / std::max<size_t>(slots_per_stream, 1));
}

}  // namespace kvmem
