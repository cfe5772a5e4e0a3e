// The attach socket (proto/kvmem/v1/attach.h) under arbitrary peers: each input is a few
// connections, each sending raw bytes or a request with a real, forged or made-up ticket.
// Checked: every answer is one whole Reply (or the connection closed), descriptors come
// only with a ticket this socket issued and exactly as its grants say (a read-only one
// never maps writable), and the socket serves a real ticket after every input.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "kvmem/v1/attach.h"
#include "server/transport/attach_socket.h"
#include "server/transport/shared_segment.h"

namespace kvmem::fuzz {
namespace {

namespace wire = v1::attach;

struct State {
  std::shared_ptr<transport::SharedSegment> read_only, writable;
  std::unique_ptr<transport::AttachSocket> socket;
  std::string ro_ticket, rw_ticket;
};
State* state = nullptr;

int Connect() {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  FUZZ_CHECK(fd >= 0, "socket");
  sockaddr_un address;
  const socklen_t length = wire::SocketAddress(state->socket->address(), &address);
  FUZZ_CHECK(connect(fd, reinterpret_cast<const sockaddr*>(&address), length) == 0, "connect");
  return fd;
}

// Sends `bytes` (nothing when empty) and checks what comes back; the descriptors granted.
std::vector<int> Exchange(const std::string& bytes, const std::string* ticket) {
  const int fd = Connect();
  if (!bytes.empty()) {
    while (send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
  }
  shutdown(fd, SHUT_WR);  // said all it will: the socket answers at once
  wire::Reply reply{};
  iovec io{&reply, sizeof reply};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * (wire::kMaxSegments + 4))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  ssize_t got;
  do {  // a signal (SIGCONT after a pause, a profiler's) interrupts the wait only
    got = recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  const int error = got < 0 ? errno : 0;
  // A failed recvmsg leaves the control buffer as it was (zeros): nothing to read there.
  if (got < 0) message.msg_controllen = 0;
  std::vector<int> received;
  for (cmsghdr* h = CMSG_FIRSTHDR(&message); h != nullptr; h = CMSG_NXTHDR(&message, h)) {
    if (h->cmsg_len < CMSG_LEN(0)) break;
    const size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int d = -1;
      std::memcpy(&d, CMSG_DATA(h) + i * sizeof(int), sizeof d);
      received.push_back(d);
    }
  }
  close(fd);
  FUZZ_CHECK(got == static_cast<ssize_t>(sizeof reply), "a reply of %zd bytes (%s)", got,
             error != 0 ? strerror(error) : "no error");
  FUZZ_CHECK(reply.magic == wire::kMagic && reply.version == wire::kVersion, "reply header");
  FUZZ_CHECK(reply.message[wire::kMessageBytes - 1] == '\0', "unterminated message");
  const bool granted = ticket != nullptr;
  FUZZ_CHECK((reply.code == 0) == granted, "code %u for a %s ticket", reply.code,
             granted ? "real" : "false");
  FUZZ_CHECK(received.size() == (granted ? 1u : 0u) && reply.count == received.size(),
             "%zu descriptors, count %u", received.size(), reply.count);
  if (granted) {
    const bool writable = *ticket == state->rw_ticket;
    FUZZ_CHECK(reply.segments[0].writable == (writable ? 1u : 0u), "writable flag");
    const uint64_t bytes = reply.segments[0].bytes;
    void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, received[0], 0);
    FUZZ_CHECK((w != MAP_FAILED) == writable, "a writable mapping of a %s grant",
               writable ? "writable" : "read-only");
    if (w != MAP_FAILED) munmap(w, bytes);
  }
  return received;
}

std::string Request(const std::string& ticket) {
  wire::Request request{};
  request.magic = wire::kMagic;
  request.version = wire::kVersion;
  std::memcpy(request.ticket, ticket.data(), std::min<size_t>(ticket.size(), wire::kTicketBytes));
  return std::string(reinterpret_cast<const char*>(&request), sizeof request);
}

}  // namespace
}  // namespace kvmem::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace kvmem;
  auto* s = new fuzz::State();
  s->read_only = *transport::SharedSegment::Create("fuzz-ro", 4096);
  FUZZ_CHECK(s->read_only->Seal(/*writers_too=*/true).ok(), "seal");
  s->writable = *transport::SharedSegment::Create("fuzz-rw", 4096);
  FUZZ_CHECK(s->writable->Seal(/*writers_too=*/false).ok(), "seal");
  transport::AttachSocket::Options options;
  options.ticket_life = absl::Hours(24);
  // The parser is fuzzed, not the clock: a campaign beside a build is descheduled for
  // longer than a real client's deadline now and then.
  options.request_deadline = absl::Minutes(1);
  s->socket = *transport::AttachSocket::Start(options);
  s->ro_ticket = s->socket->Issue({{v1::attach::kEpochBoard, s->read_only, false}}, "fuzz");
  s->rw_ticket = s->socket->Issue({{v1::attach::kChannel, s->writable, true}}, "fuzz");
  fuzz::state = s;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvmem;
  fuzz::FuzzInput in(data, size);
  fuzz::State& s = *fuzz::state;
  for (int round = 0; round < 4 && in.remaining() > 0; ++round) {
    const uint8_t mode = in.Take<uint8_t>();
    std::vector<int> fds;
    switch (mode % 4) {
      case 0:  // raw bytes: any length, any content (a real ticket inside them is a request)
      {
        const std::string bytes = in.Bytes(in.Take<uint8_t>());
        const bool real =
            bytes.size() == sizeof(v1::attach::Request) &&
            (bytes == fuzz::Request(s.ro_ticket) || bytes == fuzz::Request(s.rw_ticket));
        const std::string* ticket = nullptr;
        if (real) ticket = bytes == fuzz::Request(s.ro_ticket) ? &s.ro_ticket : &s.rw_ticket;
        fds = fuzz::Exchange(bytes, ticket);
      } break;
      case 1:  // a well-formed request with a ticket made of the input's bytes
      {
        const std::string made = in.Bytes(v1::attach::kTicketBytes);
        const std::string* ticket = nullptr;
        if (made == s.ro_ticket) ticket = &s.ro_ticket;
        if (made == s.rw_ticket) ticket = &s.rw_ticket;
        fds = fuzz::Exchange(fuzz::Request(made), ticket);
      } break;
      case 2:  // a real ticket with one byte changed (the input says which and how)
      {
        std::string forged = (in.Take<uint8_t>() & 1) ? s.rw_ticket : s.ro_ticket;
        const uint8_t at = in.Take<uint8_t>() % v1::attach::kTicketBytes;
        const uint8_t flip = in.Take<uint8_t>() | 1;
        forged[at] = static_cast<char>(forged[at] ^ flip);
        fds = fuzz::Exchange(fuzz::Request(forged), nullptr);
      } break;
      default:  // the real ones
        fds = fuzz::Exchange(fuzz::Request((mode & 4) ? s.rw_ticket : s.ro_ticket),
                             (mode & 4) ? &s.rw_ticket : &s.ro_ticket);
        break;
    }
    for (int fd : fds) close(fd);
  }
  // Whatever came before, the socket still serves.
  for (int fd : fuzz::Exchange(fuzz::Request(s.ro_ticket), &s.ro_ticket)) close(fd);
  return 0;
}
