#pragma once
// KvEventPublisher: kvmemd's prefix blocks as KV-cache events for cache-aware routers
// (llm-d, NVIDIA Dynamo), on the wire vLLM's ZMQ publisher uses
// (vllm/distributed/kv_events.py):
//   - a ZMQ PUB socket (--kv-events-endpoint) sends multipart messages
//     [topic, sequence number (u64 big-endian, from 0), msgpack(batch)];
//   - a batch is [timestamp (float64 seconds), [events...], data-parallel rank (nil)] in the
//     positional-array form (vLLM's array_like structs, which llm-d's and Dynamo's decoders
//     read), or {"ts", "events"} in the map form vLLM publishes since it dropped
//     array_like (--kv-events-format=map; an event is then a map whose "type" names it);
//   - events: ["BlockStored", [hash], parent hash or nil, [token ids], block size,
//     lora_id nil, medium, lora_name nil(, extra keys: [[cache salt]] for a chain's first
//     block when it has one)], ["BlockRemoved", [hash], medium], ["AllBlocksCleared"].
//     Hashes are the 32-byte sha256_cbor chain (msgpack bin), the cache salt kvmemd's
//     tenant-scoped one ("tenant:<name>/<salt>"), so that a consumer recomputes every hash
//     from the token ids;
//   - a ROUTER socket (--kv-events-replay-endpoint) answers a request [start (u64 BE)] with
//     every kept batch from that number on, [sequence, payload] each, then [-1 (i64 BE), ""].
// The first batch is AllBlocksCleared: a router drops what an earlier kvmemd on this
// endpoint announced. Events leave in the order the index changed (they are queued under
// its lock). The queue is bounded: past it, what is queued is dropped (counted) and replaced
// by AllBlocksCleared, so that a router forgets rather than believes blocks that are gone.
//
// Who may subscribe: events carry every tenant's token ids, so the endpoint is for the
// fleet's router, one trust domain; a TCP endpoint beyond loopback, and with tenants
// (--auth-tokens) any endpoint, is refused unless --kv-events-trusted-network says so (ZMQ
// authenticates nobody); an ipc:// socket is made 0600 (kvmemd's user), an abstract one
// (ipc://@) refused. The events cover every namespace (model, layout) of the index: a
// kvmemd that serves several models announces blocks of each under the same topic.
// Memory: the queue holds at most max_queued_events and max_queued_bytes, a batch at most
// batch_events; the PUB socket keeps at most 64 batches a slow subscriber has not taken
// (it then misses batches: the sequence numbers show the gap, replay fills it), the replay
// store max replay_batches / replay_bytes, one replay request is served per 10 ms.
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/prefix/index_events.h"

namespace kvmem::service {

struct KvEventsConfig {
  std::string endpoint;         // bound; tcp://host:port or ipc://path
  std::string replay_endpoint;  // empty: no replay socket
  std::string topic;            // the first frame of every message
  bool map_form = false;        // else the positional-array form
  // Hashes as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the
  // digest's last 8 bytes as a big-endian u64; else the 32-byte digest (msgpack bin).
  bool int_hashes = true;
  // kvmemd serves tenants (--auth-tokens): every endpoint, loopback and ipc:// included,
  // then needs trusted_network (a local process could read every tenant's prompts).
  bool tenants = false;
  std::string medium = "CPU";    // where the blocks live: "CPU", or "GPU" (CUDA backend)
  bool trusted_network = false;  // a TCP endpoint beyond loopback is allowed
  size_t max_queued_events = 100000;
  uint64_t max_queued_bytes = 64ull << 20;  // and their token ids and salts, in bytes
  size_t batch_events = 1000;               // at most this many events a batch
  // Batches kept for replay, at most this many and this many bytes.
  size_t replay_batches = 10000;
  uint64_t replay_bytes = 64ull << 20;
};

struct KvEventCounters {
  uint64_t batches = 0;  // sent on the PUB socket
  uint64_t events = 0;   // in those batches
  uint64_t dropped = 0;  // queued events dropped for a full queue
  uint64_t replay_requests = 0;
};

class KvEventPublisher final : public prefix::IndexEvents {
 public:
  // Binds both sockets (an error names the flag and the endpoint) and starts the sending
  // thread, which sends AllBlocksCleared first.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(KvEventsConfig config);
  ~KvEventPublisher() override;
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  void Stored(const prefix::StoredBlock& block) noexcept override;
  void Removed(absl::string_view ns, const prefix::BlockHash& hash) noexcept override;

  KvEventCounters counters() const;
  // The replay endpoint as bound (a tcp port 0 resolved), for tests.
  const std::string& bound_endpoint() const { return bound_endpoint_; }
  const std::string& bound_replay_endpoint() const { return bound_replay_endpoint_; }

  // One event as queued (exposed for the encoder's tests).
  struct Event {
    enum class Kind { kStored, kRemoved, kCleared } kind = Kind::kCleared;
    prefix::BlockHash hash{};
    std::optional<prefix::BlockHash> parent;
    std::vector<int32_t> tokens;
    std::optional<std::string> salt;
  };
  // A batch's msgpack bytes.
  static std::string Encode(double timestamp, absl::Span<const Event> events, bool map_form,
                            bool int_hashes, const std::string& medium);
  // What a queued event holds, in bytes (the queue's bound).
  static uint64_t EventBytes(const Event& e) {
    return sizeof(Event) + e.tokens.size() * sizeof(int32_t) + (e.salt ? e.salt->size() : 0);
  }

 private:
  struct Sockets;
  KvEventPublisher(KvEventsConfig config, std::unique_ptr<Sockets> sockets);
  void Enqueue(Event event);
  // Events lost (a full queue, or no memory for one): what is queued goes too, and the next
  // batch begins with AllBlocksCleared.
  void Lose(uint64_t events) noexcept ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  void Send(absl::Span<const Event> events);
  void ServeReplay();

  const KvEventsConfig config_;
  std::unique_ptr<Sockets> sockets_;  // used by the sending thread only, once started
  std::string bound_endpoint_, bound_replay_endpoint_;
  mutable absl::Mutex mu_;
  std::vector<Event> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool lost_ ABSL_GUARDED_BY(mu_) = false;  // the next batch begins with AllBlocksCleared
  absl::CondVar wake_;                      // the stop
  KvEventCounters counters_ ABSL_GUARDED_BY(mu_);
  // The sending thread's own.
  uint64_t next_seq_ = 0;
  std::deque<std::pair<uint64_t, std::string>> kept_;
  uint64_t kept_bytes_ = 0;
  std::thread thread_;
};

}  // namespace kvmem::service
