#pragma once
// MutexLock: absl::MutexLock that ThreadSanitizer can see through.
//
// Debian's abseil is not built with -fsanitize=thread, so TSan cannot see how absl::Mutex
// orders threads and would report every guarded access as a race. Under TSan, MutexLock
// adds the happens-before edges itself (acquire after locking, release before unlocking);
// elsewhere it is absl::MutexLock. Use it (and Lock/Unlock/Await below) for every
// absl::Mutex.
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvmem {

inline void TsanAcquire([[maybe_unused]] void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(addr);
#endif
}
inline void TsanRelease([[maybe_unused]] void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(addr);
#endif
}

inline void Lock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) {
  mu->Lock();
  TsanAcquire(mu);
}
inline void Unlock(absl::Mutex* mu) ABSL_UNLOCK_FUNCTION(mu) {
  TsanRelease(mu);
  mu->Unlock();
}
// absl::Mutex::Await, which unlocks and relocks inside abseil.
inline void Await(absl::Mutex* mu, const absl::Condition& condition)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  TsanRelease(mu);
  mu->Await(condition);
  TsanAcquire(mu);
}

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { Lock(mu_); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { Unlock(mu_); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

}  // namespace kvmem
