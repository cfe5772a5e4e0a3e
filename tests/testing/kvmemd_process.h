#pragma once
// kvmemd as a child process, for tests of the binary itself: started from flags, ready once
// it prints its READY line, stopped by SIGTERM. /metrics goes to a port of its choosing
// unless the flags say otherwise (tests run side by side; the default port is one). It is
// also killed when the thread that started it ends, so a test that returns early or
// crashes leaves no daemon behind (an orphan holds the test's output pipe open, and whoever
// reads that pipe — ctest, a `| tee` — waits for it forever; seen on the first GPU run).
// SIGKILL, not SIGTERM: the daemon must end at once whatever it is doing (SIGTERM drains,
// for up to --drain-seconds); the next daemon removes the shared-memory segments of a
// killed one.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace kvmem::testing {

struct KvmemdProcess {
  pid_t pid = -1;
  FILE* out = nullptr;   // the child's stdout, kept open while it runs
  int port = 0;          // 0 when it never got ready (it failed to start)
  int metrics_port = 0;  // its /metrics port (0: none)
};

inline KvmemdProcess StartKvmemd(const char* path, const std::vector<std::string>& flags) {
  int fds[2];
  KvmemdProcess d;
  if (pipe(fds) != 0) return d;
  const pid_t parent = getpid();
  d.pid = fork();
  if (d.pid == 0) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    std::vector<char*> argv = {const_cast<char*>(path)};
    bool metrics = false;
    for (const std::string& f : flags) {
      argv.push_back(const_cast<char*>(f.c_str()));
      metrics |= f.rfind("--metrics-listen", 0) == 0 || f.rfind("--metrics_listen", 0) == 0;
    }
    std::string any_port = "--metrics-listen=127.0.0.1:0";
    if (!metrics) argv.push_back(any_port.data());
    argv.push_back(nullptr);
    execv(path, argv.data());
    _exit(127);
  }
  close(fds[1]);
  d.out = fdopen(fds[0], "r");
  char line[256];
  while (std::fgets(line, sizeof line, d.out) != nullptr) {
    if (std::sscanf(line, "READY port=%d metrics_port=%d", &d.port, &d.metrics_port) >= 1) break;
  }
  return d;
}

// The exit code, or 128 + the signal that ended it.
inline int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Stops the process (SIGSTOP) and returns once every thread of it has stopped: a signal is
// delivered asynchronously, and right after kill() a thread may still run (answer a read)
// for a while. False if it could not be stopped.
inline bool PauseKvmemd(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return false;
  int status = 0;
  return waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status);
}

inline int StopKvmemd(KvmemdProcess& d) {
  kill(d.pid, SIGTERM);
  const int rc = WaitExit(d.pid);
  if (d.out != nullptr) fclose(d.out);
  d.out = nullptr;
  return rc;
}

}  // namespace kvmem::testing
