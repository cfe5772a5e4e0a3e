#include "server/service/auth.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/common/mutex.h"

namespace kvmem::service {

namespace {

std::string Sha256(absl::string_view text) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (EVP_Digest(text.data(), text.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1) {
    return {};  // never matches a stored digest (those are never empty)
  }
  return std::string(reinterpret_cast<const char*>(digest.data()), length);
}

}  // namespace

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

namespace {

constexpr absl::string_view kUidPrefix = "uid:";
// What SO_PEERCRED reports for a uid outside kvmemd's user namespace (the kernel's
// overflowuid, 65534 unless set otherwise).
uint32_t OverflowUid() {
  uint32_t uid = 65534;
  std::ifstream in("/proc/sys/kernel/overflowuid");
  if (in) in >> uid;
  return uid;
}

bool ValidToken(absl::string_view token) {
  if (token.size() < 16 || token.size() > 512 || absl::StartsWith(token, kUidPrefix)) return false;
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

absl::Status Unauthenticated() {
  return absl::UnauthenticatedError(absl::StrCat(
      Authenticator::kMetadataKey,
      ": kvmemd requires a known bearer token (metadata 'authorization: Bearer <token>'), a "
      "verified client certificate, or a unix-socket peer whose uid the token file maps"));
}

}  // namespace

absl::StatusOr<Authenticator::Credentials> Authenticator::Parse(absl::string_view text,
                                                                absl::string_view path) {
  Credentials credentials;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    // A comment starts with a '#' that begins a word (a token may hold '#').
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '#' && (i == 0 || line[i - 1] == ' ' || line[i - 1] == '\t')) {
        line = line.substr(0, i);
        break;
      }
    }
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth-tokens: ", path, " line ", line_number, ": ", why));
    };
    if (words.size() < 2 || words.size() > 3 ||
        (words.size() == 3 && words[2] != "admin" && words[2] != "peer")) {
      return bad("expected '<tenant> <token> [admin|peer]' or '<tenant> uid:<n> [admin|peer]'");
    }
    if (!ValidTenantName(words[0])) return bad("the tenant must be 1-64 of [A-Za-z0-9._-]");
    Principal who{std::string(words[0]), words.size() == 3 && words[2] == "admin",
                  words.size() == 3 && words[2] == "peer"};
    if (absl::string_view uid_text = words[1]; absl::ConsumePrefix(&uid_text, kUidPrefix)) {
      uint32_t uid = 0;
      if (uid_text.empty() || uid_text.size() > 10 ||
          !std::all_of(uid_text.begin(), uid_text.end(), absl::ascii_isdigit) ||
          !absl::SimpleAtoi(uid_text, &uid) || uid == static_cast<uint32_t>(-1)) {
        return bad("a uid must be uid:<n>, n a decimal number below 4294967295");
      }
      if (uid == OverflowUid()) {
        return bad(absl::StrCat(
            "uid:", uid,
            " is the kernel's overflow uid: every peer whose uid kvmemd's user namespace cannot "
            "map shows as it"));
      }
      if (!credentials.uids.emplace(static_cast<uid_t>(uid), std::move(who)).second) {
        return bad("the uid is listed twice");
      }
      continue;
    }
    if (!ValidToken(words[1])) {
      return bad(
          "the token must be 16-512 printable characters without spaces, not beginning with "
          "\"uid:\"");
    }
    if (!credentials.tokens.emplace(Sha256(words[1]), std::move(who)).second) {
      return bad("the token is listed twice");
    }
  }
  if (credentials.tokens.empty() && credentials.uids.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: ", path, " lists no token and no uid"));
  }
  return credentials;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(std::string token_file,
                                                                     bool client_certificates) {
  std::unique_ptr<Authenticator> auth(
      new Authenticator(std::move(token_file), client_certificates));
  if (!auth->path_.empty()) {
    if (absl::Status s = auth->Reload(); !s.ok()) return s;
  }
  return auth;
}

