#pragma once
// Maps the daemon's shared-memory segments, which have no names: the client redeems a ticket
// an authenticated call handed it (Info.attach, a step channel's) at kvmemd's attach socket
// and receives their descriptors (kvmem/v1/attach.h).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmem::client {

struct SegmentTicket {
  std::string socket;  // "@name": abstract unix socket; else a path
  std::string ticket;  // v1::attach::kTicketBytes bytes; empty: none was given
  // The daemon's uid: the socket's peer must run as it (a process of another user holding
  // the name gets no hearing); unset: not checked.
  std::optional<uint32_t> daemon_uid;
};

// A descriptor the daemon sent, and what it is.
struct ReceivedSegment {
  uint32_t kind = 0;  // a v1::attach::Segment
  bool writable = false;
  uint64_t bytes = 0;
  int fd = -1;  // the caller's to close
};

// Redeems `ticket`: every segment it grants, by descriptor. UNAVAILABLE when the socket
// cannot be reached (another host's daemon); the daemon's own refusals (an expired ticket, a
// uid it does not serve) keep their codes.
absl::StatusOr<std::vector<ReceivedSegment>> ReceiveSegments(const SegmentTicket& ticket,
                                                             absl::string_view what);

// Maps the segment of `kind` (a v1::attach::Segment) the ticket grants, at least `bytes`
// long, read-write when `writable`; munmap(result, bytes) ends it. `what` names it in
// errors. `at`: mapped there (MAP_FIXED) over addresses the caller reserved for it.
// ReceiveSegments' errors, and FAILED_PRECONDITION when the ticket grants no such
// segment, or not writable.
absl::StatusOr<uint8_t*> MapSegment(const SegmentTicket& ticket, uint32_t kind, uint64_t bytes,
                                    bool writable, absl::string_view what, uint8_t* at = nullptr);

}  // namespace kvmem::client
