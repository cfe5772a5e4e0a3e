#pragma once
// PrefixPuller: makes this kvmemd hold the longest prefix of a prompt that another node of
// the fleet holds (the shared index says which: cluster_index.h), pulled from that node's
// published blocks instead of recomputed by a worker (PullPrefix).
//
// A pull reads the holder as a client would: CreateSequence with the prompt there (which
// maps the holder's published prefix: whole blocks, never the prompt's last token), ReadKv
// of it, Release; then here: a sequence of the same layout and namespace that maps what
// this node already holds, the rest appended from the pulled K/V with its token ids,
// published, released. The result is this node's own published prefix, byte for byte the
// holder's (K/V are read at the layout dtype: published blocks are never quantized), which
// the next CreateSequence here maps.
//
// Trust: only peers this daemon was configured with (--cluster-peers) are pulled from, and
// only when the fleet's index names them as holders of the prompt: whoever can write to
// Redis cannot make kvmemd connect elsewhere. The caller's bearer token goes with the calls
// to the holder, so that the holder scopes them to the same tenant: the fleet's daemons
// must share one token file (a tenant's token naming another tenant there would map that
// tenant's chain: the same tokens' K/V, but read across tenants). A caller identified
// otherwise (TLS certificate, unix peer) cannot be forwarded and is refused on a daemon with
// tenants. The channel to a peer is PeerLinks' (TLS with --cluster-peer-tls-ca, else
// plaintext: a fleet's private network). The holder's answer is checked as untrusted input (whole
// blocks, within the prompt, every piece in place). Memory: a pull holds the K/V it adds here (at
// most max_bytes, reserved from --parse-memory-bytes with the calls' buffers); at most max_pulls
// run at once. The caller's cancellation reaches the calls to the holder.
// Transport: the holder's blocks copied out of its pool mapped read-only (a holder on this
// host with its pool in host memory), else by UCX RMA gets from its pool (both built with
// UCX, the holder running --ucx), either under the holder's epoch protocol and with this
// daemon given --cluster-peer-token-file (PeerLinks), else ReadKv. A mapping is read only
// when it is of the instance that answered the GetBlockTable (GetBlockTableResponse's
// instance_id), else made again, once.
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/engine/engine.h"
#include "server/metrics/exporter.h"
#include "server/service/cluster_index.h"
#include "server/service/peer_links.h"

namespace kvmem::service {

struct PullResult {
  uint64_t local_tokens = 0;   // what this node held before
  uint64_t pulled_tokens = 0;  // published here by the pull
  std::string from_node;
  uint64_t holder_tokens = 0;  // what the holder mapped of the prompt
  uint64_t bytes = 0;          // K+V bytes moved
  std::string transport;       // "attach", "ucx" or "grpc"; empty: nothing read
};

// What a caller asks of a pull besides the prompt (PullPrefixRequest).
struct PullAsk {
  std::string from_node;    // empty: the holder of the longest prefix
  std::string transport;    // "attach", "ucx", "grpc"; empty: the first that can
  uint64_t min_tokens = 0;  // the least gain worth a pull
};

class PrefixPuller {
 public:
  // `links`: the channels to the peers and their pools by UCX (outlives the puller).
  PrefixPuller(engine::Engine* engine, ClusterIndex* index, std::string self_node,
               uint64_t max_bytes, int max_pulls, PeerLinks* links)
      : engine_(engine),
        index_(index),
        self_(std::move(self_node)),
        links_(links),
        max_bytes_(max_bytes),
        max_pulls_(max_pulls),
        seconds_(engine::LatencyBounds()) {}

  // `prompt` is scoped (its salt the tenant's, its owner the tenant); `client_salt` is the
  // salt as the caller sent it (the holder scopes it again from the forwarded token);
  // `bearer` the caller's authorization header ("" for none); `deadline` the call's, capped.
  absl::StatusOr<PullResult> Pull(grpc::ServerContext* context, const v1::Layout& layout_proto,
                                  const engine::Layout& layout, const engine::PromptPrefix& prompt,
                                  const std::string& client_salt, const PullAsk& ask,
                                  const std::string& bearer, absl::Time deadline);
  // What the pulls have done (the metrics).
  metrics::PullTotals totals() const;

 private:
  // The holder (the longest, or the one named, falling back to the next) and the pull.
  absl::StatusOr<PullResult> Choose(grpc::ServerContext* context, const v1::Layout& layout_proto,
                                    const engine::Layout& layout,
                                    const engine::PromptPrefix& prompt,
                                    const std::string& client_salt, const PullAsk& ask,
                                    const std::string& bearer, absl::Time deadline);
  absl::StatusOr<PullResult> PullFrom(grpc::ServerContext* context, const v1::Layout& layout_proto,
                                      const engine::Layout& layout,
                                      const engine::PromptPrefix& prompt,
                                      const std::string& client_salt, const PullAsk& ask,
                                      const std::string& bearer, absl::Time deadline,
                                      uint64_t local, const std::string& holder);

  engine::Engine* const engine_;
  ClusterIndex* const index_;
  const std::string self_;
  PeerLinks* const links_;
  const uint64_t max_bytes_;
  const int max_pulls_;
  std::atomic<int> running_{0};
  std::atomic<uint64_t> pulled_{0}, nothing_{0}, failed_{0}, tokens_{0};
  metrics::PeerByteCounter bytes_;
  engine::Histogram seconds_;
};

}  // namespace kvmem::service
