#include "server/service/kv_events.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "msgpack.hpp"
#include "server/common/mutex.h"
#include "spdlog/spdlog.h"
#include "zmq.hpp"

namespace kvmem::service {

namespace {

// Whether a tcp:// endpoint's host is loopback (what may be bound without
// --kv-events-trusted-network).
bool LoopbackTcp(const std::string& endpoint) {
  const std::string rest = endpoint.substr(6);  // after "tcp://"
  const size_t colon = rest.rfind(':');
  const std::string host = colon == std::string::npos ? rest : rest.substr(0, colon);
  return host == "localhost" || host == "[::1]" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::Status CheckEndpoint(const std::string& endpoint, const char* flag, bool trusted,
                           bool tenants) {
  if (absl::StartsWith(endpoint, "ipc://@")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", endpoint,
                     "\" is an abstract socket, which any local process can reach: give a path"));
  }
  if (tenants && !trusted) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag,
        ": kvmemd serves tenants (--auth-tokens) and events carry every tenant's token ids to "
        "whoever subscribes (ZMQ authenticates nobody): pass --kv-events-trusted-network where "
        "every process that reaches \"",
        endpoint, "\" is trusted"));
  }
  if (absl::StartsWith(endpoint, "ipc://")) return absl::OkStatus();
  if (!absl::StartsWith(endpoint, "tcp://")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", endpoint, "\" is neither tcp://host:port nor ipc://path"));
  }
  if (!trusted && !LoopbackTcp(endpoint)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": \"", endpoint,
        "\" is reachable beyond this host; events carry every tenant's token ids and ZMQ "
        "authenticates no subscriber: bind to loopback or an ipc:// path, or pass "
        "--kv-events-trusted-network where every peer that reaches it is trusted"));
  }
  return absl::OkStatus();
}

// An ipc:// socket's file: readable and writable by kvmemd's user only.
absl::Status OwnerOnly(const std::string& bound, const char* flag) {
  if (!absl::StartsWith(bound, "ipc://")) return absl::OkStatus();
  const std::string path = bound.substr(6);
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::InternalError(
        absl::StrCat(flag, ": chmod 0600 \"", path, "\": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// The u64 in 8 big-endian bytes at `bytes`.
uint64_t LoadBigEndian64(const uint8_t* bytes) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | bytes[i];
  return v;
}

std::string BigEndian64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[static_cast<size_t>(i)] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
  return out;
}

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackString(Packer& pk, const std::string& s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackHash(Packer& pk, const prefix::BlockHash& hash, bool as_int) {
  if (as_int) {  // vLLM: int.from_bytes(digest, "big") & (2**64 - 1)
    pk.pack_uint64(LoadBigEndian64(hash.data() + hash.size() - 8));
    return;
  }
  pk.pack_bin(static_cast<uint32_t>(hash.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(hash.data()), static_cast<uint32_t>(hash.size()));
}

// One event, as an array (its tag first) or a map (its tag under "type").
void PackEvent(Packer& pk, const KvEventPublisher::Event& e, bool map_form, bool int_hashes,
               const std::string& medium) {
  using Kind = KvEventPublisher::Event::Kind;
  // Field names and values in the struct's order (vLLM's BlockStored, BlockRemoved).
  auto field = [&](const char* name) {
    if (map_form) PackString(pk, name);
  };
  // The event's fields, its tag counted, and the tag.
  auto begin = [&](uint32_t fields, const char* tag) {
    if (map_form) {
      pk.pack_map(fields);
    } else {
      pk.pack_array(fields);
    }
    field("type");
    PackString(pk, tag);
  };
  switch (e.kind) {
    case Kind::kCleared:
      begin(1, "AllBlocksCleared");
      return;
    case Kind::kRemoved:
      begin(3, "BlockRemoved");
      field("block_hashes");
      pk.pack_array(1);
      PackHash(pk, e.hash, int_hashes);
      field("medium");
      PackString(pk, medium);
      return;
    case Kind::kStored: {
      // extra_keys (one entry per hash) only when the hash covered any: vLLM omits it
      // (its default) otherwise.
      begin(e.salt ? 9 : 8, "BlockStored");
      field("block_hashes");
      pk.pack_array(1);
      PackHash(pk, e.hash, int_hashes);
      field("parent_block_hash");
      if (e.parent) {
        PackHash(pk, *e.parent, int_hashes);
      } else {
        pk.pack_nil();
      }
      field("token_ids");
      pk.pack_array(static_cast<uint32_t>(e.tokens.size()));
      for (int32_t t : e.tokens) pk.pack_int32(t);
      field("block_size");
      pk.pack_uint32(static_cast<uint32_t>(e.tokens.size()));
      field("lora_id");
      pk.pack_nil();
      field("medium");
      PackString(pk, medium);
      field("lora_name");
      pk.pack_nil();
      if (e.salt) {
        field("extra_keys");
        pk.pack_array(1);  // the one hash's
        pk.pack_array(1);
        PackString(pk, *e.salt);
      }
      return;
    }
  }
}

}  // namespace

struct KvEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;
};

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(KvEventsConfig config) {
  if (absl::Status s = CheckEndpoint(config.endpoint, "--kv-events-endpoint",
                                     config.trusted_network, config.tenants);
      !s.ok()) {
    return s;
  }
  if (!config.replay_endpoint.empty()) {
    if (absl::Status s = CheckEndpoint(config.replay_endpoint, "--kv-events-replay-endpoint",
                                       config.trusted_network, config.tenants);
        !s.ok()) {
      return s;
    }
  }
  auto sockets = std::make_unique<Sockets>();
  std::string bound, bound_replay;
  try {
    sockets->pub.set(zmq::sockopt::linger, 0);
    sockets->pub.set(zmq::sockopt::sndhwm, 64);                 // batches a subscriber may owe
    sockets->pub.set(zmq::sockopt::maxmsgsize, int64_t{4096});  // its subscriptions
    sockets->pub.bind(config.endpoint);
    bound = sockets->pub.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-events-endpoint: cannot bind \"", config.endpoint, "\": ", e.what()));
  }
  if (!config.replay_endpoint.empty()) {
    try {
      sockets->replay.emplace(sockets->context, zmq::socket_type::router);
      sockets->replay->set(zmq::sockopt::linger, 0);
      sockets->replay->set(zmq::sockopt::maxmsgsize, int64_t{64});  // a request: 8 bytes
      // Room for a whole answer (4 frames a batch), so that none is cut short.
      sockets->replay->set(zmq::sockopt::sndhwm, static_cast<int>(std::min<size_t>(
                                                     4 * (config.replay_batches + 1), INT32_MAX)));
      sockets->replay->bind(config.replay_endpoint);
      bound_replay = sockets->replay->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-events-replay-endpoint: cannot bind \"",
                                                     config.replay_endpoint, "\": ", e.what()));
    }
  }
  for (const auto& [address, flag] : {std::pair{bound, "--kv-events-endpoint"},
                                      std::pair{bound_replay, "--kv-events-replay-endpoint"}}) {
    if (absl::Status s = OwnerOnly(address, flag); !s.ok()) return s;
  }
  std::unique_ptr<KvEventPublisher> publisher(
      new KvEventPublisher(std::move(config), std::move(sockets)));
  publisher->bound_endpoint_ = std::move(bound);
  publisher->bound_replay_endpoint_ = std::move(bound_replay);
  // The sockets pass to the thread here (thread creation is a full fence, as ZMQ asks).
  publisher->thread_ = std::thread([p = publisher.get()] { p->Run(); });
  return publisher;
}

