#pragma once
// RequestCache: makes mutating calls safe to retry. A call carrying a request_id that
// already succeeded gets the first response again instead of being applied twice; a
// repeat that arrives while the first is still running waits for it. Failed calls are not
// kept (an error changed nothing, so running the retry again is right).
//
// Bounded: at most `max_entries` responses and `max_bytes` of them, each kept for `ttl`;
// the oldest go first. Keys are (method, scope, request_id), the scope being the sequence a
// call acts on, so one id reused across methods or sequences never replays another call's
// response. A repeat must carry the same request: an id reused for a different one (a
// fingerprint of the request differs) is INVALID_ARGUMENT, never a replay of the other's
// response.
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "server/common/mutex.h"
#include "server/engine/clock.h"

namespace kvmem::service {

inline constexpr size_t kMaxRequestIdBytes = 64;

// A fingerprint of a request: a hash of every byte of its deterministic serialization
// (maps ordered by key), so that an id reused for a request that differs anywhere, the
// middle of a long K/V payload included, is told from a retry. Values compare only within
// one process (the hash is seeded per process), as the cache's entries do.
uint64_t RequestFingerprint(const google::protobuf::Message& request);

class RequestCache {
 public:
  RequestCache(size_t max_entries, uint64_t max_bytes, absl::Duration ttl,
               const engine::Clock* clock)
      : max_entries_(max_entries), max_bytes_(max_bytes), ttl_(ttl), clock_(clock) {}

  // How long a repeat waits for the first call with its id before ABORTED (retry later).
  static constexpr absl::Duration kMaxWait = absl::Seconds(30);

  // Runs `call` (which fills `response`) once per (method, request_id): a repeat of a call
  // that succeeded gets its response copied into `response` and `call` is not run.
  // INVALID_ARGUMENT for an id longer than kMaxRequestIdBytes, and for an id reused with a
  // request that differs from the first one's (its fingerprint, RequestFingerprint).
  template <typename Call>
  absl::Status Run(absl::string_view method, absl::string_view tenant, uint64_t scope,
                   const google::protobuf::Message& request, absl::string_view request_id,
                   google::protobuf::Message* response, Call&& call) {
    if (request_id.empty()) return call();
    if (absl::Status s = CheckId(request_id); !s.ok()) return s;
    const std::string key = Key(method, tenant, scope, request_id);
    std::shared_ptr<Entry> entry;
    if (absl::Status s = Claim(key, RequestFingerprint(request), response, &entry);
        !s.ok() || entry == nullptr) {
      return s;
    }
    absl::Status status = call();
    Finish(key, entry, status, *response);
    return status;
  }

  // Run() for a client stream (AppendStream), whose messages arrive one at a time: the first
  // keys the call as Run's request does, and a repeat must resend the same whole stream.
  // `call(&whole)` runs the stream, setting `whole` to StreamFingerprint over every message
  // it read; `rest()` reads a repeat's remaining messages, applying nothing, and returns the
  // whole stream's StreamFingerprint. A repeat whose stream differs anywhere is
  // INVALID_ARGUMENT, not a replay.
  template <typename Call, typename Rest>
  absl::Status RunStream(absl::string_view method, absl::string_view tenant, uint64_t scope,
                         const google::protobuf::Message& first, absl::string_view request_id,
                         google::protobuf::Message* response, Call&& call, Rest&& rest) {
    uint64_t whole = 0;
    if (request_id.empty()) return call(&whole);
    if (absl::Status s = CheckId(request_id); !s.ok()) return s;
    const std::string key = Key(method, tenant, scope, request_id);
    std::shared_ptr<Entry> entry;
    uint64_t replayed_stream = 0;
    if (absl::Status s = Claim(key, RequestFingerprint(first), response, &entry, &replayed_stream);
        !s.ok()) {
      return s;
    }
    if (entry == nullptr) {  // replayed: only if the whole stream is the first call's
      absl::StatusOr<uint64_t> repeat = rest();
      if (!repeat.ok() || *repeat != replayed_stream) {
        response->Clear();
        return repeat.ok() ? ReusedIdError() : repeat.status();
      }
      return absl::OkStatus();
    }
    absl::Status status = call(&whole);
    Finish(key, entry, status, *response, whole);
    return status;
  }
  // The fingerprint of a stream so far (`so_far`, 0 before the first message) and its next
  // message.
  static uint64_t StreamFingerprint(uint64_t so_far, const google::protobuf::Message& next);

  size_t size() const;
  uint64_t bytes() const;
  // Repeats waiting now for the first call with their id.
  size_t waiting() const;

 private:
  struct Entry {
    uint64_t fingerprint = 0;
    uint64_t stream_fingerprint = 0;  // a client stream's whole (RunStream)
    bool done = false;
    bool ok = false;
    std::string response;  // serialized, when ok
    absl::Time stored;
  };

  static absl::Status CheckId(absl::string_view request_id);
  // A call's key: tenant names hold no '/' (service::Authenticator), so keys of different
  // tenants never meet.
  static std::string Key(absl::string_view method, absl::string_view tenant, uint64_t scope,
                         absl::string_view request_id) {
    return absl::StrCat(method, "/", tenant, "/", scope, "/", request_id);
  }
  static absl::Status ReusedIdError();
  // The response of a finished call, and its stream's fingerprint (RunStream).
  static absl::Status Replay(const Entry& done, google::protobuf::Message* response,
                             uint64_t* stream_fingerprint);
  // Sets *entry when the caller must run the call; else the response was replayed (OK).
  absl::Status Claim(const std::string& key, uint64_t fingerprint,
                     google::protobuf::Message* response, std::shared_ptr<Entry>* entry,
                     uint64_t* stream_fingerprint = nullptr);
  void Finish(const std::string& key, const std::shared_ptr<Entry>& entry,
              const absl::Status& status, const google::protobuf::Message& response,
              uint64_t stream_fingerprint = 0);
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_entries_;
  const uint64_t max_bytes_;
  const absl::Duration ttl_;
  const engine::Clock* const clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // keys of finished entries, oldest first
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // responses and keys of finished entries
};

}  // namespace kvmem::service
