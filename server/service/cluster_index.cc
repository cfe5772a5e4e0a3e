#include "server/service/cluster_index.h"

#include <hiredis/hiredis.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/common/client_text.h"
#include "server/common/mutex.h"
#include "spdlog/spdlog.h"

namespace kvmem::service {
namespace {

// The writer's wait on Redis (off the request path), and the pause after a failure.
constexpr absl::Duration kWriterTimeout = absl::Seconds(2);
constexpr std::chrono::seconds kRetryAfter{1};
// Commands pipelined before their replies are read.
constexpr size_t kPipelineCommands = 1024;

struct FreeReply {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, FreeReply>;

absl::StatusOr<int> ParseNumber(absl::string_view text, absl::string_view what, int most) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0 || value > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster_index: ", what, " \"", EchoClientText(text), "\" is not in [0, ", most, "]"));
  }
  return value;
}

}  // namespace

absl::StatusOr<RedisAddress> ParseRedisUrl(absl::string_view url) {
  RedisAddress a;
  if (absl::ConsumePrefix(&url, "unix://")) {
    absl::string_view path = url;
    if (const size_t q = url.find('?'); q != absl::string_view::npos) {
      path = url.substr(0, q);
      absl::string_view query = url.substr(q + 1);
      if (!absl::ConsumePrefix(&query, "db=")) {
        return absl::InvalidArgumentError(
            absl::StrCat("cluster_index: \"", EchoClientText(url),
                         "\": a unix socket takes no option but ?db=N"));
      }
      absl::StatusOr<int> db = ParseNumber(query, "db", 1 << 20);
      if (!db.ok()) return db.status();
      a.db = *db;
    }
    if (path.empty() || path[0] != '/') {
      return absl::InvalidArgumentError("cluster_index: unix:// needs an absolute socket path");
    }
    a.unix_path = std::string(path);
    return a;
  }
  if (!absl::ConsumePrefix(&url, "redis://")) {
    // Only the scheme is echoed: the rest may hold a password.
    const size_t scheme = url.find("://");
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster_index: \"",
        EchoClientText(scheme == absl::string_view::npos ? "(no scheme)" : url.substr(0, scheme)),
        "\" is neither redis://[:password@]host[:port][/db] nor unix:///path"));
  }
  if (const size_t at = url.rfind('@'); at != absl::string_view::npos) {
    absl::string_view credentials = url.substr(0, at);
    url = url.substr(at + 1);
    // [user]:password; Redis 5-style AUTH takes the password only.
    const size_t colon = credentials.find(':');
    a.password =
        std::string(colon == absl::string_view::npos ? credentials : credentials.substr(colon + 1));
  }
  if (const size_t slash = url.find('/'); slash != absl::string_view::npos) {
    absl::StatusOr<int> db = ParseNumber(url.substr(slash + 1), "db", 1 << 20);
    if (!db.ok()) return db.status();
    a.db = *db;
    url = url.substr(0, slash);
  }
  absl::string_view host = url, port;
  if (absl::StartsWith(url, "[")) {  // [ipv6]:port
    const size_t close = url.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError("cluster_index: an IPv6 host without its ']'");
    }
    host = url.substr(1, close - 1);
    absl::string_view rest = url.substr(close + 1);
    if (absl::ConsumePrefix(&rest, ":")) port = rest;
  } else if (const size_t colon = url.rfind(':'); colon != absl::string_view::npos) {
    host = url.substr(0, colon);
    port = url.substr(colon + 1);
  }
  if (host.empty()) return absl::InvalidArgumentError("cluster_index: no host");
  a.host = std::string(host);
  if (!port.empty()) {
    absl::StatusOr<int> p = ParseNumber(port, "port", 65535);
    if (!p.ok()) return p.status();
    a.port = *p;
  }
  return a;
}

