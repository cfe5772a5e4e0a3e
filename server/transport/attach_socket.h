#pragma once
// AttachSocket: kvmemd's attach socket (the protocol: proto/kvmem/v1/attach.h). An
// authenticated gRPC call issues a ticket for the segments its caller may map; the client
// redeems the ticket here and receives their descriptors (SCM_RIGHTS), read-only where
// reading is all it may do (the segment sealed against new writable mappings: see
// SharedSegment::Seal). A peer whose uid is not served gets no descriptor whatever it sends;
// a ticket expires after `ticket_life`, and each issuer (a tenant) has at most
// `tickets_per_issuer` outstanding (its oldest goes first: one tenant's tickets never push
// out another's). A ticket holds its segments weakly: a step channel closed before its
// ticket is redeemed is gone, not kept alive.
//
// One thread serves every connection, none of them for long: up to `max_pending`
// connections wait for their request at once, each at most `request_deadline`, after which
// it is refused (a silent peer delays no other); past `max_pending` the oldest waiting one
// is refused.
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/transport/shared_segment.h"
#include "server/transport/unix_listener.h"

namespace kvmem::transport {

class AttachSocket {
 public:
  struct Grant {
    uint32_t kind;  // a v1::attach::Segment
    std::weak_ptr<const SharedSegment> segment;
    bool writable = false;
  };
  struct Options {
    // "@name": a name in the abstract namespace (nothing on disk to clean up); anything
    // else: a socket file at that path. Empty: an abstract name of its own, with 64 random
    // bits in it.
    std::string address;
    // The peer uids served besides this process's own.
    std::vector<uid_t> uids;
    absl::Duration ticket_life = absl::Seconds(60);
    size_t tickets_per_issuer = 64;
    // Long enough for a client descheduled between its connect and its send on a loaded
    // host (200 ms refused such clients under a build beside them); a silent peer still
    // delays no other.
    absl::Duration request_deadline = absl::Seconds(2);
    size_t max_pending = 64;
  };

  static absl::StatusOr<std::unique_ptr<AttachSocket>> Start(Options options);
  // Stops serving (a redemption in progress finishes) and removes the socket file it made.
  ~AttachSocket();
  AttachSocket(const AttachSocket&) = delete;
  AttachSocket& operator=(const AttachSocket&) = delete;

  const std::string& address() const { return options_.address; }
  absl::Duration ticket_life() const { return options_.ticket_life; }
  // A new ticket (v1::attach::kTicketBytes random bytes) for `grants`, counted as `issuer`'s
  // (the tenant of the call that asked).
  std::string Issue(std::vector<Grant> grants, const std::string& issuer);
  // Tickets now outstanding (not yet expired or pushed out).
  size_t outstanding() const;

 private:
  struct Ticket {
    std::vector<Grant> grants;
    absl::Time expires;
  };
  explicit AttachSocket(Options options) : options_(std::move(options)) {}
  void Serve();
  // Reads the request waiting on `connection` and answers it.
  void Answer(int connection);
  // The grants of `ticket` while it is valid; NotFound otherwise.
  absl::StatusOr<std::vector<Grant>> Redeem(const std::string& ticket);
  // Drops `issuer`'s expired tickets, and its oldest while it has `keep` or more.
  void Trim(std::deque<std::string>& order, size_t keep, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Options options_;
  std::optional<UnixListener> listener_;
  int stop_fd_ = -1;  // an eventfd the destructor signals
  std::thread server_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
  // Each issuer's tickets in issue (= expiry) order.
  absl::flat_hash_map<std::string, std::deque<std::string>> issued_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::transport
