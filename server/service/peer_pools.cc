#include "server/service/peer_pools.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/client_text.h"
#if KVMEM_WITH_UCX
#include "kvmem/convert.h"
#include "kvmem/ucx_pool.h"
#endif

namespace kvmem::service {

PeerPools::PeerPools(std::string peer_token) : token_(std::move(peer_token)) {}

PeerPools::~PeerPools() = default;

bool PeerPools::enabled() const {
#if KVMEM_WITH_UCX
  return !token_.empty();
#else
  return false;
#endif
}

absl::StatusOr<std::shared_ptr<const client::UcxPool>> PeerPools::Get(v1::KvCache::Stub& stub,
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
  absl::StatusOr<std::unique_ptr<client::UcxPool>> pool =
      client::UcxPool::Connect(client::internal::InfoOf(info), kReadDeadline);
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

absl::StatusOr<std::shared_ptr<const client::UcxPool>> PeerPools::Choose(
    PeerPools* pools, v1::KvCache::Stub& stub, const std::string& node,
    const std::string& transport, absl::Time deadline) {
  if (transport == "grpc" || pools == nullptr || !pools->enabled()) return nullptr;
  absl::StatusOr<std::shared_ptr<const client::UcxPool>> pool = pools->Get(stub, node, deadline);
  if (pool.ok() || transport != "ucx") return pool.ok() ? *std::move(pool) : nullptr;
  return absl::FailedPreconditionError(absl::StrCat(
      "transport: \"ucx\": the holder's pool cannot be read by UCX: ", pool.status().message()));
}

}  // namespace kvmem::service
