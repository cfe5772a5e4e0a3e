#pragma once
// SequenceMover: MoveSequence's receiving side. Moves a sequence whole from another node of
// the fleet (the prefill node's kvmemd, say) to this one: ExportSequence there (which
// freezes it and streams its header and pieces), each piece checked and written into this
// pool as it comes (engine/sequence_move.h), the sequence committed here, then FinishExport
// there, which releases it. Until that last call the holder keeps its sequence, so a move
// that fails anywhere before leaves it there (unfrozen at once by FinishExport(moved=false),
// or when its hold lapses) and nothing here; a commit here whose FinishExport the holder
// refuses (its hold lapsed first, or the sequence was released) is undone here. Only when
// the holder's answer to FinishExport is lost does the move end with two copies, the
// holder's frozen until its hold lapses (MoveSequenceResponse.source_released = false).
//
// Trust as PullPrefix's (prefix_pull.h): only --cluster-peers are asked, with the caller's
// bearer token, so that the holder scopes the calls to the same tenant, and the holder's
// answers are untrusted input (checked by the engine's import; its scoped salt must be the
// caller's tenant's). Memory: a move holds one piece (about 2 MiB of K/V) in host memory at a
// time, its blocks in this pool as they land (the tenant's quota applies) and the moved
// slots' metadata from --host-metadata-bytes; at most max_bytes of blocks per move and
// max_moves moves at once.
//
// Transport: the blocks come in the export's messages (gRPC), or, where this daemon can
// read the holder's pool (both built with UCX, the holder running --ucx, and this daemon
// given a token the holder knows as a peer's or an admin's: --cluster-peer-token-file), by RMA gets
// from it, the export naming each block's offset and holding the blocks until it ends. The
// tenant's own calls still carry the tenant's token; only the pool's key is asked with the
// peer token. The calls go over PeerLinks' channels (TLS with --cluster-peer-tls-ca).
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
#include "server/service/auth.h"
#include "server/service/peer_links.h"

namespace kvmem::service {

struct MoveResult {
  engine::CreateResult created;
  uint64_t slots = 0;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  bool source_released = false;
  std::string policy;
  engine::Layout layout;
  std::string transport;  // "attach", "ucx" or "grpc"
};

class SequenceMover {
 public:
  // `links`: the channels to the peers and their pools by UCX (outlives the mover).
  SequenceMover(engine::Engine* engine, uint64_t max_bytes, int max_moves, PeerLinks* links)
      : engine_(engine),
        links_(links),
        max_bytes_(max_bytes),
        max_moves_(max_moves),
        seconds_(engine::LatencyBounds()) {}

  // `who` the caller; `bearer` its authorization header ("" for none); `deadline` the
  // call's, capped.
  absl::StatusOr<MoveResult> Move(grpc::ServerContext* context, const std::string& from_node,
                                  uint64_t sequence_id, const Principal& who,
                                  const std::string& bearer, absl::Duration lease,
                                  const std::string& transport, absl::Time deadline);
  metrics::MoveTotals totals() const;

 private:
  // `unmappable`: null, the holder's pool is not mapped; else set when the move failed for
  // want of a mapping of the exporting instance (the holder restarted since it was mapped,
  // and cannot be mapped again) and the holder confirmed the export given up: nothing
  // changed on either side.
  absl::StatusOr<MoveResult> MoveFrom(grpc::ServerContext* context, const std::string& from_node,
                                      uint64_t sequence_id, const Principal& who,
                                      const std::string& bearer, absl::Duration lease,
                                      const std::string& transport, absl::Time deadline,
                                      bool* unmappable);

  engine::Engine* const engine_;
  PeerLinks* const links_;
  const uint64_t max_bytes_;
  const int max_moves_;
  std::atomic<int> running_{0};
  std::atomic<uint64_t> moved_{0}, failed_{0}, unreleased_{0};
  metrics::PeerByteCounter bytes_;
  engine::Histogram seconds_;
};

// The holder's side, as protobuf: the header and a piece (engine/sequence_move.h).
v1::SequenceHeader ToProto(const engine::MovedHeader& h);
void ToProto(engine::MovedPiece&& piece, v1::SequencePiece* out);
absl::StatusOr<engine::MovedHeader> FromProto(const v1::SequenceHeader& h);
absl::StatusOr<engine::MovedPiece> FromProto(v1::SequencePiece&& piece);

}  // namespace kvmem::service