// One Redis connection: commands appended, then their replies read in order.
struct ClusterIndex::Connection {
  redisContext* ctx = nullptr;
  size_t pending = 0;     // replies owed
  int64_t offset_ms = 0;  // Redis's clock minus this host's, read at the connection
  ~Connection() {
    if (ctx != nullptr) redisFree(ctx);
  }
  bool Append(std::initializer_list<absl::string_view> args) {
    constexpr size_t kMostArgs = 8;
    const char* argv[kMostArgs];
    size_t lengths[kMostArgs];
    if (args.size() > kMostArgs) return false;
    int n = 0;
    for (absl::string_view a : args) {
      argv[n] = a.data();
      lengths[n++] = a.size();
    }
    if (redisAppendCommandArgv(ctx, n, argv, lengths) != REDIS_OK) return false;
    ++pending;
    return true;
  }
  // The next reply; null when the connection failed (it is then unusable).
  Reply Next() {
    void* r = nullptr;
    if (redisGetReply(ctx, &r) != REDIS_OK || r == nullptr) return nullptr;
    --pending;
    return Reply(static_cast<redisReply*>(r));
  }
  bool broken() const { return ctx->err != 0; }
  std::string error() const { return broken() ? absl::StrCat(": ", ctx->errstr) : ""; }
  bool SetTimeout(absl::Duration timeout) {
    return redisSetTimeout(ctx, absl::ToTimeval(timeout)) == REDIS_OK;
  }
  // Redis's clock, now, in ms (this host's clock plus the offset).
  int64_t NowMs() const { return absl::ToUnixMillis(absl::Now()) + offset_ms; }

  static absl::StatusOr<std::unique_ptr<Connection>> Open(const RedisAddress& a,
                                                          absl::Duration timeout) {
    const timeval tv = absl::ToTimeval(timeout);
    auto c = std::make_unique<Connection>();
    c->ctx = a.unix_path.empty() ? redisConnectWithTimeout(a.host.c_str(), a.port, tv)
                                 : redisConnectUnixWithTimeout(a.unix_path.c_str(), tv);
    if (c->ctx == nullptr) return absl::ResourceExhaustedError("no memory for a connection");
    if (c->broken()) return absl::UnavailableError(absl::StrCat("connect", c->error()));
    if (!c->SetTimeout(timeout)) return absl::UnavailableError(absl::StrCat("timeout", c->error()));
    const auto expect = [&](absl::string_view what, int type) -> absl::StatusOr<Reply> {
      Reply r = c->Next();
      if (r == nullptr) return absl::UnavailableError(absl::StrCat(what, c->error()));
      if (r->type == REDIS_REPLY_ERROR) {
        return absl::PermissionDeniedError(absl::StrCat(what, ": ", std::string(r->str, r->len)));
      }
      if (r->type != type) return absl::UnavailableError(absl::StrCat(what, ": an odd reply"));
      return r;
    };
    if (!a.password.empty()) {
      c->Append({"AUTH", a.password});
      if (absl::StatusOr<Reply> r = expect("AUTH", REDIS_REPLY_STATUS); !r.ok()) return r.status();
    }
    if (a.db != 0) {
      const std::string db = absl::StrCat(a.db);
      c->Append({"SELECT", db});
      if (absl::StatusOr<Reply> r = expect("SELECT", REDIS_REPLY_STATUS); !r.ok()) {
        return r.status();
      }
    }
    // A server that wants a password refuses every command: found here, not as empty
    // answers later. TIME gives Redis's clock, which every node's scores then follow.
    c->Append({"TIME"});
    const int64_t asked = absl::ToUnixMicros(absl::Now());
    absl::StatusOr<Reply> time = expect("TIME", REDIS_REPLY_ARRAY);
    if (!time.ok()) return time.status();
    const int64_t answered = absl::ToUnixMicros(absl::Now());
    int64_t seconds = 0, micros = 0;
    const redisReply* t = time->get();
    if (t->elements != 2 || t->element[0]->type != REDIS_REPLY_STRING ||
        !absl::SimpleAtoi(absl::string_view(t->element[0]->str, t->element[0]->len), &seconds) ||
        !absl::SimpleAtoi(absl::string_view(t->element[1]->str, t->element[1]->len), &micros)) {
      return absl::UnavailableError("TIME: an odd reply");
    }
    c->offset_ms = (seconds * 1000000 + micros - (asked + answered) / 2) / 1000;
    return c;
  }
};

struct ClusterIndex::LookupSlot {
  absl::Mutex mu;
  std::unique_ptr<Connection> connection ABSL_GUARDED_BY(mu);
};

