#include "server/common/parallel.h"

#include <sched.h>

#include <algorithm>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/common/mutex.h"

namespace kvmem::internal {
namespace {

// The helper threads and the queue of loops with chunks left to claim.
class Pool {
 public:
  Pool() {
    // The cores this process may run on (its affinity mask, as taskset or a cpuset sets it).
    cpu_set_t set;
    CPU_ZERO(&set);
    const int cores = sched_getaffinity(0, sizeof set, &set) == 0
                          ? CPU_COUNT(&set)
                          : static_cast<int>(std::thread::hardware_concurrency());
    for (int i = 1; i < cores; ++i) {
      try {
        std::thread([this] { Help(); }).detach();
      } catch (const std::system_error&) {
        break;  // no more threads to be had (a pids limit): the callers do the rest
      }
    }
  }

  void Run(ParallelJob& job) {
    {
      kvmem::MutexLock lock(&mu_);
      job.queued = true;
      *tail_ = &job;
      tail_ = &job.next;
      work_cv_.SignalAll();
    }
    // The caller claims chunks until none is left; then no helper can claim one either
    // (claims and dequeuing share the lock), so waiting for `done` is all that is left.
    while (std::optional<size_t> chunk = Claim(job)) Execute(job, *chunk);
    // The job's state is guarded by the pool's lock, never by one in the job: the helper
    // that finishes the last chunk may still be unlocking when this caller returns.
    // Waits on a CondVar, its own thread testing `done`: abseil evaluates an
    // absl::Condition in the thread that unlocks, which ThreadSanitizer (abseil is not
    // instrumented) sees as a read of this thread's stack after it moved on.
    kvmem::MutexLock lock(&done_mu_);
    while (job.done != job.chunks) {
      kvmem::TsanRelease(&done_mu_);
      done_cv_.Wait(&done_mu_);
      kvmem::TsanAcquire(&done_mu_);
    }
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  void Help() {
    while (true) {
      ParallelJob* job = nullptr;
      size_t chunk = 0;
      {
        // Taken from the queue's head under the lock: a job found there has a chunk left,
        // and stays alive until that chunk is counted done (its caller waits for it).
        kvmem::MutexLock lock(&mu_);
        while (head_ == nullptr) {  // (a CondVar, not an absl::Condition: see Run)
          kvmem::TsanRelease(&mu_);
          work_cv_.Wait(&mu_);
          kvmem::TsanAcquire(&mu_);
        }
        job = head_;
        chunk = job->claimed++;
        if (job->claimed == job->chunks) Dequeue(*job);
      }
      Execute(*job, chunk);
    }
  }

  // The next chunk of its own `job` for the caller, if any is left; the claim of the last
  // chunk takes the job out of the queue (by whoever claims it), so that a job in the queue
  // always has one to claim.
  std::optional<size_t> Claim(ParallelJob& job) {
    kvmem::MutexLock lock(&mu_);
    if (!job.queued || job.claimed >= job.chunks) return std::nullopt;
    const size_t chunk = job.claimed++;
    if (job.claimed == job.chunks) Dequeue(job);
    return chunk;
  }

  void Execute(ParallelJob& job, size_t chunk) {
    const size_t begin = chunk * job.grain;
    const size_t end = std::min(job.n, begin + job.grain);
    bool failed = false;
    {
      kvmem::MutexLock lock(&done_mu_);
      failed = job.error != nullptr;
    }
    std::exception_ptr error;
    if (!failed) {  // after a failure the rest is skipped
      try {
        job.call(job.fn, begin, end);
      } catch (...) {
        error = std::current_exception();
      }
    }
    kvmem::MutexLock lock(&done_mu_);
    if (error && !job.error) job.error = std::move(error);
    // The last touch of the job: its caller may return from here on.
    if (++job.done == job.chunks) done_cv_.SignalAll();
  }

  void Dequeue(ParallelJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!job.queued) return;
    for (ParallelJob** p = &head_; *p != nullptr; p = &(*p)->next) {
      if (*p == &job) {
        *p = job.next;
        if (tail_ == &job.next) tail_ = p;
        break;
      }
    }
    job.queued = false;
    job.next = nullptr;
  }

  absl::Mutex mu_;         // the queue, and every job's `claimed`, `next` and `queued`
  absl::Mutex done_mu_;    // every job's `done` and `error`
  absl::CondVar done_cv_;  // a job's last chunk counted
  ParallelJob* head_ ABSL_GUARDED_BY(mu_) = nullptr;
  ParallelJob** tail_ ABSL_GUARDED_BY(mu_) = &head_;
  absl::CondVar work_cv_;  // a job queued
};

}  // namespace

void RunParallel(ParallelJob& job) {
  static Pool* const pool = new Pool();  // never destroyed: its helpers outlive main
  pool->Run(job);
}

}  // namespace kvmem::internal