KvEventPublisher::KvEventPublisher(KvEventsConfig config, std::unique_ptr<Sockets> sockets)
    : config_(std::move(config)), sockets_(std::move(sockets)) {
  kvmem::MutexLock lock(&mu_);
  lost_ = true;  // the first batch: AllBlocksCleared
}

KvEventPublisher::~KvEventPublisher() {
  {
    kvmem::MutexLock lock(&mu_);
    stop_ = true;
    wake_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

void KvEventPublisher::Lose(uint64_t events) noexcept {
  counters_.dropped += queue_.size() + events;
  queue_.clear();
  queued_bytes_ = 0;
  lost_ = true;
}

void KvEventPublisher::Enqueue(Event event) {
  const uint64_t bytes = EventBytes(event);
  kvmem::MutexLock lock(&mu_);
  if (queue_.size() >= config_.max_queued_events ||
      queued_bytes_ + bytes > config_.max_queued_bytes) {
    // The router is told to forget everything rather than miss a removal.
    Lose(1);
    return;
  }
  try {
    queue_.push_back(std::move(event));
    queued_bytes_ += bytes;
  } catch (const std::bad_alloc&) {
    Lose(1);
  }
}

void KvEventPublisher::Stored(const prefix::StoredBlock& block) noexcept {
  try {
    Event e;
    e.kind = Event::Kind::kStored;
    e.hash = *block.hash;
    if (block.parent != nullptr) e.parent = *block.parent;
    e.tokens.assign(block.tokens.begin(), block.tokens.end());
    if (block.salt != nullptr) e.salt = *block.salt;
    Enqueue(std::move(e));
  } catch (const std::bad_alloc&) {
    kvmem::MutexLock lock(&mu_);
    Lose(1);
  }
}

void KvEventPublisher::Removed(absl::string_view /*ns*/, const prefix::BlockHash& hash) noexcept {
  Event e;  // allocates nothing; Enqueue loses it, not throws, when memory runs out
  e.kind = Event::Kind::kRemoved;
  e.hash = hash;
  Enqueue(std::move(e));
}

KvEventCounters KvEventPublisher::counters() const {
  kvmem::MutexLock lock(&mu_);
  return counters_;
}

std::string KvEventPublisher::Encode(double timestamp, absl::Span<const Event> events,
                                     bool map_form, bool int_hashes, const std::string& medium) {
  msgpack::sbuffer buffer;
  Packer pk(&buffer);
  if (map_form) {
    pk.pack_map(2);  // data_parallel_rank: None, its default, omitted as vLLM does
    PackString(pk, "ts");
    pk.pack_double(timestamp);
    PackString(pk, "events");
  } else {
    pk.pack_array(3);
    pk.pack_double(timestamp);
  }
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const Event& e : events) PackEvent(pk, e, map_form, int_hashes, medium);
  if (!map_form) pk.pack_nil();  // the data-parallel rank: none
  return std::string(buffer.data(), buffer.size());
}

void KvEventPublisher::Send(absl::Span<const Event> events) {
  std::string payload = Encode(absl::ToUnixMicros(absl::Now()) * 1e-6, events, config_.map_form,
                               config_.int_hashes, config_.medium);
  const uint64_t seq = next_seq_++;
  try {
    sockets_->pub.send(zmq::buffer(config_.topic), zmq::send_flags::sndmore);
    sockets_->pub.send(zmq::buffer(BigEndian64(seq)), zmq::send_flags::sndmore);
    sockets_->pub.send(zmq::buffer(payload), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    spdlog::warn("kvmemd: KV events batch {} not sent: {}", seq, e.what());
  }
  {
    kvmem::MutexLock lock(&mu_);
    ++counters_.batches;
    counters_.events += events.size();
  }
  kept_bytes_ += payload.size();
  kept_.emplace_back(seq, std::move(payload));
  while (!kept_.empty() &&
         (kept_.size() > config_.replay_batches || kept_bytes_ > config_.replay_bytes)) {
    kept_bytes_ -= kept_.front().second.size();
    kept_.pop_front();
  }
}

void KvEventPublisher::ServeReplay() {
  if (!sockets_->replay) return;
  zmq::socket_t& router = *sockets_->replay;
  // One request per call: a flood of them cannot hold the batches back.
  std::vector<zmq::message_t> frames;
  try {
    zmq::message_t frame;
    if (!router.recv(frame, zmq::recv_flags::dontwait)) return;
    frames.push_back(std::move(frame));
    while (frames.back().more() && frames.size() < 8) {
      zmq::message_t next;
      if (!router.recv(next, zmq::recv_flags::none)) break;
      frames.push_back(std::move(next));
    }
    while (frames.back().more()) {  // past 8 frames: not a request of ours; drained
      zmq::message_t rest;
      if (!router.recv(rest, zmq::recv_flags::none)) break;
    }
  } catch (const zmq::error_t& e) {
    spdlog::warn("kvmemd: KV events replay: {}", e.what());
    return;
  } catch (const std::bad_alloc&) {  // the frames' vector: the request is dropped
    spdlog::warn("kvmemd: KV events replay: out of memory; a request was dropped");
    return;
  }
  {
    kvmem::MutexLock lock(&mu_);
    ++counters_.replay_requests;
  }
  // [identity, "", start (8 bytes)] from a REQ socket; anything else is ignored.
  if (frames.size() != 3 || frames[1].size() != 0 || frames[2].size() != 8) return;
  const uint64_t start = LoadBigEndian64(static_cast<const uint8_t*>(frames[2].data()));
  try {
    const std::string identity = frames[0].to_string();
    auto reply = [&](const std::string& seq, const std::string& payload) {
      router.send(zmq::buffer(identity), zmq::send_flags::sndmore);
      router.send(zmq::buffer(std::string()), zmq::send_flags::sndmore);
      router.send(zmq::buffer(seq), zmq::send_flags::sndmore);
      router.send(zmq::buffer(payload), zmq::send_flags::none);
    };
    for (const auto& [seq, payload] : kept_) {
      if (seq >= start) reply(BigEndian64(seq), payload);
    }
    reply(BigEndian64(~uint64_t{0}), std::string());  // -1: the end
  } catch (const zmq::error_t& e) {
    spdlog::warn("kvmemd: KV events replay: {}", e.what());
  } catch (const std::bad_alloc&) {
    spdlog::warn("kvmemd: KV events replay: out of memory; the request was not answered");
  }
}

void KvEventPublisher::Run() {
  for (;;) {
    ServeReplay();
    std::vector<Event> events;
    bool stop = false;
    {
      kvmem::MutexLock lock(&mu_);
      if (queue_.empty() && !stop_) {
        // Short waits: the replay socket is looked at between them.
        kvmem::TsanRelease(&mu_);
        wake_.WaitWithTimeout(&mu_, absl::Milliseconds(10));
        kvmem::TsanAcquire(&mu_);
      }
      events.swap(queue_);
      queued_bytes_ = 0;
      if (lost_) {
        try {
          events.insert(events.begin(), Event{});  // AllBlocksCleared first
          lost_ = false;
        } catch (const std::bad_alloc&) {
          Lose(events.size());  // tried again with the next batch
          events.clear();
        }
      }
      stop = stop_;
    }
    if (!events.empty()) {
      try {
        const absl::Span<const Event> all(events);
        for (size_t at = 0; at < all.size(); at += config_.batch_events) {
          Send(all.subspan(at, config_.batch_events));
        }
      } catch (const std::bad_alloc&) {
        kvmem::MutexLock lock(&mu_);
        Lose(0);  // the batch was not sent: the router forgets what it held
      }
    }
    if (stop) return;
  }
}

}  // namespace kvmem::service