bool ClusterIndex::TagOf(absl::string_view ns, Tag* tag) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(ns.data(), ns.size(), digest, &length, EVP_sha256(), nullptr) != 1 ||
      length < tag->size()) {
    return false;
  }
  std::copy(digest, digest + tag->size(), tag->begin());
  return true;
}

std::string ClusterIndex::Key(absl::string_view key_prefix, absl::string_view ns,
                              const prefix::BlockHash& hash) {
  Tag tag{};
  TagOf(ns, &tag);
  return absl::StrCat(
      key_prefix, ":",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(tag.data()), 8)), ":",
      prefix::ToHex(hash));
}

std::string ClusterIndex::KeyOf(const Claim& claim) const {
  return absl::StrCat(config_.key_prefix, ":",
                      absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(claim.tag.data()), claim.tag.size())),
                      ":", prefix::ToHex(claim.hash));
}

absl::StatusOr<std::unique_ptr<ClusterIndex>> ClusterIndex::Start(ClusterIndexConfig config,
                                                                  Snapshot snapshot) {
  absl::StatusOr<RedisAddress> address = ParseRedisUrl(config.url);
  if (!address.ok()) return address.status();
  if (const char* password = std::getenv("KVMEM_CLUSTER_INDEX_PASSWORD");
      address->password.empty() && password != nullptr) {
    address->password = password;  // kept out of the command line (ps shows flags)
  }
  if (config.node.empty() || config.node.size() > 256 ||
      std::any_of(config.node.begin(), config.node.end(),
                  [](char c) { return c <= ' ' || c > '~'; })) {
    return absl::InvalidArgumentError(
        "cluster_node_address: required with --cluster-index: the address routers and peers "
        "reach this kvmemd at (host:port), 1 to 256 printable characters without spaces");
  }
  if (config.ttl < absl::Seconds(1) || config.ttl > absl::Hours(24)) {
    return absl::InvalidArgumentError("cluster_index_ttl_seconds: in [1, 86400]");
  }
  if (config.timeout <= absl::ZeroDuration() || config.timeout > absl::Seconds(10)) {
    return absl::InvalidArgumentError("cluster_index_timeout_ms: in [1, 10000]");
  }
  if (config.lookup_connections == 0 || config.lookup_connections > 64) {
    return absl::InvalidArgumentError("cluster_index_connections: in [1, 64]");
  }
  std::unique_ptr<ClusterIndex> index(
      new ClusterIndex(std::move(config), *std::move(address), std::move(snapshot)));
  index->thread_ = std::thread([i = index.get()] { i->Run(); });
  return index;
}

ClusterIndex::ClusterIndex(ClusterIndexConfig config, RedisAddress address, Snapshot snapshot)
    : config_(std::move(config)),
      address_(std::move(address)),
      snapshot_(std::move(snapshot)),
      write_seconds_(engine::LatencyBounds()),
      lookup_seconds_(engine::LatencyBounds()) {
  for (size_t i = 0; i < config_.lookup_connections; ++i) {
    slots_.push_back(std::make_unique<LookupSlot>());
  }
}

ClusterIndex::~ClusterIndex() {
  {
    kvmem::MutexLock lock(&mu_);
    stop_ = true;
    wake_.Signal();
  }
  thread_.join();
}

void ClusterIndex::LoseLocked(size_t events) {
  dropped_.fetch_add(queue_.size() + events, std::memory_order_relaxed);
  queue_.clear();  // records of plain bytes: nothing to free one by one
  lost_ = true;
}

void ClusterIndex::Note(bool add, absl::string_view ns, const prefix::BlockHash& hash) noexcept {
  kvmem::MutexLock lock(&mu_);
  wake_.Signal();
  Op op{add, {{}, hash}};
  if (auto t = tags_.find(ns); t != tags_.end()) {
    op.claim.tag = t->second;
  } else if (!TagOf(ns, &op.claim.tag)) {
    LoseLocked(1);
    return;
  } else if (tags_.size() < 4096) {
    try {
      tags_.emplace(std::string(ns), op.claim.tag);
    } catch (const std::bad_alloc&) {
      // Computed again next time.
    }
  }
  if (queue_.size() >= config_.max_queued_events) {
    LoseLocked(1);
    return;
  }
  try {
    queue_.push_back(op);
  } catch (const std::bad_alloc&) {
    LoseLocked(1);
  }
}

