#include "server/service/peer_links.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "kvmem/convert.h"
#include "kvmem/shared_pool.h"
#include "server/common/client_text.h"
#include "server/common/parallel.h"
#if KVMEM_WITH_UCX
#include "kvmem/ucx_pool.h"
#endif

namespace kvmem::service {

namespace {

// CopyOutOfMapping's loop takes chunks of this many reads (8 MiB of 8 KiB blocks), claimed
// by the loop's threads in turn.
constexpr size_t kCopyGrain = 1024;

}  // namespace

absl::Status CopyOutOfMapping(const client::SharedPool& pool,
                              absl::Span<const client::PoolRead> reads, absl::string_view what) {
  for (const client::PoolRead& r : reads) {  // before any copy: none is made of a bad read
    if (!pool.Maps(r.offset, r.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(what, " names pool bytes [", r.offset, ", +",
                                                     r.bytes, ") outside its pool of ",
                                                     pool.bytes(), " as mapped"));
    }
  }
  absl::Mutex mu;
  absl::Status first = absl::OkStatus();
  ParallelFor(reads.size(), kCopyGrain, [&](size_t begin, size_t end) {
    absl::Status s = pool.ReadPool(reads.subspan(begin, end - begin));
    absl::MutexLock lock(&mu);
    first.Update(s);
  });
  return first;
}

namespace {

std::shared_ptr<grpc::ChannelCredentials> Credentials(const std::string& tls_root_certs) {
  if (tls_root_certs.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = tls_root_certs;
  return grpc::SslCredentials(tls);
}

}  // namespace

absl::StatusOr<v1::GetInfoResponse> PeerLinks::PeerInfo(v1::KvCache::Stub& stub,
                                                        const std::string& node,
                                                        absl::Time deadline) const {
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(deadline));
  c.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  v1::GetInfoResponse info;
  if (grpc::Status s = stub.GetInfo(&c, v1::GetInfoRequest(), &info); !s.ok()) {
    return absl::Status(
        static_cast<absl::StatusCode>(s.error_code()),
        absl::StrCat("the peer ", node, " answered GetInfo (with --cluster-peer-token-file): ",
                     CutMessage(s.error_message(), kMaxDetailTextBytes)));
  }
  return info;
}

absl::StatusOr<std::unique_ptr<PeerLinks>> PeerLinks::Create(std::string peer_token,
                                                             const std::string& tls_root_certs,
                                                             std::vector<std::string> peers) {
  std::unique_ptr<PeerLinks> links(
      new PeerLinks(std::move(peer_token), tls_root_certs, std::move(peers)));
#if KVMEM_WITH_UCX
  const size_t n = links->peers_.size();
  if (links->reads_pools() && n > 0) {
    absl::StatusOr<transport::ParseBudget::Reservation> staging =
        transport::ParseBudget::Process().Reserve(n * client::UcxPool::kStagingBytes,
                                                  "the peers' pools read by UCX");
    if (!staging.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--parse-memory-bytes: cannot also hold the staging of ", n,
          " --cluster-peers' pools read by UCX (", client::UcxPool::kStagingBytes >> 20,
          " MiB each): ", staging.status().message()));
    }
    links->staging_ = *std::move(staging);
  }
#endif
  return links;
}

PeerLinks::PeerLinks(std::string peer_token, const std::string& tls_root_certs,
                     std::vector<std::string> peers)
    : token_(std::move(peer_token)),
      credentials_(Credentials(tls_root_certs)),
      tls_(!tls_root_certs.empty()),
      peers_(std::move(peers)) {}

bool PeerLinks::IsPeer(const std::string& node) const {
  return std::find(peers_.begin(), peers_.end(), node) != peers_.end();
}

PeerLinks::~PeerLinks() = default;

std::unique_ptr<v1::KvCache::Stub> PeerLinks::Stub(const std::string& node) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[node];
  if (channel == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
    // A peer back after a while is called again within seconds (gRPC's default backoff
    // grows to two minutes, during which calls fail at once).
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    channel = grpc::CreateCustomChannel(node, credentials_, args);
  }
  return v1::KvCache::NewStub(channel);
}

bool PeerLinks::reads_pools() const {
#if KVMEM_WITH_UCX
  return !token_.empty();
#else
  return false;
#endif
}

