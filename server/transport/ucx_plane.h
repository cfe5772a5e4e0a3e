#pragma once
// UcxPlane: kvmemd's UCX workers (kvmemd --ucx), progressed by one thread of their own.
// The reads' worker registers memory regions once (the pool and the epoch board) for
// remote reads only — RMA get; nothing remote writes into them — and packs their remote
// keys: reads over TCP need it to progress (shared memory and CMA do not). Its address and
// the keys go only in GetInfo's `ucx`, to callers that may read the pool (as the attach
// ticket): a key covers its whole region and, like a mapping of the pool, reads every
// tenant's blocks. The appends' worker has a context of its own with active messages
// only (no RMA, no registered memory), so its address goes to every caller.
//
// Remote appends (AppendRequest.ucx_payload): a gRPC Append announces a transfer (a random
// 128-bit id and its size, checked against the sequence's layout) and waits in Receive;
// the client sends the K/V as one active message naming the id. Whichever comes first
// waits for the other: a message that arrives first is held as UCX delivered it (a
// rendezvous message is only its header, its data still at the sender; an eager one at
// most kMaxHeldEagerBytes), at most kMaxHeld of them for at most held_ttl, then dropped
// (and at once when its call was refused: Refuse). Its data is received only into the
// buffer of the call that announced it, reserved from the service's budget for announced
// payloads. What UCX itself buffers before a message reaches the handler (an eager
// message's fragments, up to UCX's rendezvous threshold) is UCX's, not counted here.
// A rendezvous message must name its sender's endpoint (UCP_AM_SEND_FLAG_REPLY): when
// its call gives up with the data still coming, that endpoint is closed by force, which
// ends the receive where the sender's endpoint has peer error handling (UcxSender's over
// TCP). A sender without it that stops mid-transfer pins its receive's buffer (and
// reservation) until kvmemd stops: kvmem_ucx_receives_in_flight shows it.
//
// Keys protect only where the network enforces them (RDMA hardware). Over TCP and shared
// memory UCX emulates RMA with messages that its own handlers serve without checking a key,
// a region or its protection: any process that reaches the reads' worker can read and
// write any of kvmemd's memory. So kvmemd starts the workers only when told the network is
// trusted (--ucx_trusted_network), until reads are served by a protocol of kvmemd's own.
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/transport/parse_cost.h"
#include "server/transport/remote_payload.h"

namespace kvmem::transport {

class UcxPlane {
 public:
  struct Region {
    const void* base;
    uint64_t bytes;
  };
  // A registered region as a remote reader names it.
  struct Exported {
    std::string rkey;  // ucp_rkey_pack's bytes
    uint64_t address = 0;
    uint64_t bytes = 0;
  };
  struct Options {
    // A message that arrives before the call announcing it is held this long at most.
    absl::Duration held_ttl = absl::Seconds(10);
  };
  // A remote append's transfer id (UcxPayload.transfer_hi/lo).
  struct TransferId {
    uint64_t hi = 0, lo = 0;
    bool operator==(const TransferId& o) const { return hi == o.hi && lo == o.lo; }
    template <typename H>
    friend H AbslHashValue(H h, const TransferId& id) {
      return H::combine(std::move(h), id.hi, id.lo);
    }
  };
  // The active message's header (UcxPayload's wire header).
  struct PayloadHeader {
    uint32_t magic = kPayloadMagic;
    uint32_t version = 1;
    uint64_t hi = 0, lo = 0;
  };
  static_assert(sizeof(PayloadHeader) == 24);
  static constexpr uint32_t kPayloadMagic = 0x4B564D55;
  static constexpr unsigned kPayloadAmId = 1;  // UcxPayload.AM_ID
  static constexpr size_t kMaxHeld = 256;
  static constexpr uint64_t kMaxHeldEagerBytes = 64 << 10;
  // A payload that landed (or is landing: an abandoned receive still in flight holds it).
  class Landing;
  using Payload = RemotePayload;
  // What the worker has seen of remote appends since it started.
  struct Counters {
    uint64_t landed = 0, landed_bytes = 0;
    uint64_t dropped = 0;  // messages no call took (malformed, unannounced, too many)
    uint64_t failed = 0;   // announced transfers that did not land (size, error, time)
    // Now: receives in flight (an abandoned one until UCX ends it), messages held for
    // their call.
    uint64_t receiving = 0, held = 0;
  };

  // Transports come from UCX's environment as usual (UCX_TLS, UCX_NET_DEVICES).
  static absl::StatusOr<std::unique_ptr<UcxPlane>> Start(const std::vector<Region>& regions,
                                                         Options options);
  static absl::StatusOr<std::unique_ptr<UcxPlane>> Start(const std::vector<Region>& regions) {
    return Start(regions, Options());
  }
  // Stops progress, deregisters the regions and ends the worker.
  ~UcxPlane();
  UcxPlane(const UcxPlane&) = delete;
  UcxPlane& operator=(const UcxPlane&) = delete;

  // The reads' worker (RMA; for callers that may read the pool) and the appends' (active
  // messages only: for every caller).
  const std::string& worker_address() const { return address_; }
  const std::string& append_worker_address() const { return append_address_; }
  const Exported& region(size_t i) const { return exported_[i]; }

  // Waits for the payload of transfer `id`, `bytes` long, into a buffer held with
  // `reservation` (its bytes), until `deadline` or until `cancelled` says so (asked every
  // 50 ms). INVALID_ARGUMENT for an id already announced and not yet landed, or a message
  // of another size (which is dropped); ABORTED when receiving failed; DEADLINE_EXCEEDED
  // or CANCELLED when nothing landed in time (a receive still in flight is then ended on
  // the worker's thread by closing its sender's endpoint; the buffer and its reservation
  // go with it). May throw std::bad_alloc (the buffer).
  absl::StatusOr<std::shared_ptr<const Payload>> Receive(TransferId id, uint64_t bytes,
                                                         ParseBudget::Reservation reservation,
                                                         absl::Time deadline,
                                                         const std::function<bool()>& cancelled);
  Counters counters() const;
  // The call announcing transfer `id` failed before it waited (Receive): its message,
  // held or still to come within held_ttl, is dropped at once (a rendezvous sender's
  // request ends then, not at the end of held_ttl).
  void Refuse(TransferId id);

 private:
  struct Handles;
  struct Held;  // a message that arrived before its call
  UcxPlane();
  void Progress();
  static ucs_status_t OnPayload(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  // On the worker's thread: starts receiving each held message whose call has come, ends
  // abandoned receives, drops held messages past their time.
  void Match();
  void Finish(Landing& landing, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<Handles> ucx_;
  Options options_;
  std::string address_, append_address_;
  std::vector<Exported> exported_;
  int stop_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread progress_;

  mutable absl::Mutex mu_;
  // Announced transfers, waiting or landing.
  absl::flat_hash_map<TransferId, std::shared_ptr<Landing>> announced_ ABSL_GUARDED_BY(mu_);
  // Receives in flight, by their landing (the worker's thread ends them).
  absl::flat_hash_map<Landing*, std::shared_ptr<Landing>> receiving_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Held>> held_ ABSL_GUARDED_BY(mu_);
  // Sender endpoints closed by force (a receive whose call gave up), until their close
  // ends; the close requests are the worker thread's own.
  absl::flat_hash_set<ucp_ep_h> closed_ ABSL_GUARDED_BY(mu_);
  // Transfers whose calls failed before waiting, and when (UcxPlane::Refuse).
  absl::flat_hash_map<TransferId, absl::Time> refused_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<void*, ucp_ep_h>> closing_;
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::transport
