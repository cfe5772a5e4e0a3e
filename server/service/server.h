#pragma once
// Server: assembles backend, engine, the KvCache service, grpc.health.v1 and reflection,
// and the lease reaper; used by kvmemd's main and by in-process integration tests.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/server.h"
#include "server/engine/clock.h"
#include "server/engine/engine.h"
#include "server/metrics/exporter.h"
#include "server/metrics/rpc_telemetry.h"
#include "server/service/admission.h"
#include "server/service/auth.h"
#include "server/service/cluster_index.h"
#include "server/service/kv_events.h"
#include "server/service/prefix_pull.h"
#include "server/service/sequence_move.h"
#include "server/transport/attach_socket.h"
#if KVMEM_WITH_UCX
#include "server/transport/ucx_plane.h"
#endif
#include "server/transport/unix_peers.h"

namespace kvmem::service {

class KvCacheService;

inline constexpr char kServiceName[] = "kvmem.v1.KvCache";

struct ServerConfig {
  std::string listen = "127.0.0.1:50551";  // host:port (port 0 picks one) or unix:path
  std::string backend = "cpu";             // cpu | cuda
  int cuda_device = 0;                     // the GPU of --backend=cuda (one kvmemd per GPU)
  // Where per-step policy work runs (engine.device_step): "auto" = in the backend's slot
  // state on CUDA, in the policies' host code on the CPU (same decisions, less copying);
  // "on" or "off" force it. Overrides engine.device_step.
  std::string device_step = "auto";
  engine::EngineConfig engine;
  ServiceLimits limits;
  // gRPC's ResourceQuota: the memory its transports may hold (read buffers, messages not
  // yet handed to a handler) and the threads that run handlers. A call past the threads is
  // refused with RESOURCE_EXHAUSTED instead of queueing without bound.
  uint64_t grpc_memory_bytes = 1ull << 30;
  int grpc_max_threads = 256;
  // What the requests being served may take once parsed, reserved before each is parsed
  // (transport::ParseBudget, one per process: the last server started sets it).
  uint64_t parse_memory_bytes = 1ull << 30;
  absl::Duration reaper_period = absl::Seconds(1);
  // Where /metrics is served ("host:port", port 0 picks one); empty: not served.
  std::string metrics_listen;
  // Map the whole pool ahead of use, on a thread of its own started with the server: the
  // pool's memory is allocated at start, but the kernel zero-fills and maps each page at
  // its first touch, a page fault in the middle of an Append (kvmemd --pool-prefault, on
  // by default; off here, so that in-process tests and benchmarks choose it).
  bool prefault_pool = false;
  // Bearer tokens per tenant (service::Authenticator; kvmemd --auth-tokens); empty: none,
  // one trust domain, and then `listen` must be a unix socket or loopback unless
  // `allow_unauthenticated_remote`.
  std::string auth_tokens;
  bool allow_unauthenticated_remote = false;
  // TLS (PEM files): the server's certificate chain and key; with `tls_client_ca`, clients
  // must present a certificate it signed, whose common name is their tenant.
  std::string tls_cert, tls_key, tls_client_ca;
  // The attach socket, where same-host clients receive the shared-memory segments'
  // descriptors (transport/attach_socket.h): "@name" abstract, else a path; empty: an
  // abstract name of its own. `attach_uids`: the peer uids it serves (empty: kvmemd's own).
  std::string attach_socket;
  std::vector<uid_t> attach_uids;
  // kvmemd's UCX worker (transport::UcxPlane): the pool and the epoch board registered for
  // remote reads, offered in GetInfo's `ucx` to callers that may read the pool. CPU backend.
  bool ucx = false;
  // Acknowledges that over TCP and shared memory (RMA emulated in software, keys unchecked)
  // every peer that reaches the UCX worker can read and write kvmemd's memory: --ucx is
  // refused without it.
  bool ucx_trusted_network = false;
  // The prefix index's blocks as vLLM-compatible KV events (kv_events.h); an empty
  // endpoint: none. `kv_events_format`: "array" or "map" (sets kv_events.map_form); the
  // medium follows the backend.
  KvEventsConfig kv_events;
  std::string kv_events_format = "array";
  // "int" (a digest's last 8 bytes, big-endian: vLLM's default) or "bytes" (all 32).
  std::string kv_events_hash = "int";
  // The fleet's shared prefix index on Redis/Valkey (cluster_index.h); an empty url: none.
  ClusterIndexConfig cluster_index;
  // PullPrefix (prefix_pull.h), with a cluster index: the K/V one pull may hold, and how
  // many run at once.
  uint64_t cluster_pull_max_bytes = 256ull << 20;
  int cluster_pull_concurrency = 2;
  // The nodes (their --cluster-node-address) PullPrefix may pull from and MoveSequence may
  // move from; none: neither.
  std::vector<std::string> cluster_peers;
  // A file holding the token this daemon presents to its peers for their pool's UCX key
  // (MoveSequence and PullPrefix by UCX: one the peers' token files name as a peer's, or an
  // admin's); empty: by gRPC.
  std::string cluster_peer_token_file;
  // TLS of the calls to the peers (service::PeerLinks): the CA (PEM file) their server
  // certificates are signed by; empty: plaintext.
  std::string cluster_peer_tls_ca;
};

class Server {
 public:
  // `clock` must outlive the server; nullptr means the real clock.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerConfig& config,
                                                       const engine::Clock* clock = nullptr);
  ~Server();

