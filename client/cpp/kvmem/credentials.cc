#include "kvmem/credentials.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvmem::client {

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::NotFoundError(absl::StrCat("auth token file ", path, ": cannot read a line"));
  }
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auth token file ", path, ": empty"));
  }
  return token;
}

namespace internal {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options, grpc::ChannelArguments* args) {
  if (options.tls_root_certs.empty()) {
    if (!options.tls_cert_chain.empty() || !options.tls_private_key.empty()) {
      return absl::InvalidArgumentError(
          "options.tls_cert_chain: a client certificate needs tls_root_certs (TLS) too");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = options.tls_root_certs;
  tls.pem_cert_chain = options.tls_cert_chain;
  tls.pem_private_key = options.tls_private_key;
  if (!options.tls_server_name.empty()) args->SetSslTargetNameOverride(options.tls_server_name);
  return grpc::SslCredentials(tls);
}

std::string Authorization(const ClientOptions& options) {
  return options.auth_token.empty() ? std::string() : absl::StrCat("Bearer ", options.auth_token);
}

}  // namespace internal
}  // namespace kvmem::client
