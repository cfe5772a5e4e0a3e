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
#include "server/transport/unix_listener.h"

namespace kvmem::transport {

class UnixPeers {
 public:
  // `address`: "@name" (abstract) or a path (UnixListener); `serve` takes each accepted
  // connection's descriptor (non-blocking, close-on-exec) and owns it from then on.
  static absl::StatusOr<std::unique_ptr<UnixPeers>> Start(const std::string& address,
                                                          std::function<void(int)> serve);
  // Stops accepting; the connections handed over stay served (and answered for).
  void Stop();
  ~UnixPeers();
  UnixPeers(const UnixPeers&) = delete;
  UnixPeers& operator=(const UnixPeers&) = delete;

  // The credentials of the peer behind a call whose peer name (grpc::ServerContext::peer)
  // is `peer`; nullopt for a name this did not hand out or a connection no longer open.
  std::optional<ucred> PeerOf(absl::string_view peer) const;
  const std::string& address() const { return listener_->address(); }
  // Connections accepted so far.
  uint64_t accepted() const;

 private:
  struct Peer {
    ucred credentials;
    dev_t dev;
    ino_t ino;
  };
  UnixPeers() = default;
  void Accept();

  std::optional<UnixListener> listener_;
  std::function<void(int)> serve_;
  int stop_fd_ = -1;  // an eventfd Stop signals
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  // By descriptor number: the latest connection accepted under each.
  absl::flat_hash_map<int, Peer> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmem::transport
