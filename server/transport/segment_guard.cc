#include "server/transport/segment_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <mutex>

namespace kvmem::transport {
namespace {

using Section = segment_guard_internal::Range;

// The calling thread's guarded section. Plain thread_local: the executable's TLS, which a
// signal handler may read.
thread_local Section* t_section = nullptr;

struct sigaction g_previous;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  Section* section = t_section;
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  // Only a fault of this thread's access past the end of a mapped file (BUS_ADRERR, sent
  // by the kernel: si_code > 0) in the guarded range; never a SIGBUS sent by kill().
  const auto begin = reinterpret_cast<uintptr_t>(section != nullptr ? section->data : nullptr);
  if (info->si_code == BUS_ADRERR && section != nullptr && addr >= begin &&
      addr - begin < section->bytes) {
    // mmap is not on POSIX's async-signal-safe list but is a plain system call on Linux.
    void* fixed = mmap(section->data, section->bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (fixed != MAP_FAILED) {
      section->faulted = 1;
      errno = saved_errno;
      return;  // the faulting access runs again, on zeros
    }
  }
  // Not ours: what SIGBUS would have done without us.
  if (g_previous.sa_handler == SIG_IGN) {
    // ignored before us: a sent SIGBUS stays ignored; a fault runs again and kills, as the
    // kernel does for a fault whose SIGBUS is ignored
    if (info->si_code > 0) signal(SIGBUS, SIG_DFL);
  } else if (g_previous.sa_handler != SIG_DFL) {
    if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
      g_previous.sa_sigaction(sig, info, context);
    } else {
      g_previous.sa_handler(sig);
    }
  } else {
    // The default action. A fault of the current instruction (these codes) runs again and
    // kills; anything else (a sent signal, a machine check reported ahead of any access) is
    // raised again, delivered when the handler returns.
    signal(SIGBUS, SIG_DFL);
    const bool refaults = info->si_code == BUS_ADRALN || info->si_code == BUS_ADRERR ||
                          info->si_code == BUS_OBJERR || info->si_code == BUS_MCEERR_AR;
    if (!refaults) raise(SIGBUS);
  }
  errno = saved_errno;
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

}  // namespace

void SegmentGuard::Install() { InstallOnce(); }

SegmentGuard::SegmentGuard(uint8_t* data, size_t bytes) {
  InstallOnce();
  range_.data = data;
  range_.bytes = bytes;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_section = &range_;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

SegmentGuard::~SegmentGuard() {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_section = nullptr;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

bool SegmentGuard::faulted() const {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  return range_.faulted != 0;
}

}  // namespace kvmem::transport
