#pragma once
// kvmemd's attach socket: how a same-host client receives the descriptors of the daemon's
// shared-memory segments (the pool, the epoch board, the table area, a step channel and its
// signal area). None of them has a name another process could open: an authenticated call
// hands its caller a ticket (GetInfoResponse.attach, OpenStepChannelResponse.attach), and
// the client redeems it here:
//
//   client: connects to the socket (AF_UNIX, SOCK_SEQPACKET; an address "@name" is in the
//           abstract namespace, anything else a path) and sends one Request;
//   daemon: checks the peer's uid (SO_PEERCRED) against the uids it serves, then the ticket
//           (issued by this daemon, not expired, its segments still alive), and sends one
//           Reply with the descriptors attached (SCM_RIGHTS), in the order of
//           Reply.segments, then closes the connection. A refusal has code != 0 (a
//           google.rpc.Code), no descriptor and a message.
//
// A ticket may be redeemed more than once until it expires (a client that maps the pool and
// then its table area from one GetInfo). A read-only grant's segment is sealed against new
// writable mappings: its descriptor maps read-only, however it is reopened. Everything the client
// reads here is the daemon's; everything the daemon reads is untrusted (one fixed-size message,
// checked whole).
#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace kvmem::v1::attach {

inline constexpr uint32_t kMagic = 0x4B564154;  // "KVAT"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kTicketBytes = 32;
inline constexpr uint32_t kMaxSegments = 4;
inline constexpr uint32_t kMessageBytes = 256;

enum Segment : uint32_t {
  kPool = 1,        // the CPU backend's pool (read-write with --in-place-writes)
  kEpochBoard = 2,  // read-only
  kTableArea = 3,   // read-only
  kChannel = 4,     // a step channel's segment (read-write)
  kSignalArea = 5,  // a step channel's signal area (read-write)
};

struct Request {
  uint32_t magic;
  uint32_t version;
  uint8_t ticket[kTicketBytes];
};

struct Granted {
  uint32_t kind;      // a Segment
  uint32_t writable;  // 1: the descriptor maps read-write; 0: read-only
  uint64_t bytes;     // the segment's size
};

struct Reply {
  uint32_t magic;
  uint32_t version;
  uint32_t code;   // 0: granted; else a google.rpc.Code and `message` says why
  uint32_t count;  // descriptors attached, one per segments[i]
  Granted segments[kMaxSegments];
  char message[kMessageBytes];  // NUL-terminated
};

// The sockaddr of an attach socket's address ("@name": abstract, else a path; at most
// sizeof(sun_path) - 1 characters, which the caller has checked) and its length.
inline socklen_t SocketAddress(std::string_view address, sockaddr_un* out) {
  *out = {};
  out->sun_family = AF_UNIX;
  std::memcpy(out->sun_path, address.data(), address.size());
  if (!address.empty() && address[0] == '@') out->sun_path[0] = '\0';
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
}

// The layout other languages pack by hand (client/python/kvmem/shared_pool.py).
static_assert(sizeof(Request) == 40);
static_assert(sizeof(Granted) == 16);
static_assert(offsetof(Reply, segments) == 16 && sizeof(Reply) == 336);

}  // namespace kvmem::v1::attach
