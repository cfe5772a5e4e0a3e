#pragma once
// RedisServer: a redis-server of a test's or a benchmark's own, on a unix socket in a
// directory of its own, without persistence, killed with the object. Start() is false when
// /usr/bin/redis-server is missing (scripts/deps.sh installs it) or did not come up; true
// once the server accepts a connection (its socket file exists from bind(), before listen()).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace kvmem::testing {

class RedisServer {
 public:
  bool Start(std::vector<std::string> more = {}) {
    const char* server = "/usr/bin/redis-server";
    if (access(server, X_OK) != 0) return false;
    static int started = 0;
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("kvmem-redis-", getpid(), "-", started++);
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "redis.sock").string();
    std::vector<std::string> args = {
        server,         "--port", "0",     "--unixsocket", socket_,      "--save", "",
        "--appendonly", "no",     "--dir", dir_.string(),  "--loglevel", "warning"};
    args.insert(args.end(), more.begin(), more.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t quiet;  // its warnings (overcommit) are not the test's
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&quiet, 2, "/dev/null", O_WRONLY, 0);
    const int spawned = posix_spawn(&pid_, server, &quiet, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&quiet);
    if (spawned != 0) return false;
    for (int i = 0; i < 1000; ++i) {
      if (Accepts()) return true;
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {  // exited (bad arguments): no server
        pid_ = 0;
        return false;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }
  ~RedisServer() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  std::string url() const { return "unix://" + socket_; }

 private:
  bool Accepts() const {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    if (socket_.size() >= sizeof(address.sun_path)) return false;
    std::memcpy(address.sun_path, socket_.c_str(), socket_.size() + 1);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    const bool accepted =
        connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
    close(fd);
    return accepted;
  }

  std::filesystem::path dir_;
  std::string socket_;
  pid_t pid_ = 0;
};

}  // namespace kvmem::testing