absl::Status Authenticator::Reload() {
  if (path_.empty()) return absl::FailedPreconditionError("kvmemd has no --auth-tokens file");
  std::ifstream in(path_);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--auth-tokens: cannot read ", path_));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<Credentials> credentials = Parse(text.str(), path_);
  if (!credentials.ok()) return credentials.status();
  // The first read (Create) comes before kvmemd's unix socket exists: Server::Start checks
  // that one.
  if (!credentials->uids.empty() && peers_.load(std::memory_order_acquire) == nullptr &&
      generation() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-tokens: ", path_,
        " maps uids, which only a unix --listen without TLS can tell (kvmemd's peers)"));
  }
  kvmem::MutexLock lock(&mu_);
  credentials_ = *std::move(credentials);
  generation_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Authenticator::StillValid(const grpc::ServerContext* context, const Principal& who,
                                       uint64_t* seen) const {
  const uint64_t now = generation();
  if (now == *seen) return absl::OkStatus();
  absl::StatusOr<Principal> again = Authenticate(context);
  if (!again.ok() || again->tenant != who.tenant || again->admin != who.admin ||
      again->peer != who.peer) {
    return absl::UnauthenticatedError(
        "the token this call was authenticated with is no longer valid (the token file was "
        "reloaded); nothing of this request was applied");
  }
  *seen = now;
  return absl::OkStatus();
}

absl::StatusOr<Principal> Authenticator::FromAuthorization(absl::string_view value,
                                                           absl::string_view certificate_name,
                                                           std::optional<uid_t> peer_uid) const {
  if (!enabled()) return Principal{"", true};
  // What the channel says, by certificate or by the peer's uid (never both: a unix socket
  // carries no certificate).
  std::optional<Principal> by_channel;
  absl::string_view channel_kind;
  if (certificates_ && !certificate_name.empty()) {
    if (!ValidTenantName(certificate_name)) {
      return absl::UnauthenticatedError(
          "the client certificate's common name is not a tenant name (1-64 of [A-Za-z0-9._-])");
    }
    by_channel = Principal{std::string(certificate_name), false};
    channel_kind = "client certificate";
  }
  const std::string digest =
      absl::StartsWith(value, kBearer) ? Sha256(value.substr(kBearer.size())) : std::string();
  kvmem::MutexLock lock(&mu_);
  if (!by_channel && peer_uid) {
    auto it = credentials_.uids.find(*peer_uid);
    if (it != credentials_.uids.end()) {
      by_channel = it->second;
      channel_kind = "unix-socket peer's uid";
    }
  }
  if (value.empty() && by_channel) return *by_channel;
  if (digest.empty()) return Unauthenticated();
  auto it = credentials_.tokens.find(digest);
  if (it == credentials_.tokens.end()) return Unauthenticated();
  if (by_channel && by_channel->tenant != it->second.tenant) {
    return absl::UnauthenticatedError(
        absl::StrCat("the bearer token and the ", channel_kind, " name different tenants"));
  }
  return it->second;
}

absl::StatusOr<Principal> Authenticator::Authenticate(const grpc::ServerContext* context) const {
  if (!enabled()) return Principal{"", true};
  std::string certificate_name;
  if (certificates_) {
    // Set by gRPC only for a certificate it verified against --tls-client-ca.
    const std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) {
      const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
      if (names.size() == 1) certificate_name.assign(names[0].data(), names[0].size());
    }
  }
  const auto& metadata = context->client_metadata();
  const grpc::string_ref key(kMetadataKey.data(), kMetadataKey.size());
  // A call sending the key twice is refused: which one would count is not obvious.
  const size_t sent = metadata.count(key);
  if (sent > 1) return Unauthenticated();
  absl::string_view value;
  if (sent == 1) {
    auto it = metadata.find(key);
    value = absl::string_view(it->second.data(), it->second.size());
  }
  std::optional<uid_t> peer_uid;
  if (const transport::UnixPeers* peers = peers_.load(std::memory_order_acquire)) {
    if (std::optional<ucred> peer = peers->PeerOf(context->peer())) peer_uid = peer->uid;
  }
  return FromAuthorization(value, certificate_name, peer_uid);
}

bool Authenticator::maps_uids(bool others) const {
  kvmem::MutexLock lock(&mu_);
  for (const auto& [uid, who] : credentials_.uids) {
    if (!others || uid != geteuid()) return true;
  }
  return false;
}

bool IsLocalListen(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) {
    return true;
  }
  absl::string_view host = listen;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    host = host.substr(1, close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  if (host == "localhost" || host == "::1") return true;
  // 127.0.0.0/8, as four numbers (not a DNS name that begins with "127.").
  std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4) return false;
  for (absl::string_view octet : octets) {
    uint32_t value = 0;
    if (octet.empty() || !absl::SimpleAtoi(octet, &value) || value > 255) return false;
  }
  return octets[0] == "127";
}

}  // namespace kvmem::service
