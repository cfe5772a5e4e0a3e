#pragma once
// PeerPools: the pools of this daemon's --cluster-peers, read by UCX RMA gets
// (kvmem/ucx_pool.h) for MoveSequence and PullPrefix. A peer's pool key is asked by GetInfo
// with the peer token (--cluster-peer-token-file: a token the peers' token files name as a
// peer's, or an admin's; the tenant's own calls still carry the tenant's token), and the connection
// is kept for the next transfer until a read fails on it (the peer restarted or went away:
// connected again the next time). At most one pool per configured peer; reads of one pool take
// turns.
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::client {
class UcxPool;
}

namespace kvmem::service {

class PeerPools {
 public:
  // `peer_token` empty: no peer's pool is read by UCX (transfers go by gRPC).
  explicit PeerPools(std::string peer_token);
  ~PeerPools();
  PeerPools(const PeerPools&) = delete;
  PeerPools& operator=(const PeerPools&) = delete;

  // Whether this daemon can read a peer's pool at all (built with UCX, given a peer token).
  bool enabled() const;
  // The pool of `node` (`stub`: a channel to it), connected within `deadline` if need be.
  // FAILED_PRECONDITION when !enabled() or the peer offers no pool to read (not running
  // --ucx, or the token is neither a peer's nor an admin's there); the peer's own errors otherwise.
  // A read of the pool fails within kReadDeadline of its start.
  absl::StatusOr<std::shared_ptr<const client::UcxPool>> Get(v1::KvCache::Stub& stub,
                                                             const std::string& node,
                                                             absl::Time deadline);

  // The pool a transfer from `node` asked as `transport` reads ("ucx", "grpc", "": either):
  // null for gRPC (asked for, no pools, or none to be had when either will do);
  // FAILED_PRECONDITION naming why when "ucx" was asked and the pool cannot be had.
  static absl::StatusOr<std::shared_ptr<const client::UcxPool>> Choose(PeerPools* pools,
                                                                       v1::KvCache::Stub& stub,
                                                                       const std::string& node,
                                                                       const std::string& transport,
                                                                       absl::Time deadline);

  static constexpr absl::Duration kReadDeadline = absl::Seconds(30);

 private:
  const std::string token_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const client::UcxPool>> pools_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::service
