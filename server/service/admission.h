#pragma once
// Which KvCache calls the service takes on: CallGate lets a drain finish the calls already
// inside a handler while turning new ones away; TenantCalls bounds each tenant's calls in
// flight; AppendStreamBudget bounds what the open AppendStreams hold, daemon-wide
// (contract 3: buffers of calls in flight are bounded).
#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "server/common/mutex.h"

namespace kvmem::service {

// Bounds on what calls in flight hold outside the engine (kvmemd flags of the same names).
struct ServiceLimits {
  uint64_t max_stream_buffer_bytes = 256ull << 20;  // request bytes of all open AppendStreams
  uint32_t max_append_streams = 16;                 // AppendStreams open at once
  size_t request_id_entries = 100000;               // responses kept for retries
  uint64_t request_id_bytes = 64ull << 20;          // ... and their bytes
  // An AppendStream that sends nothing for this long is cancelled: it would otherwise keep
  // its sequence (no other change, no lease expiry) and its reserved blocks for ever.
  absl::Duration append_stream_idle = absl::Seconds(60);
  absl::Duration request_id_ttl = absl::Minutes(10);
  uint32_t max_step_channels = 16;             // step channels open at once (one thread each)
  uint64_t step_channel_bytes = 256ull << 20;  // their segments' bytes, all together
  // ReadKv streams open at once (one thread each while a client is slow to read), and how
  // long one may wait for its client to take the next piece before it is cancelled.
  uint32_t max_read_streams = 32;
  absl::Duration read_stream_idle = absl::Seconds(30);
  // Calls of one tenant inside handlers at once (an open step channel or stream counts
  // for its life); 0: no limit.
  uint32_t tenant_max_calls = 0;
  // A remote append's payload by UCX (AppendRequest.ucx_payload) at most, and how long its
  // call waits for the message to land.
  uint64_t ucx_max_payload_bytes = 256ull << 20;
  // The buffers of announced payloads, landed or waiting, all together.
  uint64_t ucx_payload_memory_bytes = 1ull << 30;
  absl::Duration ucx_payload_timeout = absl::Seconds(30);
};

// Counts the calls inside a handler. Once closed, new calls are refused; a drain waits for
// the admitted ones to finish before the gRPC server shuts down, because gRPC's own
// Shutdown cancels the calls it has not yet handed to a handler.
class CallGate {
 public:
  // One call's admission, held for the length of its handler.
  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    Ticket(Ticket&& other) noexcept : gate_(std::exchange(other.gate_, nullptr)) {}
    Ticket& operator=(Ticket&&) = delete;
    bool admitted() const { return gate_ != nullptr; }

   private:
    friend class CallGate;
    explicit Ticket(CallGate* gate) : gate_(gate) {}
    CallGate* gate_;  // nullptr when refused (or moved from)
  };

  CallGate() = default;
  CallGate(const CallGate&) = delete;
  CallGate& operator=(const CallGate&) = delete;

  // Admits the call unless the gate is closed.
  [[nodiscard]] Ticket Enter();
  // From now on every Enter() is refused. Idempotent.
  void Close();
  bool closed() const;
  // Waits until no admitted call remains and no call at all (admitted or refused) has
  // arrived for `quiet`, or until `deadline`. The quiet time lets calls that gRPC had
  // queued before the gate closed reach it and be refused, rather than be cancelled by the
  // shutdown that follows. False when admitted calls still run at the deadline.
  bool AwaitQuiet(absl::Duration quiet, absl::Time deadline);
  int64_t in_flight() const;

