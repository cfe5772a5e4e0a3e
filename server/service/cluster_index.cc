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
#include "absl/strings/str_split.h"
#include "server/common/client_text.h"
#include "server/common/mutex.h"
#include "spdlog/spdlog.h"

namespace kvmem::service {
namespace {

// The writer's wait on Redis (off the request path), and the pause after a failure.
constexpr absl::Duration kWriterTimeout = absl::Seconds(2);
constexpr absl::Duration kRetryAfter = absl::Seconds(1);
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
  size_t pending = 0;  // replies owed
  ~Connection() {
    if (ctx != nullptr) redisFree(ctx);
  }
  bool Append(std::initializer_list<absl::string_view> args) {
    const char* argv[8];
    size_t lengths[8];
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
  std::string error() const { return ctx->errstr; }

  static absl::StatusOr<std::unique_ptr<Connection>> Open(const RedisAddress& a,
                                                          absl::Duration timeout) {
    const timeval tv = absl::ToTimeval(timeout);
    auto c = std::make_unique<Connection>();
    c->ctx = a.unix_path.empty() ? redisConnectWithTimeout(a.host.c_str(), a.port, tv)
                                 : redisConnectUnixWithTimeout(a.unix_path.c_str(), tv);
    if (c->ctx == nullptr) return absl::ResourceExhaustedError("no memory for a connection");
    if (c->ctx->err != 0) return absl::UnavailableError(absl::StrCat("connect: ", c->error()));
    if (redisSetTimeout(c->ctx, tv) != REDIS_OK) {
      return absl::UnavailableError(absl::StrCat("timeout: ", c->error()));
    }
    const auto expect_ok = [&](absl::string_view what) -> absl::Status {
      Reply r = c->Next();
      if (r == nullptr) return absl::UnavailableError(absl::StrCat(what, ": ", c->error()));
      if (r->type == REDIS_REPLY_ERROR) {
        return absl::PermissionDeniedError(absl::StrCat(what, ": ", std::string(r->str, r->len)));
      }
      return absl::OkStatus();
    };
    if (!a.password.empty()) {
      c->Append({"AUTH", a.password});
      if (absl::Status s = expect_ok("AUTH"); !s.ok()) return s;
    }
    if (a.db != 0) {
      const std::string db = absl::StrCat(a.db);
      c->Append({"SELECT", db});
      if (absl::Status s = expect_ok("SELECT"); !s.ok()) return s;
    }
    // A server that wants a password refuses every command: found here, not as empty
    // answers later.
    c->Append({"PING"});
    if (absl::Status s = expect_ok("PING"); !s.ok()) return s;
    return c;
  }
};

struct ClusterIndex::LookupSlot {
  absl::Mutex mu;
  std::unique_ptr<Connection> connection ABSL_GUARDED_BY(mu);
};

std::string ClusterIndex::Key(absl::string_view key_prefix, absl::string_view ns,
                              const prefix::BlockHash& hash) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(ns.data(), ns.size(), digest, &length, EVP_sha256(), nullptr);
  return absl::StrCat(key_prefix, ":",
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest), 8)),
                      ":", prefix::ToHex(hash));
}

absl::StatusOr<std::unique_ptr<ClusterIndex>> ClusterIndex::Start(ClusterIndexConfig config) {
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
  if (config.ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError("cluster_index_ttl_seconds: at least 1");
  }
  if (config.timeout <= absl::ZeroDuration() || config.timeout > absl::Seconds(10)) {
    return absl::InvalidArgumentError("cluster_index_timeout_ms: in [1, 10000]");
  }
  if (config.lookup_connections == 0 || config.lookup_connections > 64) {
    return absl::InvalidArgumentError("cluster_index_connections: in [1, 64]");
  }
  std::unique_ptr<ClusterIndex> index(new ClusterIndex(std::move(config), *std::move(address)));
  index->thread_ = std::thread([i = index.get()] { i->Run(); });
  return index;
}

ClusterIndex::ClusterIndex(ClusterIndexConfig config, RedisAddress address)
    : config_(std::move(config)),
      address_(std::move(address)),
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
  queue_.clear();
  lost_ = true;
}