void ClusterIndex::Stored(const prefix::StoredBlock& block) noexcept {
  Note(true, block.ns, *block.hash);
}

void ClusterIndex::Removed(absl::string_view ns, const prefix::BlockHash& hash) noexcept {
  Note(false, ns, hash);
}

void ClusterIndex::Fail(std::unique_ptr<Connection>& connection, absl::string_view what) {
  errors_.fetch_add(1, std::memory_order_relaxed);
  std::string error =
      absl::StrCat(what, connection != nullptr ? connection->error() : std::string());
  spdlog::warn("cluster index: {}", error);
  connection.reset();
  kvmem::MutexLock lock(&mu_);
  last_error_ = std::move(error);
}

bool ClusterIndex::Connected(Clock::time_point now) {
  if (writer_ != nullptr) return true;
  if (now < retry_at_) return false;
  const bool first = retry_at_ == Clock::time_point{};
  absl::StatusOr<std::unique_ptr<Connection>> c = Connection::Open(address_, kWriterTimeout);
  if (!c.ok()) {
    retry_at_ = now + kRetryAfter;
    errors_.fetch_add(1, std::memory_order_relaxed);
    if (connected_.exchange(false) || first) {
      spdlog::warn("cluster index: {} (updates are dropped until it is back)",
                   std::string(c.status().message()));
    }
    kvmem::MutexLock lock(&mu_);
    last_error_ = std::string(c.status().message());
    return false;
  }
  writer_ = *std::move(c);
  retry_at_ = now;
  connected_ = true;
  renew_at_ = now;  // whatever Redis lost while away (or after a restart) comes back
  spdlog::info("cluster index: connected to {}",  // never the password
               address_.unix_path.empty() ? absl::StrCat(address_.host, ":", address_.port)
                                          : address_.unix_path);
  return true;
}