 private:
  mutable absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_arrival_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// Calls in flight per tenant (--tenant-max-calls), so that one tenant's many or slow calls
// cannot hold every handler thread the others need (without identities every call is the
// anonymous tenant's: the limit is then daemon-wide). The count of a tenant goes when its
// last call ends: the table holds only tenants with calls in flight.
class TenantCalls {
 public:
  // One call's place, held for the length of its handler; empty without a limit.
  class Ticket {
   public:
    Ticket() = default;
    ~Ticket();
    Ticket(Ticket&& other) noexcept
        : calls_(std::exchange(other.calls_, nullptr)), tenant_(std::move(other.tenant_)) {}
    Ticket& operator=(Ticket&& other) noexcept {
      if (this != &other) {
        Ticket gone(std::move(*this));  // what this held is given back now
        calls_ = std::exchange(other.calls_, nullptr);
        tenant_ = std::move(other.tenant_);
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;

   private:
    friend class TenantCalls;
    Ticket(TenantCalls* calls, std::string tenant) : calls_(calls), tenant_(std::move(tenant)) {}
    TenantCalls* calls_ = nullptr;
    std::string tenant_;
  };

  explicit TenantCalls(uint32_t max_calls) : max_calls_(max_calls) {}
  // RESOURCE_EXHAUSTED naming the tenant and --tenant-max-calls when `tenant` has its
  // limit of calls in flight.
  absl::StatusOr<Ticket> Enter(const std::string& tenant);
  uint32_t in_flight(const std::string& tenant) const;

 private:
  const uint32_t max_calls_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint32_t> calls_ ABSL_GUARDED_BY(mu_);
};

// The status of a call refused because the daemon is draining: UNAVAILABLE, which clients
// retry, on another instance; nothing of the call was applied.
absl::Status DrainingError();

// Daemon-wide bounds on the open streams of one kind (AppendStreams; ReadKv's server
// streams): how many there are and how many request bytes they buffer together, and which
// went idle. Error messages name the call and the kvmemd flags that set the bounds.
class AppendStreamBudget {
 public:
  // One open stream's share; gives everything back when destroyed.
  class Lease {
   public:
    Lease(Lease&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_), id_(other.id_) {
      other.budget_ = nullptr;
      other.bytes_ = 0;
    }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();
    // Adds `bytes` to this stream's share: RESOURCE_EXHAUSTED (nothing reserved) when all
    // open streams together would pass --max-stream-buffer-bytes.
    [[nodiscard]] absl::Status Reserve(uint64_t bytes);
    // Gives back what Reserve took (a chunk that has been written to the pool).
    void Return(uint64_t bytes);
    // The stream is alive: its idle time starts again.
    void Touch();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class AppendStreamBudget;
    Lease(AppendStreamBudget* budget, uint64_t id) : budget_(budget), id_(id) {}
    AppendStreamBudget* budget_;
    uint64_t bytes_ = 0;
    uint64_t id_ = 0;
  };

  AppendStreamBudget(uint64_t max_bytes, uint32_t max_streams, std::string call = "AppendStream",
                     std::string flag = "--max-append-streams",
                     std::string advice = "retry later or use Append")
      : max_bytes_(max_bytes),
        max_streams_(max_streams),
        call_(std::move(call)),
        flag_(std::move(flag)),
        advice_(std::move(advice)) {}
  AppendStreamBudget(const AppendStreamBudget&) = delete;
  AppendStreamBudget& operator=(const AppendStreamBudget&) = delete;

  // A share for a new stream: RESOURCE_EXHAUSTED when --max-append-streams are open.
  // `context` (may be null) is cancelled by CancelIdle when the stream idles.
  [[nodiscard]] absl::StatusOr<Lease> Open(grpc::ServerContext* context = nullptr);
  // Cancels the streams that have sent nothing for `idle`; returns how many.
  int CancelIdle(absl::Duration idle);
  uint32_t open() const;

 private:
  const uint64_t max_bytes_;
  const uint32_t max_streams_;
  const std::string call_, flag_, advice_;
  mutable absl::Mutex mu_;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  struct OpenStream {
    grpc::ServerContext* context;
    absl::Time last_activity;
  };
  absl::flat_hash_map<uint64_t, OpenStream> open_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvmem::service
