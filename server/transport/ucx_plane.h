#pragma once
// UcxPlane: kvmemd's UCX worker (kvmemd --ucx). It registers memory regions once (the pool
// and the epoch board) for remote reads only — RMA get; nothing remote writes into them —
// packs their remote keys, takes remote appends' payloads as active messages, and makes
// progress on a thread of its own: reads over TCP need the target's worker to progress
// (shared memory and CMA do not). The keys are handed out only as GetInfo's `ucx`, to
// callers that may read the pool (as the attach ticket). A key covers its whole region:
// like a mapping of the pool, it reads every tenant's blocks.
//
// Remote appends (AppendRequest.ucx_payload): a gRPC Append announces a transfer (a random
// 128-bit id and its size) and waits in Receive; the client sends the K/V as one active
// message naming the id. Whichever comes first waits for the other: a message that arrives
// first is held as UCX delivered it (a rendezvous message is only its header, its data
// still at the sender; an eager one at most kMaxHeldEagerBytes), at most kMaxHeld of them
// for at most held_ttl, then dropped; its data is received only into the buffer of the
// call that announced it, reserved from the parse budget. So the daemon takes no bytes
// nobody announced.
//
// Keys protect only where the network enforces them (RDMA hardware). Over TCP and shared
// memory UCX emulates RMA with messages that its own handlers serve without checking a key,
// a region or its protection: any process that reaches the worker can read and write any of
// kvmemd's memory. So kvmemd starts it only when told the network is trusted
// (--ucx_trusted_network), until reads are served by a protocol of kvmemd's own.
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
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

  const std::string& worker_address() const { return address_; }
  const Exported& region(size_t i) const { return exported_[i]; }

  // Waits for the payload of transfer `id`, `bytes` long, into a buffer held with
  // `reservation` (its bytes), until `deadline` or until `cancelled` says so (asked every
  // 50 ms). INVALID_ARGUMENT for an id already announced and not yet landed, or a message
  // of another size (which is dropped); DEADLINE_EXCEEDED or CANCELLED when nothing landed
  // in time (a receive still in flight then ends on the worker's thread, which frees the
  // buffer and its reservation). May throw std::bad_alloc (the buffer).
  absl::StatusOr<std::shared_ptr<const Payload>> Receive(TransferId id, uint64_t bytes,
                                                         ParseBudget::Reservation reservation,
                                                         absl::Time deadline,
                                                         const std::function<bool()>& cancelled);
  Counters counters() const;

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
  std::string address_;
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
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::transport
