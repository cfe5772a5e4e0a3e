#pragma once
// Who a call comes from, taken from the channel and never from a request field.
//
// With a token file (kvmemd --auth-tokens), every call carries `authorization: Bearer
// <token>` metadata and the file names the token's tenant; a call without a known token is
// UNAUTHENTICATED, whatever it asks. Without one, kvmemd serves one trust domain: every
// call is the anonymous principal, which sees everything (and kvmemd then listens only on
// loopback or a unix socket unless --allow-unauthenticated-remote says otherwise).
//
// With TLS and client certificates (kvmemd --tls-client-ca), a call's tenant is its
// certificate's common name; a call carrying both a certificate and a token must name the
// same tenant with both.
//
// On a unix socket (kvmemd --listen unix:...), the token file may also map a peer's uid to
// its tenant: a line `<tenant> uid:<n> [admin]`. kvmemd accepts those connections itself and
// takes each peer's uid from the kernel (SO_PEERCRED, transport::UnixPeers); a call from a
// mapped uid needs no token, and one that carries a token must name the uid's tenant.
//
// The token file: one token per line, `<tenant> <token> [admin|peer]`; a '#' that begins a
// word starts a comment. A `peer` is another kvmemd of the fleet (its
// --cluster-peer-token-file): it is given the pool's UCX keys (GetInfo), to read blocks
// for MoveSequence and PullPrefix, and otherwise is the tenant it names, nothing of an
// admin's. Write a new file and rename it over the old one before SIGHUP: a reload
// that reads a half-written file may drop tokens.
// A tenant name is 1-64 of [A-Za-z0-9._-]; a token is 16-512 printable characters without
// spaces and not beginning with "uid:"; a tenant may have several tokens (rotation). kvmemd reads
// it at start and again on SIGHUP; a file that does not parse leaves the tokens as they were.
#include <sys/types.h>

#include <atomic>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "server/transport/unix_peers.h"

namespace kvmem::service {

struct Principal {
  // The tenant ("" for the anonymous principal of a daemon without tokens).
  std::string tenant;
  // Sees and may name every tenant's sequences (Stats lists them all).
  bool admin = false;
  // Another kvmemd of the fleet: may read the pool by UCX (GetInfo's keys), as an admin.
  bool peer = false;
  // Given the pool's UCX keys, which read every tenant's blocks.
  bool reads_pool() const { return admin || peer; }
};

class Authenticator {
 public:
  // No token file: every call is the anonymous principal (an admin).
  Authenticator() = default;
  // Reads `token_file` (may be empty: no tokens); an error names the file and the line.
  // `client_certificates`: calls authenticated by a verified client certificate.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(std::string token_file,
                                                               bool client_certificates);

  bool enabled() const { return !path_.empty() || certificates_; }
  // Where a call's peer uid is looked up (calls on kvmemd's unix socket); must outlive this.
  // Without it (a TCP --listen, or TLS), a token file with uid lines is refused (Reload).
  void set_peers(const transport::UnixPeers* peers) {
    peers_.store(peers, std::memory_order_release);
  }
  // Whether the token file maps a uid (other than kvmemd's own: `others`).
  bool maps_uids(bool others = false) const;
  // Reads the token file again (SIGHUP); on an error the tokens stay as they were.
  absl::Status Reload();
  // Counts the reloads that succeeded: a long call (a step channel, an AppendStream) checks
  // its principal again when it has moved (StillValid).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // OK when the call behind `context` still authenticates as `who` (its token was not
  // revoked or moved to another tenant by a reload since `*seen`, which it updates);
  // UNAUTHENTICATED otherwise.
  absl::Status StillValid(const grpc::ServerContext* context, const Principal& who,
                          uint64_t* seen) const;
  // The principal of a call; UNAUTHENTICATED (one message for a missing, malformed or
  // unknown token) when tokens are required and the call has none that is known.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContext* context) const;
  // The same from the `authorization` metadata value (empty when the call sent none), the
  // verified client certificate's common name (empty: none) and the unix-socket peer's uid
  // (nullopt: not a unix-socket peer).
  absl::StatusOr<Principal> FromAuthorization(absl::string_view value,
                                              absl::string_view certificate_name = {},
                                              std::optional<uid_t> peer_uid = std::nullopt) const;

  // The metadata key a client sends its token under, and how the value begins.
  static constexpr absl::string_view kMetadataKey = "authorization";
  static constexpr absl::string_view kBearer = "Bearer ";

 private:
  Authenticator(std::string path, bool certificates)
      : path_(std::move(path)), certificates_(certificates) {}
  struct Credentials {
    // By the token's SHA-256 (a lookup compares digests, not secrets).
    absl::flat_hash_map<std::string, Principal> tokens;
    absl::flat_hash_map<uid_t, Principal> uids;
  };
  static absl::StatusOr<Credentials> Parse(absl::string_view text, absl::string_view path);

  const std::string path_;
  const bool certificates_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<const transport::UnixPeers*> peers_{nullptr};
  mutable absl::Mutex mu_;
  Credentials credentials_ ABSL_GUARDED_BY(mu_);
};

// Whether `listen` (kvmemd --listen) is a unix socket or a loopback address only.
bool IsLocalListen(absl::string_view listen);
// Whether `name` may name a tenant: 1-64 of [A-Za-z0-9._-].
bool ValidTenantName(absl::string_view name);

}  // namespace kvmem::service