  int port() const { return port_; }  // 0 for unix sockets
  // The attach socket's address (GetInfoResponse.attach.socket).
  const std::string& attach_address() const { return attach_->address(); }
  int metrics_port() const { return exporter_ ? exporter_->port() : 0; }  // 0: not served
  engine::Engine& engine() { return *engine_; }
  const KvCacheService& service() const { return *service_; }
  // What /metrics would return now (served or not).
  std::string RenderMetrics() const { return metrics::Render(*collector_); }
  // Health turns NOT_SERVING (Check keeps answering), new KvCache calls get UNAVAILABLE,
  // the calls already inside a handler finish; after they have, or after `deadline`, gRPC
  // shuts down (cancelling what still runs) and the reaper stops. Idempotent.
  void Drain(absl::Duration deadline);
  // Reads the token file again (SIGHUP); an error keeps the tokens as they were.
  absl::Status ReloadTokens();
  // Bytes of the pool mapped ahead of use so far (prefault_pool); the pool's size once done.
  uint64_t prefaulted_bytes() const { return prefaulted_bytes_.load(std::memory_order_acquire); }
  // Whether the prefault ended: done, given up (the backend cannot: a CUDA pool, a kernel
  // before 5.14; or it failed, logged) or stopped. False without prefault_pool.
  bool prefault_ended() const { return prefault_ended_.load(std::memory_order_acquire); }

 private:
  Server() = default;
  // prefaulter_'s work: maps the pool a chunk at a time until done or told to stop.
  void PrefaultPool();
  void StopPrefault();
  engine::RealClock real_clock_;
  // Before the engine, whose prefix index queues into them until it is gone.
  std::unique_ptr<KvEventPublisher> kv_events_;
  std::unique_ptr<ClusterIndex> cluster_index_;
  std::unique_ptr<PeerLinks> peer_links_;  // before the puller and the mover, which use it
  std::unique_ptr<PrefixPuller> puller_;
  std::unique_ptr<SequenceMover> mover_;
  prefix::IndexEventsFanout index_events_;
  std::unique_ptr<engine::Engine> engine_;
  // Before the service and the gRPC server, so that it outlives the interceptors and the
  // step channels that record into it.
  std::unique_ptr<metrics::RpcTelemetry> rpc_telemetry_;
  std::unique_ptr<Authenticator> auth_;  // with tokens; before the service that reads it
  // After the engine (its segments), before the service (which issues its tickets).
  std::unique_ptr<transport::AttachSocket> attach_;
#if KVMEM_WITH_UCX
  std::unique_ptr<transport::UcxPlane> ucx_;  // after the engine (its regions), before service_
#endif
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  // kvmemd's own accept on a unix --listen with authentication (peers' uids); stopped
  // before gRPC shuts down. After auth_, which looks peers up in it.
  std::unique_ptr<transport::UnixPeers> unix_peers_;
  std::shared_ptr<metrics::Collector> collector_;
  std::unique_ptr<metrics::Exporter> exporter_;
  int port_ = 0;
  absl::Notification stop_reaper_;
  std::thread reaper_;
  std::atomic<bool> stop_prefault_{false};
  std::atomic<uint64_t> prefaulted_bytes_{0};
  std::atomic<bool> prefault_ended_{false};
  std::thread prefaulter_;
  bool drained_ = false;
};

}  // namespace kvmem::service
