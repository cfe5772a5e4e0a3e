#include "server/service/request_cache.h"

#include <algorithm>
#include <string>

#include "absl/hash/hash.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace kvmem::service {
namespace {

// A ZeroCopyOutputStream that keeps no bytes: it hands the serializer one fixed buffer and
// folds each filled stretch of it into a running hash, and takes large fields (K/V, rows)
// aliased, hashed where they lie, so that a request of any size is hashed whole without a
// copy of its serialization.
class HashingStream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  bool AllowsAliasing() const override { return true; }
  bool WriteAliasedRaw(const void* data, int size) override {
    Fold();
    hash_ = absl::HashOf(hash_, absl::string_view(static_cast<const char*>(data), size));
    folded_ += size;
    return true;
  }
  bool Next(void** data, int* size) override {
    Fold();
    *data = buffer_;
    *size = sizeof(buffer_);
    filled_ = sizeof(buffer_);
    return true;
  }
  void BackUp(int count) override { filled_ -= count; }
  int64_t ByteCount() const override { return folded_ + filled_; }

  uint64_t Finish() {
    Fold();
    return absl::HashOf(hash_, folded_);
  }

 private:
  void Fold() {
    if (filled_ == 0) return;
    hash_ = absl::HashOf(hash_, absl::string_view(buffer_, filled_));
    folded_ += filled_;
    filled_ = 0;
  }

  char buffer_[16 << 10];
  int filled_ = 0;
  int64_t folded_ = 0;
  uint64_t hash_ = 0;
};

}  // namespace

uint64_t RequestFingerprint(const google::protobuf::Message& request) {
  HashingStream stream;
  {
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    coded.EnableAliasing(true);
    request.SerializePartialToCodedStream(&coded);
  }
  return absl::HashOf(request.GetDescriptor()->full_name(), stream.Finish());
}

uint64_t RequestCache::StreamFingerprint(uint64_t so_far, const google::protobuf::Message& next) {
  return absl::HashOf(so_far, RequestFingerprint(next));
}

absl::Status RequestCache::CheckId(absl::string_view request_id) {
  if (request_id.size() <= kMaxRequestIdBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("request_id: ", request_id.size(),
                                                 " bytes, over the limit of ", kMaxRequestIdBytes));
}

absl::Status RequestCache::ReusedIdError() {
  return absl::InvalidArgumentError(
      "request_id: already used for a different request (a retry must resend the same "
      "request; a new request needs a new id)");
}

// A finished call's answer copied into `response` (*entry stays null: replayed).
absl::Status RequestCache::Replay(const Entry& done, google::protobuf::Message* response,
                                  uint64_t* stream_fingerprint) {
  if (!response->ParseFromString(done.response)) {
    return absl::InternalError("request_id: the stored response does not parse");
  }
  if (stream_fingerprint != nullptr) *stream_fingerprint = done.stream_fingerprint;
  return absl::OkStatus();
}

absl::Status RequestCache::Claim(const std::string& key, uint64_t fingerprint,
                                 google::protobuf::Message* response, std::shared_ptr<Entry>* entry,
                                 uint64_t* stream_fingerprint) {
  kvmem::MutexLock lock(&mu_);
  EvictLocked();
  for (;;) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      *entry = std::make_shared<Entry>();
      (*entry)->fingerprint = fingerprint;
      entries_.emplace(key, *entry);
      return absl::OkStatus();
    }
    std::shared_ptr<Entry> found = it->second;
    if (found->fingerprint != fingerprint && !(found->done && !found->ok)) {
      return ReusedIdError();
    }
    if (found->done) {
      if (!found->ok) {  // failed calls are not kept: Finish removed it; run again
        entries_.erase(it);
        continue;
      }
      return Replay(*found, response, stream_fingerprint);
    }
    // The first call with this id is still running: wait for it, for a while.
    TsanRelease(&mu_);
    ++waiting_;
    const bool done = mu_.AwaitWithTimeout(absl::Condition(
                                               +[](Entry* e) { return e->done; }, found.get()),
                                           kMaxWait);
    TsanAcquire(&mu_);
    --waiting_;
    if (!done) {
      return absl::AbortedError(
          "request_id: the first call with this id is still running; retry later");
    }
    // The first call's own entry answers, even if the cache let it go meanwhile (a small
    // cache, a large response): looking the key up again would run the call twice.
    if (found->ok) return Replay(*found, response, stream_fingerprint);
  }
}

void RequestCache::Finish(const std::string& key, const std::shared_ptr<Entry>& entry,
                          const absl::Status& status, const google::protobuf::Message& response,
                          uint64_t stream_fingerprint) {
  std::string bytes;
  if (status.ok()) response.SerializeToString(&bytes);
  kvmem::MutexLock lock(&mu_);
  entry->ok = status.ok();
  entry->stream_fingerprint = stream_fingerprint;
  entry->response = std::move(bytes);
  entry->stored = clock_->Now();
  entry->done = true;  // wakes the waiters
  if (!entry->ok) {
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second == entry) entries_.erase(it);
    return;
  }
  order_.push_back(key);
  bytes_ += key.size() + entry->response.size();
  EvictLocked();
}

void RequestCache::EvictLocked() {
  const absl::Time now = clock_->Now();
  while (!order_.empty()) {
    auto it = entries_.find(order_.front());
    const bool stale = it == entries_.end() || !it->second->done ||
                       now - it->second->stored > ttl_ || order_.size() > max_entries_ ||
                       bytes_ > max_bytes_;
    if (!stale) break;
    if (it != entries_.end() && it->second->done) {
      bytes_ -= std::min<uint64_t>(bytes_, it->first.size() + it->second->response.size());
      entries_.erase(it);
    }
    order_.pop_front();
  }
}

uint64_t RequestCache::bytes() const {
  kvmem::MutexLock lock(&mu_);
  return bytes_;
}

size_t RequestCache::waiting() const {
  kvmem::MutexLock lock(&mu_);
  return waiting_;
}

size_t RequestCache::size() const {
  kvmem::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace kvmem::service