void ClusterIndex::Note(bool add, absl::string_view ns, const prefix::BlockHash& hash) noexcept {
  std::string key;
  try {
    key = Key(config_.key_prefix, ns, hash);
  } catch (const std::bad_alloc&) {
    // A claim missing from the mirror: forget them all rather than keep some.
    kvmem::MutexLock lock(&mu_);
    LoseLocked(1);
    wake_.Signal();
    return;
  }
  kvmem::MutexLock lock(&mu_);
  wake_.Signal();
  if (queue_.size() >= config_.max_queued_events) {
    LoseLocked(1);
    return;
  }
  try {
    queue_.push_back({add, std::move(key)});
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
  spdlog::warn("cluster index: {}{}", std::string(what),
               connection != nullptr && connection->ctx->err != 0 ? ": " + connection->error()
                                                                  : std::string());
  connection.reset();
}

bool ClusterIndex::Connected(absl::Time now) {
  if (writer_ != nullptr) return true;
  if (now < retry_at_) return false;
  absl::StatusOr<std::unique_ptr<Connection>> c = Connection::Open(address_, kWriterTimeout);
  if (!c.ok()) {
    const bool first = retry_at_ == absl::InfinitePast();
    retry_at_ = now + kRetryAfter;
    errors_.fetch_add(1, std::memory_order_relaxed);
    if (connected_.exchange(false) || first) {
      spdlog::warn("cluster index: {} (updates are dropped until it is back)",
                   std::string(c.status().message()));
    }
    return false;
  }
  writer_ = *std::move(c);
  connected_ = true;
  renew_at_ = now;  // whatever Redis lost while away (or after a restart) comes back
  spdlog::info("cluster index: connected to {}",  // never the password
               address_.unix_path.empty() ? absl::StrCat(address_.host, ":", address_.port)
                                          : address_.unix_path);
  return true;
}

bool ClusterIndex::Write(absl::Span<const Op> ops, uint64_t* added, uint64_t* removed) {
  const absl::Time start = absl::Now();
  const std::string expiry =
      absl::StrCat(absl::ToUnixMillis(start) + absl::ToInt64Milliseconds(config_.ttl));
  const std::string ttl = absl::StrCat(absl::ToInt64Milliseconds(config_.ttl));
  for (size_t begin = 0; begin < ops.size(); begin += kPipelineCommands / 2) {
    const size_t end = std::min(ops.size(), begin + kPipelineCommands / 2);
    for (size_t i = begin; i < end; ++i) {
      const Op& op = ops[i];
      const bool appended = op.add ? writer_->Append({"ZADD", op.key, expiry, config_.node}) &&
                                         writer_->Append({"PEXPIRE", op.key, ttl})
                                   : writer_->Append({"ZREM", op.key, config_.node});
      if (!appended) {
        Fail(writer_, "an update");
        return false;
      }
    }
    while (writer_->pending > 0) {
      Reply r = writer_->Next();
      if (r == nullptr || r->type == REDIS_REPLY_ERROR) {
        Fail(writer_, r == nullptr ? "an update" : std::string(r->str, r->len));
        return false;
      }
    }
    for (size_t i = begin; i < end; ++i) ++*(ops[i].add ? added : removed);
  }
  write_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return true;
}

bool ClusterIndex::Renew() {
  const absl::Time start = absl::Now();
  const int64_t now_ms = absl::ToUnixMillis(start);
  const std::string expiry = absl::StrCat(now_ms + absl::ToInt64Milliseconds(config_.ttl));
  const std::string ttl = absl::StrCat(absl::ToInt64Milliseconds(config_.ttl));
  const std::string lapsed = absl::StrCat("(", now_ms);
  size_t in_flight = 0;
  const auto drain = [&]() {
    while (writer_->pending > 0) {
      Reply r = writer_->Next();
      if (r == nullptr || r->type == REDIS_REPLY_ERROR) return false;
    }
    renewed_.fetch_add(in_flight, std::memory_order_relaxed);
    in_flight = 0;
    return true;
  };
  for (const std::string& key : mirror_) {
    // Lapsed claims (of nodes gone) trimmed, this node's renewed, the key kept while claimed.
    if (!writer_->Append({"ZREMRANGEBYSCORE", key, "-inf", lapsed}) ||
        !writer_->Append({"ZADD", key, expiry, config_.node}) ||
        !writer_->Append({"PEXPIRE", key, ttl})) {
      Fail(writer_, "a renewal");
      return false;
    }
    if (++in_flight * 3 >= kPipelineCommands && !drain()) {
      Fail(writer_, "a renewal");
      return false;
    }
  }
  if (!drain()) {
    Fail(writer_, "a renewal");
    return false;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  write_seconds_.Observe(seconds);
  last_renewal_seconds_.store(seconds, std::memory_order_relaxed);
  return true;
}

void ClusterIndex::Run() {
  std::vector<Op> ops, kept;
  for (;;) {
    bool lost = false, stop = false;
    {
      kvmem::MutexLock lock(&mu_);
      const absl::Time due = writer_ != nullptr ? renew_at_ : retry_at_;
      while (!stop_ && !lost_ && queue_.empty() && absl::Now() < due) {
        kvmem::TsanRelease(&mu_);
        wake_.WaitWithDeadline(&mu_, due);
        kvmem::TsanAcquire(&mu_);
      }
      ops.swap(queue_);
      lost = std::exchange(lost_, false);
      stop = stop_;
    }
    const absl::Time now = absl::Now();
    kept.clear();
    if (lost) {
      // What Redis holds of this node may be wrong now: withdraw it all and start over.
      for (const std::string& key : mirror_) kept.push_back({false, key});
      mirror_.clear();
    }
    // The mirror first: it follows the prefix index whatever Redis does.
    for (Op& op : ops) {
      if (op.add) {
        if (mirror_.size() >= config_.max_entries) {
          dropped_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        if (!mirror_.insert(op.key).second) continue;
      } else if (mirror_.erase(op.key) == 0) {
        continue;
      }
      kept.push_back(std::move(op));
    }
    ops.clear();
    entries_.store(mirror_.size(), std::memory_order_relaxed);
    if (stop) {
      // Withdraw this node's claims if Redis is there now; never wait to reconnect.
      if (writer_ != nullptr) {
        for (const std::string& key : mirror_) kept.push_back({false, key});
        uint64_t added = 0, removed = 0;
        if (Write(kept, &added, &removed)) removed_.fetch_add(removed, std::memory_order_relaxed);
      }
      return;
    }
    if (!kept.empty()) {
      uint64_t added = 0, removed = 0;
      const bool written = Connected(now) && Write(kept, &added, &removed);
      added_.fetch_add(added, std::memory_order_relaxed);
      removed_.fetch_add(removed, std::memory_order_relaxed);
      if (!written) {
        dropped_.fetch_add(kept.size() - added - removed, std::memory_order_relaxed);
        retry_at_ = std::max(retry_at_, now);
      }
    }
    if (Connected(absl::Now()) && absl::Now() >= renew_at_) {
      if (Renew()) {
        renew_at_ = absl::Now() + config_.ttl / 3;
      } else {
        retry_at_ = absl::Now() + kRetryAfter;
        connected_ = false;
      }
    }
    if (writer_ == nullptr) connected_ = false;
  }
}

FleetAnswer ClusterIndex::Lookup(absl::string_view ns, absl::Span<const prefix::BlockHash> chain) {
  const absl::Time start = absl::Now();
  lookups_.fetch_add(1, std::memory_order_relaxed);
  FleetAnswer answer;
  const auto unavailable = [&](std::string why) {
    lookups_unavailable_.fetch_add(1, std::memory_order_relaxed);
    lookup_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    answer.available = false;
    answer.unavailable = std::move(why);
    answer.holders.clear();
    return answer;
  };
  chain = chain.first(std::min(chain.size(), kMaxLookupBlocks));
  if (chain.empty()) {
    answer.available = true;
    return answer;
  }
  if (absl::ToUnixNanos(start) < lookup_retry_at_ns_.load(std::memory_order_relaxed)) {
    return unavailable("the cluster index was unreachable less than a second ago");
  }
  LookupSlot* slot = nullptr;
  for (const std::unique_ptr<LookupSlot>& s : slots_) {
    if (s->mu.TryLock()) {
      kvmem::TsanAcquire(&s->mu);
      slot = s.get();
      break;
    }
  }
  if (slot == nullptr) {
    return unavailable(absl::StrCat("all ", slots_.size(),
                                    " connections to the cluster index are busy "
                                    "(--cluster-index-connections)"));
  }
  absl::Cleanup unlock = [slot]() ABSL_NO_THREAD_SAFETY_ANALYSIS { kvmem::Unlock(&slot->mu); };
  std::unique_ptr<Connection>& c = slot->connection;
  const auto failed = [&](absl::string_view what) {
    std::string why = absl::StrCat("the cluster index did not answer: ", what,
                                   c != nullptr && c->ctx->err != 0 ? ": " + c->error() : "");
    errors_.fetch_add(1, std::memory_order_relaxed);
    c.reset();
    lookup_retry_at_ns_.store(absl::ToUnixNanos(absl::Now() + kRetryAfter),
                              std::memory_order_relaxed);
    return unavailable(std::move(why));
  };
  if (c == nullptr) {
    absl::StatusOr<std::unique_ptr<Connection>> opened =
        Connection::Open(address_, config_.timeout);
    if (!opened.ok()) return failed(opened.status().message());
    c = *std::move(opened);
  }
  const std::string now_ms = absl::StrCat(absl::ToUnixMillis(start));
  const std::string most = absl::StrCat(kMaxHolders);
  // Who holds block 0, then who of them holds block 1 too, and so on; asked in rounds of
  // 8, 16, 32... blocks, so that a long prompt the fleet holds little of costs a few rounds,
  // not a command per block.
  absl::flat_hash_map<std::string, uint64_t> held;
  std::vector<std::string> running;  // the nodes that hold every block so far
  absl::flat_hash_set<absl::string_view> members;
  for (size_t begin = 0, round = 8; begin < chain.size() && (begin == 0 || !running.empty());
       begin += round, round *= 2) {
    const size_t end = std::min(chain.size(), begin + round);
    for (size_t i = begin; i < end; ++i) {
      const std::string key = Key(config_.key_prefix, ns, chain[i]);
      if (!c->Append({"ZRANGEBYSCORE", key, now_ms, "+inf", "LIMIT", "0", most})) {
        return failed("a query");
      }
    }
    for (size_t i = begin; i < end; ++i) {
      Reply r = c->Next();
      if (r == nullptr) return failed("a reply");
      if (r->type != REDIS_REPLY_ARRAY) {
        // An error (a key of another type under ours, a server gone read-only...): no
        // answer rather than a wrong "nobody".
        return failed(r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len)
                                                   : std::string("a reply that is not a list"));
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
    if (absl::Now() - start > config_.timeout) return failed("past --cluster-index-timeout-ms");
  }
  for (auto& [node, blocks] : held) answer.holders.push_back({node, blocks});
  std::sort(answer.holders.begin(), answer.holders.end(),
            [](const FleetHolder& a, const FleetHolder& b) {
              return a.blocks != b.blocks ? a.blocks > b.blocks : a.node < b.node;
            });
  answer.available = true;
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
  c.lookups = lookups_.load(std::memory_order_relaxed);
  c.lookups_unavailable = lookups_unavailable_.load(std::memory_order_relaxed);
  c.entries = entries_.load(std::memory_order_relaxed);
  c.connected = connected_.load(std::memory_order_relaxed);
  c.last_renewal_seconds = last_renewal_seconds_.load(std::memory_order_relaxed);
  c.write_seconds = write_seconds_.Read();
  c.lookup_seconds = lookup_seconds_.Read();
  return c;
}

}  // namespace kvmem::service