absl::StatusOr<std::shared_ptr<const client::UcxPool>> PeerLinks::Pool(v1::KvCache::Stub& stub,
                                                                       const std::string& node,
                                                                       absl::Time deadline) {
#if KVMEM_WITH_UCX
  if (token_.empty()) {
    return absl::FailedPreconditionError(
        "this kvmemd reads no peer's pool by UCX (no --cluster-peer-token-file)");
  }
  std::shared_ptr<const client::UcxPool> gone;  // ended outside the lock (closing may wait)
  {
    absl::MutexLock lock(&mu_);
    if (auto it = pools_.find(node); it != pools_.end()) {
      if (!it->second->broken()) return it->second;
      gone = std::move(it->second);  // a read failed on it: connected again below
      pools_.erase(it);
    }
  }
  // Connected outside the lock: a peer that does not answer holds up no other's transfer.
  absl::StatusOr<v1::GetInfoResponse> info = PeerInfo(stub, node, deadline);
  if (!info.ok()) return info.status();
  absl::StatusOr<std::unique_ptr<client::UcxPool>> pool =
      client::UcxPool::Connect(client::internal::InfoOf(*info), kReadDeadline);
  if (!pool.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the peer ", node, "'s pool cannot be read by UCX: ", pool.status().message()));
  }
  std::shared_ptr<const client::UcxPool> connected = *std::move(pool);
  absl::MutexLock lock(&mu_);
  auto [it, added] = pools_.try_emplace(node, connected);
  if (!added && it->second->broken()) std::swap(it->second, connected);  // ends after the lock
  return it->second;  // another transfer's, if it connected first
#else
  (void)stub;
  (void)node;
  (void)deadline;
  return absl::FailedPreconditionError(
      "this kvmemd reads no peer's pool by UCX (built without UCX)");
#endif
}

absl::StatusOr<PeerLinks::MappedPeer> PeerLinks::Mapped(v1::KvCache::Stub& stub,
                                                        const std::string& node,
                                                        absl::Time deadline,
                                                        uint64_t stale_instance) {
  if (!maps_pools()) {
    return absl::FailedPreconditionError(
        "this kvmemd maps no peer's pool (no --cluster-peer-token-file)");
  }
  {
    absl::MutexLock lock(&mu_);
    if (auto it = mapped_.find(node); it != mapped_.end()) {
      if (it->second.instance_id != stale_instance) {
        it->second.used = absl::Now();
        return it->second;
      }
      mapped_.erase(it);  // the holder restarted: mapped again below
    }
    if (auto it = unmappable_.find(node); it != unmappable_.end()) {
      if (absl::Now() < it->second.until) return it->second.why;
      unmappable_.erase(it);
    }
  }
  absl::StatusOr<v1::GetInfoResponse> info = PeerInfo(stub, node, deadline);
  if (!info.ok()) return info.status();  // not remembered: the peer may be back soon
  // Why not, and whether that lasts (another host, a GPU pool, an older kvmemd: not asked
  // again for a while) or may pass (the attach socket busy, a ticket pushed out).
  absl::Status why = absl::OkStatus();
  bool remember = true;
  MappedPeer peer;
  peer.instance_id = info->instance_id();
  if (!info->has_attach()) {
    why = absl::FailedPreconditionError(absl::StrCat(
        "the peer ", node,
        " offers no mapping of its pool (no attach socket, or the token is neither a peer's "
        "nor an admin's there)"));
  } else if (!info->has_shared_memory()) {
    why = absl::FailedPreconditionError(
        absl::StrCat("the peer ", node, "'s pool is not in host memory"));
  } else if (info->shared_memory().piece_bytes() != 0 &&
             info->shared_memory().piece_bytes() != info->shared_memory().segment_bytes()) {
    why = absl::FailedPreconditionError(absl::StrCat(
        "the peer ", node, "'s pool is cut into tenant arenas: a mapping holds only a part"));
  } else if (peer.instance_id == 0) {
    why = absl::FailedPreconditionError(
        absl::StrCat("the peer ", node, " names no instance (an older kvmemd)"));
  } else {
    absl::StatusOr<std::unique_ptr<client::SharedPool>> pool =
        client::SharedPool::Attach(client::internal::InfoOf(*info));
    if (pool.ok()) {
      peer.pool = *std::move(pool);
    } else {
      // A socket that does not answer here at all: another host (remembered); anything
      // else keeps its code and is asked again next time.
      remember = absl::StrContains(pool.status().message(), "is the daemon on this host");
      why = absl::Status(
          remember ? absl::StatusCode::kFailedPrecondition : pool.status().code(),
          absl::StrCat("the peer ", node, "'s pool cannot be mapped: ", pool.status().message()));
    }
  }
  absl::MutexLock lock(&mu_);
  if (!why.ok()) {
    if (remember) unmappable_[node] = {absl::Now() + kUnmappableFor, why};
    return why;
  }
  peer.used = absl::Now();
  return mapped_[node] = std::move(peer);
}

void PeerLinks::DropIdleMappings() {
  std::vector<MappedPeer> gone;  // unmapped after the lock (a move may still hold one)
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    if (now - it->second.used < kMappingIdle) {
      ++it;
      continue;
    }
    gone.push_back(std::move(it->second));
    mapped_.erase(it++);
  }
}

absl::StatusOr<std::shared_ptr<const client::UcxPool>> PeerLinks::Choose(
    v1::KvCache::Stub& stub, const std::string& node, const std::string& transport,
    absl::Time deadline) {
  if (transport == "grpc" || !reads_pools()) return nullptr;
  absl::StatusOr<std::shared_ptr<const client::UcxPool>> pool = Pool(stub, node, deadline);
  if (pool.ok() || transport != "ucx") return pool.ok() ? *std::move(pool) : nullptr;
  return absl::FailedPreconditionError(absl::StrCat(
      "transport: \"ucx\": the holder's pool cannot be read by UCX: ", pool.status().message()));
}

}  // namespace kvmem::service
