#pragma once
// Who a call comes from, taken from the channel and never from a request field.
//
// With a token file (kvmemd --auth-tokens), every call carries `authorization: Bearer
// <token>` metadata and the file names the token's tenant; a call without a known token is
// UNAUTHENTICATED, whatever it asks. Without one, kvmemd serves one trust domain: every
// call is the anonymous principal, which sees everything (and kvmemd then listens only on
// loopback or a unix socket unless --allow-unauthenticated-remote says otherwise).
//
// The token file: one token per line, `<tenant> <token> [admin]`; '#' starts a comment.
// A tenant name is 1-64 of [A-Za-z0-9._-]; a token is 16-512 printable characters without
// spaces; a tenant may have several tokens (rotation). kvmemd reads it at start and again
// on SIGHUP; a file that does not parse leaves the tokens as they were.
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace kvmem::service {

struct Principal {
  // The tenant ("" for the anonymous principal of a daemon without tokens).
  std::string tenant;
  // Sees and may name every tenant's sequences (Stats lists them all).
  bool admin = false;
};

class Authenticator {
 public:
  // No token file: every call is the anonymous principal (an admin).
  Authenticator() = default;
  // Reads `token_file`; an error names the file and the line.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(std::string token_file);

  bool enabled() const { return !path_.empty(); }
  // Reads the token file again (SIGHUP); on an error the tokens stay as they were.
  absl::Status Reload();
  // The principal of a call; UNAUTHENTICATED (one message for a missing, malformed or
  // unknown token) when tokens are required and the call has none that is known.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContext* context) const;
  // The same from the `authorization` metadata value (empty when the call sent none).
  absl::StatusOr<Principal> FromAuthorization(absl::string_view value) const;

  // The metadata key a client sends its token under, and how the value begins.
  static constexpr absl::string_view kMetadataKey = "authorization";
  static constexpr absl::string_view kBearer = "Bearer ";

 private:
  explicit Authenticator(std::string path) : path_(std::move(path)) {}
  // The tokens of `text`, keyed by their SHA-256 (a lookup compares digests, not secrets).
  static absl::StatusOr<absl::flat_hash_map<std::string, Principal>> Parse(absl::string_view text,
                                                                           absl::string_view path);

  const std::string path_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Principal> tokens_ ABSL_GUARDED_BY(mu_);
};

// Whether `listen` (kvmemd --listen) is a unix socket or a loopback address only.
bool IsLocalListen(absl::string_view listen);

}  // namespace kvmem::service