void ClusterIndex::OpenLookupConnections() {
  // Until one fails: a Redis that does not answer delays the writer by one attempt a turn.
  for (const std::unique_ptr<LookupSlot>& slot : slots_) {
    if (!slot->mu.TryLock()) continue;  // in use: it has a connection
    kvmem::TsanAcquire(&slot->mu);
    absl::Cleanup unlock = [&slot]() ABSL_NO_THREAD_SAFETY_ANALYSIS { kvmem::Unlock(&slot->mu); };
    if (slot->connection != nullptr) continue;
    absl::StatusOr<std::unique_ptr<Connection>> c = Connection::Open(address_, kWriterTimeout);
    if (!c.ok()) {
      errors_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    slot->connection = *std::move(c);
  }
}

bool ClusterIndex::Rebuild(std::vector<Op>* ops) {
  absl::flat_hash_set<Claim> claims;
  if (snapshot_) {
    try {
      for (const auto& [ns, hashes] : snapshot_()) {
        Claim c;
        if (!TagOf(ns, &c.tag)) continue;
        for (const prefix::BlockHash& hash : hashes) {
          if (claims.size() >= config_.max_entries) break;
          c.hash = hash;
          claims.insert(c);
        }
      }
    } catch (const std::bad_alloc&) {
      return false;  // tried again at the next turn
    }
  }
  for (const Claim& c : mirror_) {
    if (!claims.contains(c)) ops->push_back({false, c});
  }
  for (const Claim& c : claims) {
    if (!mirror_.contains(c)) ops->push_back({true, c});
  }
  mirror_.swap(claims);
  return true;
}

bool ClusterIndex::Write(absl::Span<const Op> ops) {
  const absl::Time start = absl::Now();
  const std::string ttl = absl::StrCat(absl::ToInt64Milliseconds(config_.ttl));
  for (size_t begin = 0; begin < ops.size(); begin += kPipelineCommands / 2) {
    const size_t end = std::min(ops.size(), begin + kPipelineCommands / 2);
    const std::string expiry =
        absl::StrCat(writer_->NowMs() + absl::ToInt64Milliseconds(config_.ttl));
    for (size_t i = begin; i < end; ++i) {
      const Op& op = ops[i];
      const std::string key = KeyOf(op.claim);
      const bool appended = op.add ? writer_->Append({"ZADD", key, expiry, config_.node}) &&
                                         writer_->Append({"PEXPIRE", key, ttl})
                                   : writer_->Append({"ZREM", key, config_.node});
      if (!appended) {
        dropped_.fetch_add(ops.size() - begin, std::memory_order_relaxed);
        Fail(writer_, "an update");
        return false;
      }
    }
    for (size_t i = begin; i < end; ++i) {
      bool ok = true;
      for (int reply = 0; reply < (ops[i].add ? 2 : 1); ++reply) {
        Reply r = writer_->Next();
        if (r == nullptr) {
          dropped_.fetch_add(ops.size() - i, std::memory_order_relaxed);
          Fail(writer_, "an update");
          return false;
        }
        // An error reply (a key of another type where ours goes): this claim only.
        if (r->type == REDIS_REPLY_ERROR) ok = false;
      }
      if (!ok) {
        errors_.fetch_add(1, std::memory_order_relaxed);
        dropped_.fetch_add(1, std::memory_order_relaxed);
      } else {
        (ops[i].add ? added_ : removed_).fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  write_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return true;
}

bool ClusterIndex::Renew() {
  const absl::Time start = absl::Now();
  const std::string ttl = absl::StrCat(absl::ToInt64Milliseconds(config_.ttl));
  std::vector<std::string> keys;
  keys.reserve(kPipelineCommands / 3);
  const auto flush = [&]() {
    // Each chunk's expiry from its own moment: a long renewal does not shorten the last.
    const int64_t now_ms = writer_->NowMs();
    const std::string expiry = absl::StrCat(now_ms + absl::ToInt64Milliseconds(config_.ttl));
    const std::string lapsed = absl::StrCat("(", now_ms);
    for (const std::string& key : keys) {
      // Lapsed claims (of nodes gone) trimmed, this node's renewed, the key kept while claimed.
      if (!writer_->Append({"ZREMRANGEBYSCORE", key, "-inf", lapsed}) ||
          !writer_->Append({"ZADD", key, expiry, config_.node}) ||
          !writer_->Append({"PEXPIRE", key, ttl})) {
        return false;
      }
    }
    while (writer_->pending > 0) {
      Reply r = writer_->Next();
      if (r == nullptr) return false;
      if (r->type == REDIS_REPLY_ERROR) errors_.fetch_add(1, std::memory_order_relaxed);
    }
    renewed_.fetch_add(keys.size(), std::memory_order_relaxed);
    keys.clear();
    return true;
  };
  for (const Claim& claim : mirror_) {
    keys.push_back(KeyOf(claim));
    if (keys.size() * 3 >= kPipelineCommands && !flush()) {
      Fail(writer_, "a renewal");
      return false;
    }
  }
  if (!flush()) {
    Fail(writer_, "a renewal");
    return false;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  write_seconds_.Observe(seconds);
  last_renewal_seconds_.store(seconds, std::memory_order_relaxed);
  if (absl::Seconds(seconds) > config_.ttl / 6) {
    spdlog::warn(
        "cluster index: renewing {} claims took {:.1f} s, more than a sixth of the TTL: "
        "raise --cluster-index-ttl-seconds (claims may lapse)",
        mirror_.size(), seconds);
  }
  return true;
}

void ClusterIndex::Run() {
  std::vector<Op> ops, kept;
  for (;;) {
    bool lost = false, stop = false;
    {
      kvmem::MutexLock lock(&mu_);
      // Connected: the next renewal, and a look at the lookups' connections every
      // retry period; else the next try.
      const Clock::time_point due = writer_ != nullptr
                                        ? std::min(renew_at_, Clock::now() + kRetryAfter)
                                        : std::max(retry_at_, Clock::now());
      while (!stop_ && !lost_ && queue_.empty() && Clock::now() < due) {
        kvmem::TsanRelease(&mu_);
        wake_.WaitWithTimeout(&mu_, absl::FromChrono(due - Clock::now()));
        kvmem::TsanAcquire(&mu_);
      }
      ops.swap(queue_);
      lost = std::exchange(lost_, false);
      stop = stop_;
    }
    kept.clear();
    if (lost || rebuild_) {
      // The queue's events are in the snapshot (taken after them); later ones come again
      // and find their claim there or gone.
      ops.clear();
      rebuild_ = !Rebuild(&kept);
    }
    // The mirror first: it follows the prefix index whatever Redis does.
    for (const Op& op : ops) {
      if (op.add) {
        if (mirror_.size() >= config_.max_entries) {
          dropped_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        if (!mirror_.insert(op.claim).second) continue;
      } else if (mirror_.erase(op.claim) == 0) {
        continue;
      }
      kept.push_back(op);
    }
    ops.clear();
    entries_.store(mirror_.size(), std::memory_order_relaxed);
    if (stop) {
      // Withdraw this node's claims if Redis is there now; never wait to reconnect.
      if (writer_ != nullptr) {
        kept.clear();
        for (const Claim& c : mirror_) kept.push_back({false, c});
        Write(kept);
      }
      return;
    }
    if (!kept.empty()) {
      if (Connected(Clock::now())) {
        Write(kept);  // counts what it could not send
      } else {
        dropped_.fetch_add(kept.size(), std::memory_order_relaxed);
      }
    }
    if (Connected(Clock::now())) {
      OpenLookupConnections();
      if (Clock::now() >= renew_at_) {
        const Clock::time_point began = Clock::now();
        if (Renew()) renew_at_ = began + absl::ToChronoNanoseconds(config_.ttl / 3);
      }
    }
    if (writer_ == nullptr) {
      connected_ = false;
      if (retry_at_ < Clock::now()) retry_at_ = Clock::now() + kRetryAfter;
    }
  }
}

FleetAnswer ClusterIndex::Lookup(absl::string_view ns, absl::Span<const prefix::BlockHash> chain) {
  const absl::Time start = absl::Now();
  FleetAnswer answer;
  const auto unavailable = [&](std::string why) {
    lookups_unavailable_.fetch_add(1, std::memory_order_relaxed);
    lookup_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    FleetAnswer out;
    out.unavailable = std::move(why);
    return out;
  };
  chain = chain.first(std::min(chain.size(), kMaxLookupBlocks));
  if (chain.empty()) {
    lookups_answered_.fetch_add(1, std::memory_order_relaxed);
    answer.available = true;
    return answer;
  }
  LookupSlot* slot = nullptr;
  bool busy = false;
  for (const std::unique_ptr<LookupSlot>& s : slots_) {
    if (!s->mu.TryLock()) {
      busy = true;
      continue;
    }
    kvmem::TsanAcquire(&s->mu);
    if (s->connection != nullptr) {
      slot = s.get();
      break;
    }
    kvmem::Unlock(&s->mu);
  }
  if (slot == nullptr) {
    if (busy) {
      return unavailable(absl::StrCat("the cluster index's connections (", slots_.size(),
                                      ") are busy or not open (--cluster-index-connections)"));
    }
    kvmem::MutexLock lock(&mu_);
    return unavailable(absl::StrCat("the cluster index is not connected",
                                    last_error_.empty() ? "" : " (last error: ", last_error_,
                                    last_error_.empty() ? "" : ")"));
  }
  absl::Cleanup unlock = [slot]() ABSL_NO_THREAD_SAFETY_ANALYSIS { kvmem::Unlock(&slot->mu); };
  std::unique_ptr<Connection>& c = slot->connection;
  const auto failed = [&](absl::string_view what) {
    std::string why = absl::StrCat("the cluster index did not answer: ", what, c->error());
    if (c->broken()) errors_.fetch_add(1, std::memory_order_relaxed);
    c.reset();  // replies may still be owed: the writer opens another
    return unavailable(std::move(why));
  };
  try {
    const std::string now_ms = absl::StrCat(c->NowMs());
    Claim claim;  // the namespace's tag once; each block's hash in turn
    if (!TagOf(ns, &claim.tag)) return failed("the namespace's tag");
    const std::string most = absl::StrCat(kMaxHolders);
    // Who holds block 0, then who of them holds block 1 too, and so on; asked in rounds of
    // 8, 16, 32... blocks, so that a long prompt the fleet holds little of costs a few
    // rounds, not a command per block.
    absl::flat_hash_map<std::string, uint64_t> held;
    std::vector<std::string> running;  // the nodes that hold every block so far
    absl::flat_hash_set<absl::string_view> members;
    for (size_t begin = 0, round = 8; begin < chain.size() && (begin == 0 || !running.empty());
         begin += round, round *= 2) {
      // At least 1 ms: a zero timeval is no timeout at all to hiredis.
      const absl::Duration left = config_.timeout - (absl::Now() - start);
      if (left < absl::Milliseconds(1) || !c->SetTimeout(left)) {
        return failed("past --cluster-index-timeout-ms");
      }
      const size_t end = std::min(chain.size(), begin + round);
      for (size_t i = begin; i < end; ++i) {
        claim.hash = chain[i];
        const std::string key = KeyOf(claim);
        if (!c->Append({"ZRANGEBYSCORE", key, now_ms, "+inf", "LIMIT", "0", most})) {
          return failed("a query");
        }
      }
      for (size_t i = begin; i < end; ++i) {
        Reply r = c->Next();
        if (r == nullptr) return failed("a reply");
        if (r->type != REDIS_REPLY_ARRAY) {
          // An error (a key of another type under ours...): no answer rather than a wrong
          // "nobody". The round's other replies are read, so the connection stays usable.
          const std::string why = r->type == REDIS_REPLY_ERROR
                                      ? CutMessage(absl::string_view(r->str, r->len), 200)
                                      : std::string("a reply that is not a list");
          while (c->pending > 0) {
            if (c->Next() == nullptr) return failed(why);
          }
          return unavailable(absl::StrCat("the cluster index did not answer: ", why));
        }
        if (i == 0) {
          for (size_t m = 0; m < r->elements; ++m) {
            const redisReply* e = r->element[m];
            if (e->type != REDIS_REPLY_STRING) continue;
            running.emplace_back(e->str, e->len);
            held[running.back()] = 1;
          }
          continue;
        }
        if (running.empty()) continue;  // the round's replies are still read
        members.clear();
        for (size_t m = 0; m < r->elements; ++m) {
          const redisReply* e = r->element[m];
          if (e->type == REDIS_REPLY_STRING) members.insert(absl::string_view(e->str, e->len));
        }
        running.erase(std::remove_if(running.begin(), running.end(),
                                     [&](const std::string& n) { return !members.contains(n); }),
                      running.end());
        for (const std::string& n : running) ++held[n];
      }
    }
    for (auto& [node, blocks] : held) answer.holders.push_back({node, blocks});
  } catch (const std::bad_alloc&) {
    return failed("out of host memory for the answer");
  }
  std::sort(answer.holders.begin(), answer.holders.end(),
            [](const FleetHolder& a, const FleetHolder& b) {
              return a.blocks != b.blocks ? a.blocks > b.blocks : a.node < b.node;
            });
  answer.available = true;
  lookups_answered_.fetch_add(1, std::memory_order_relaxed);
  lookup_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return answer;
}

metrics::ClusterIndexTotals ClusterIndex::counters() const {
  metrics::ClusterIndexTotals c;
  c.added = added_.load(std::memory_order_relaxed);
  c.removed = removed_.load(std::memory_order_relaxed);
  c.renewed = renewed_.load(std::memory_order_relaxed);
  c.dropped = dropped_.load(std::memory_order_relaxed);
  c.errors = errors_.load(std::memory_order_relaxed);
  c.lookups_answered = lookups_answered_.load(std::memory_order_relaxed);
  c.lookups_unavailable = lookups_unavailable_.load(std::memory_order_relaxed);
  c.entries = entries_.load(std::memory_order_relaxed);
  c.connected = connected_.load(std::memory_order_relaxed);
  c.last_renewal_seconds = last_renewal_seconds_.load(std::memory_order_relaxed);
  c.write_seconds = write_seconds_.Read();
  c.lookup_seconds = lookup_seconds_.Read();
  return c;
}

}  // namespace kvmem::service
