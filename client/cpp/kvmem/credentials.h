#pragma once
// How a client shows who it is (ClientOptions::auth_token, tls_*): the channel's
// credentials and the metadata value every call carries.
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvmem/client.h"

namespace kvmem::client::internal {

// Plaintext, or TLS with the options' root certificates (and client certificate); sets the
// server-name override in `args` when one is asked for. INVALID_ARGUMENT for a client
// certificate without TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options, grpc::ChannelArguments* args);
// The `authorization` metadata value ("Bearer <token>"); empty without a token.
std::string Authorization(const ClientOptions& options);

}  // namespace kvmem::client::internal
