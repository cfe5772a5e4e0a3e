#pragma once
// UnixPeers: kvmemd's gRPC listener on a unix socket when calls are authenticated. It
// accepts each connection itself, notes the peer's credentials as the kernel recorded them
// at connect (SO_PEERCRED: nothing the peer says) and hands the connection to `serve`
// (gRPC's AddInsecureChannelFromFd, which names the calls on it "fd:<n>"). PeerOf answers
// for such a name while its connection is open: gRPC's transport keeps a connection's
// descriptor open while any call on it runs, and the answer is checked against the
// descriptor's socket (device and inode), so a number that a later connection (or a file)
// took over never answers with an earlier peer's credentials.
#include <sys/socket.h>
#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/transport/unix_listener.h"

namespace kvmem::transport {

class UnixPeers {
 public:
  // Listens at `address`: "@name" (abstract) or a path (UnixListener). Connections wait
  // in the socket's backlog until Serve.
  // Connections open at once: in all, and per peer uid (gRPC's own listener drops a
  // connection that does not finish its handshake; one handed over by descriptor has none,
  // so these caps keep a local process from holding every descriptor kvmemd has).
  struct Caps {
    size_t connections = 4096;
    size_t per_uid = 1024;
  };
  static absl::StatusOr<std::unique_ptr<UnixPeers>> Listen(const std::string& address, Caps caps);
  static absl::StatusOr<std::unique_ptr<UnixPeers>> Listen(const std::string& address) {
    return Listen(address, Caps{});
  }
  // Accepts connections on a thread of its own: `serve` takes each accepted connection's
  // descriptor (non-blocking, close-on-exec) and owns it from then on. Once.
  void Serve(std::function<void(int)> serve);
  // Stops accepting; the connections handed over stay served (and answered for).
  void Stop();
  ~UnixPeers();
  UnixPeers(const UnixPeers&) = delete;
  UnixPeers& operator=(const UnixPeers&) = delete;

  // The credentials of the peer behind a call whose peer name (grpc::ServerContext::peer)
  // is `peer`; nullopt for a name this did not hand out or a connection no longer open.
  std::optional<ucred> PeerOf(absl::string_view peer) const;
  const std::string& address() const { return address_; }
  // Lets peers of every uid connect (the socket file's mode 0666; each call still proves
  // who it is), for a token file that maps uids other than kvmemd's.
  void OpenToOtherUsers() const {
    if (listener_) listener_->set_mode(0666);
  }
  // Connections accepted so far, and refused for the caps.
  uint64_t accepted() const;
  uint64_t refused() const;

 private:
  struct Peer {
    ucred credentials;
    dev_t dev;
    ino_t ino;
  };
  UnixPeers() = default;
  void Accept();
  // Whether `uid` may have one more connection, by the table as it is.
  bool UnderCaps(uid_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the entries of connections that are gone (their number closed or taken by
  // something else). On the acceptor's thread only.
  void Sweep();
  static constexpr absl::Duration kSweepEvery = absl::Milliseconds(100);
  absl::Time last_sweep_ = absl::InfinitePast();  // the acceptor's

  std::string address_;
  Caps caps_;
  std::optional<UnixListener> listener_;
  std::function<void(int)> serve_;
  int stop_fd_ = -1;  // an eventfd Stop signals
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  // By descriptor number: the latest connection accepted under each.
  absl::flat_hash_map<int, Peer> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::transport
