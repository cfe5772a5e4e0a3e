#include "server/service/request_cache.h"

#include <algorithm>

namespace kvmem::service {

absl::Status RequestCache::Claim(const std::string& key, google::protobuf::Message* response,
                                 std::shared_ptr<Entry>* entry) {
  kvmem::MutexLock lock(&mu_);
  EvictLocked();
  for (;;) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      *entry = std::make_shared<Entry>();
      entries_.emplace(key, *entry);
      return absl::OkStatus();
    }
    std::shared_ptr<Entry> found = it->second;
    if (found->done) {
      if (!found->ok) {  // failed calls are not kept: Finish removed it; run again
        entries_.erase(it);
        continue;
      }
      if (!response->ParseFromString(found->response)) {
        return absl::InternalError("request_id: the stored response does not parse");
      }
      return absl::OkStatus();  // replayed; *entry stays null
    }
    // The first call with this id is still running: wait for it, for a while.
    TsanRelease(&mu_);
    const bool done = mu_.AwaitWithTimeout(absl::Condition(
                                               +[](Entry* e) { return e->done; }, found.get()),
                                           kMaxWait);
    TsanAcquire(&mu_);
    if (!done) {
      return absl::AbortedError(
          "request_id: the first call with this id is still running; retry later");
    }
  }
}

void RequestCache::Finish(const std::string& key, const std::shared_ptr<Entry>& entry,
                          const absl::Status& status, const google::protobuf::Message& response) {
  std::string bytes;
  if (status.ok()) response.SerializeToString(&bytes);
  kvmem::MutexLock lock(&mu_);
  entry->ok = status.ok();
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

size_t RequestCache::size() const {
  kvmem::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace kvmem::service
