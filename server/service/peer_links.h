#pragma once
// PeerLinks: this daemon's links to its --cluster-peers, for MoveSequence and PullPrefix.
//
// Calls: one kept gRPC channel per peer, plaintext or TLS (--cluster-peer-tls-ca: the CA
// the peers' server certificates are signed by, so that the tenants' bearer tokens and the
// peer token never cross the network in the clear, and go only to a peer that proves its
// name). No client certificate is presented: a peer's tenants are known by the tokens
// forwarded (an identity taken from a certificate cannot be forwarded).
//
// Mappings: a peer on this host with its pool in host memory gives the peer token its attach
// ticket (GetInfo), and the pool is mapped read-only (kvmem/shared_pool.h) and kept for the
// next transfer, with the peer's instance id: an export names its daemon's, and a mapping
// of another instance (the peer restarted on its address) is never read, but mapped again.
// A peer that cannot be mapped (another host, a CUDA pool) is not asked again for a minute;
// a mapping no transfer used for a minute is dropped (it keeps the peer's pool in memory, even
// after the peer exited: at most that long).
//
// Pools: a peer's pool read by UCX RMA gets (kvmem/ucx_pool.h). Its key is asked by GetInfo
// with the peer token (--cluster-peer-token-file: a token the peers' token files name as a
// peer's, or an admin's; the tenant's own calls still carry the tenant's token), and the
// connection is kept for the next transfer until a read fails on it (the peer restarted or
// went away: connected again the next time). At most one pool per configured peer; reads of
// one pool take turns. The pools' staging buffers (UcxPool::kStagingBytes each) are
// reserved from --parse-memory-bytes for every configured peer when the links are made.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/transport/parse_cost.h"

namespace kvmem::client {
class SharedPool;
class UcxPool;
struct PoolRead;
}  // namespace kvmem::client

namespace kvmem::service {

// Copies `reads` out of a peer's pool mapped here (PeerLinks::Mapped), the cores side by
// side (one core's copy of 64 MiB is bound by its memory latency, not by the machine's
// bandwidth). Every read is checked against the pool before any copy: INVALID_ARGUMENT
// beginning with `what` (whose answer named the offsets) for one outside it.
absl::Status CopyOutOfMapping(const client::SharedPool& pool,
                              absl::Span<const client::PoolRead> reads, absl::string_view what);

class PeerLinks {
 public:
  // `peer_token` empty: no peer's pool is read by UCX (transfers go by gRPC).
  // `tls_root_certs` (PEM): the peers' server certificates are checked against them;
  // empty: plaintext. `peers`: the nodes (--cluster-peers) moved and pulled from.
  // INVALID_ARGUMENT naming --parse-memory-bytes when it cannot hold their pools' staging.
  static absl::StatusOr<std::unique_ptr<PeerLinks>> Create(std::string peer_token,
                                                           const std::string& tls_root_certs,
                                                           std::vector<std::string> peers);
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  // Whether `node` is one of the peers; whether there are any.
  bool IsPeer(const std::string& node) const;
  bool has_peers() const { return !peers_.empty(); }
  // A stub over the kept channel to `node` (made at its first use; the caller has checked
  // IsPeer, so the channels are bounded by the peers).
  std::unique_ptr<v1::KvCache::Stub> Stub(const std::string& node);
  bool tls() const { return tls_; }

  // Whether this daemon can read a peer's pool at all (built with UCX, given a peer token).
  bool reads_pools() const;
  // Whether it can map one (given a peer token; the peer on this host, its pool in host
  // memory).
  bool maps_pools() const { return !token_.empty(); }
  // The pool of `node` (`stub`: a channel to it), connected within `deadline` if need be.
  // FAILED_PRECONDITION when !reads_pools() or the peer offers no pool to read (not running
  // --ucx, or the token is neither a peer's nor an admin's there); the peer's own errors otherwise.
  // A read of the pool fails within kReadDeadline of its start.
  absl::StatusOr<std::shared_ptr<const client::UcxPool>> Pool(v1::KvCache::Stub& stub,
                                                              const std::string& node,
                                                              absl::Time deadline);
  // The pool a transfer from `node` asked as `transport` reads ("ucx", "grpc", "": either):
  // null for gRPC (asked for, or none to be had when either will do); FAILED_PRECONDITION
  // naming why when "ucx" was asked and the pool cannot be had.
  absl::StatusOr<std::shared_ptr<const client::UcxPool>> Choose(v1::KvCache::Stub& stub,
                                                                const std::string& node,
                                                                const std::string& transport,
                                                                absl::Time deadline);

  // A peer's pool mapped read-only, and the instance of the peer that it is.
  struct MappedPeer {
    std::shared_ptr<const client::SharedPool> pool;
    uint64_t instance_id = 0;
    absl::Time used;  // last handed out
  };
  // The pool of `node` mapped (GetInfo with the peer token, then its attach ticket), kept
  // from an earlier transfer unless that one is of `stale_instance` (not 0: an export named
  // another). FAILED_PRECONDITION naming why when it cannot be (no peer token here, the
  // peer on another host, its pool on a GPU, the token not a peer's there); the peer's own
  // errors otherwise.
  absl::StatusOr<MappedPeer> Mapped(v1::KvCache::Stub& stub, const std::string& node,
                                    absl::Time deadline, uint64_t stale_instance = 0);
  // Unmaps the pools no move or pull has used for kMappingIdle (the reaper calls it): a mapping
  // keeps its peer's pool in memory, even after that peer exited or restarted.
  void DropIdleMappings();
  static constexpr absl::Duration kMappingIdle = absl::Seconds(60);

  static constexpr absl::Duration kReadDeadline = absl::Seconds(30);
  // How long a peer found unmappable is not asked again.
  static constexpr absl::Duration kUnmappableFor = absl::Minutes(1);
  // The largest message a peer's answer may be (a ReadKv piece, an export's blocks).
  static constexpr int kMaxPeerMessageBytes = 64 << 20;

 private:
  PeerLinks(std::string peer_token, const std::string& tls_root_certs,
            std::vector<std::string> peers);
  // The peer's GetInfo, asked with the peer token.
  absl::StatusOr<v1::GetInfoResponse> PeerInfo(v1::KvCache::Stub& stub, const std::string& node,
                                               absl::Time deadline) const;

  const std::string token_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  const bool tls_;
  const std::vector<std::string> peers_;
  transport::ParseBudget::Reservation staging_;  // every peer's pool's
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const client::UcxPool>> pools_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, MappedPeer> mapped_ ABSL_GUARDED_BY(mu_);
  struct Unmappable {
    absl::Time until;
    absl::Status why;
  };
  absl::flat_hash_map<std::string, Unmappable> unmappable_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::service
