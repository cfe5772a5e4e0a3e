#include "server/service/server.h"

#include <pthread.h>
#include <sys/un.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <variant>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_posix.h"
#include "grpcpp/version_info.h"
#include "server/common/client_text.h"
#include "server/service/kv_cache_service.h"
#include "server/service/rpc_interceptor.h"
#include "server/store/backend_factory.h"
#include "server/transport/segment_guard.h"
#include "server/transport/shared_segment.h"
#include "spdlog/spdlog.h"

#ifndef KVMEM_VERSION
#define KVMEM_VERSION "0.0.0"
#endif

namespace kvmem::service {

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read a PEM file from ", EchoClientText(path)));
  }
  return text.str();
}

// Plaintext, or TLS (with client certificates required and verified when asked).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerConfig& config) {
  if (config.tls_cert.empty() != config.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key: give both or neither");
  }
  if (config.tls_cert.empty()) {
    if (!config.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca: needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPem(config.tls_cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(config.tls_key, "--tls-key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!config.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(config.tls_client_ca, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

// The links to --cluster-peers: the peer token, the TLS of the calls to them. Tokens sent in
// plaintext to a peer off this host are warned about, as kvmemd's own --listen is.
absl::StatusOr<std::unique_ptr<PeerLinks>> Peers(const ServerConfig& config) {
  std::string peer_token;
  if (!config.cluster_peer_token_file.empty()) {
    std::ifstream in(config.cluster_peer_token_file);
    if (!(in >> peer_token) || peer_token.size() < 16 || peer_token.size() > 512) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cluster-peer-token-file: ", config.cluster_peer_token_file,
                       " holds no token (16 to 512 printable characters without spaces)"));
    }
  }
  std::string ca;
  if (!config.cluster_peer_tls_ca.empty()) {
    absl::StatusOr<std::string> pem = ReadPem(config.cluster_peer_tls_ca, "--cluster-peer-tls-ca");
    if (!pem.ok()) return pem.status();
    if (pem->find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cluster-peer-tls-ca: ", EchoClientText(config.cluster_peer_tls_ca),
                       " holds no certificate"));
    }
    ca = *std::move(pem);
  }
  absl::StatusOr<std::unique_ptr<PeerLinks>> links =
      PeerLinks::Create(std::move(peer_token), ca, config.cluster_peers);
  // Tokens a caller sends are forwarded whether or not this daemon checks them.
  if (!links.ok() || (*links)->tls()) return links;
  for (const std::string& peer : config.cluster_peers) {
    if (!IsLocalListen(peer)) {
      spdlog::warn(
          "kvmemd: bearer tokens go in plaintext to the peer {} (no --cluster-peer-tls-ca): "
          "keep the fleet on a network no one else can read",
          peer);
    }
  }
  return links;
}

// A unix-socket --listen address as kvmemd's sockets name one ("@name" abstract, else a
// path); empty for any other --listen.
std::string UnixAddress(absl::string_view listen) {
  if (absl::ConsumePrefix(&listen, "unix-abstract:")) return absl::StrCat("@", listen);
  if (!absl::ConsumePrefix(&listen, "unix:")) return "";
  if (absl::StartsWith(listen, "///")) listen.remove_prefix(2);
  return std::string(listen);
}

// The attach socket's address: the configured one; else, for a unix-socket --listen at a
// path, a socket file next to it (reachable wherever the gRPC socket is: across containers
// sharing its volume, which an abstract name is not); else an abstract name of its own.
std::string DefaultAttachSocket(const ServerConfig& config) {
  if (!config.attach_socket.empty()) return config.attach_socket;
  const std::string path = UnixAddress(config.listen);
  if (path.empty() || path[0] == '@') return "";
  std::string beside = absl::StrCat(path, ".attach");
  return beside.size() < sizeof(sockaddr_un::sun_path) ? beside : "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerConfig& config,
                                                      const engine::Clock* clock) {
  std::unique_ptr<Server> server(new Server());
  if (clock == nullptr) clock = &server->real_clock_;
  // The transport admits a little more than the payload limit so that an oversized Append
  // reaches the handler and gets a message naming the limit.
  const uint64_t max_message = config.engine.max_append_bytes + (4u << 20);
  if (config.grpc_memory_bytes < max_message) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--grpc-memory-bytes: ", config.grpc_memory_bytes, " cannot hold one message of ",
        max_message, " bytes (--max-message-bytes plus 4 MiB)"));
  }
  // The largest Append's parse is about its size (its K and V: StringParseBytes, and 4 MiB
  // for the rest): two fit.
  const uint64_t largest_append =
      2 * transport::StringParseBytes(config.engine.max_append_bytes / 2) + (4u << 20);
  if (config.parse_memory_bytes < 2 * largest_append) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--parse-memory-bytes: ", config.parse_memory_bytes,
        " cannot hold two of the largest Appends (--max-message-bytes=",
        config.engine.max_append_bytes, ") once parsed (", largest_append, " bytes each)"));
  }
  transport::ParseBudget::Process().SetCapacity(config.parse_memory_bytes);
  if (config.grpc_max_threads < 4) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc-max-threads: ", config.grpc_max_threads,
                                                   " is below 4, too few to serve"));
  }
  // Step channels and AppendStreams keep a thread each while open: half of the threads
  // stay for the other calls.
  if (uint64_t{config.limits.max_step_channels} + config.limits.max_append_streams >
      static_cast<uint64_t>(config.grpc_max_threads / 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-step-channels: ", config.limits.max_step_channels,
                     " plus --max-append-streams=", config.limits.max_append_streams,
                     " is more than half of --grpc-max-threads=", config.grpc_max_threads,
                     " (each open channel or stream holds a thread)"));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(config);
  if (!credentials.ok()) return credentials.status();
  if (!config.auth_tokens.empty() || !config.tls_client_ca.empty()) {
    absl::StatusOr<std::unique_ptr<Authenticator>> auth =
        Authenticator::Create(config.auth_tokens, !config.tls_client_ca.empty());
    if (!auth.ok()) return auth.status();
    server->auth_ = *std::move(auth);
  } else if (!IsLocalListen(config.listen)) {
    if (!config.allow_unauthenticated_remote) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen: ", config.listen,
          " is reachable from other hosts and kvmemd has no --auth-tokens: anyone who reaches "
          "it could read and change every sequence. Give it --auth-tokens, listen on a unix "
          "socket or loopback, or pass --allow-unauthenticated-remote"));
    }
    spdlog::warn(
        "kvmemd: --allow-unauthenticated-remote: {} serves every caller that reaches "
        "it, unauthenticated, with every sequence's K/V",
        config.listen);
  }
  // On a unix socket with authentication (and no TLS), kvmemd accepts the connections
  // itself, so that a call's tenant can come from its peer's uid (UnixPeers, Authenticator).
  // gRPC names such a connection's calls by its descriptor's number, which must not go to
  // another connection while a call on it runs: gRPC 1.51 keeps the descriptor open until
  // its transport's last call is gone (the streams hold the transport, the transport the
  // endpoint); later versions close it with the transport, so there kvmemd leaves its unix
  // socket to gRPC and the token file may not map uids.
  const std::string unix_address = UnixAddress(config.listen);
  constexpr bool kDescriptorOutlivesCalls =
      GRPC_CPP_VERSION_MAJOR == 1 && GRPC_CPP_VERSION_MINOR == 51;
  const bool own_accept = kDescriptorOutlivesCalls && server->auth_ != nullptr &&
                          config.tls_cert.empty() && !unix_address.empty();
  if (server->auth_ != nullptr && !own_accept && server->auth_->maps_uids()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth-tokens: ", config.auth_tokens, " maps uids, which kvmemd tells only on a unix ",
        "--listen without TLS", kDescriptorOutlivesCalls ? "" : " (and with gRPC 1.51)"));
  }
  if (server->auth_ != nullptr && config.tls_cert.empty() && !IsLocalListen(config.listen)) {
    spdlog::warn(
        "kvmemd: bearer tokens travel in plaintext on {} (no --tls-cert): keep it on a "
        "network no one else can read",
        config.listen);
  }
  engine::EngineConfig engine_config = config.engine;
  std::vector<uint64_t> arena_bytes;
  if (!engine_config.tenant_arenas.empty()) {
    // An arena is an authenticated tenant's: without identities a tenant is a salt any
    // client may send.
    if (server->auth_ == nullptr) {
      return absl::InvalidArgumentError(
          "--tenant-arena: arenas belong to authenticated tenants; give --auth-tokens or "
          "--tls-client-ca");
    }
    if (engine_config.page_bytes == 0) {
      return absl::InvalidArgumentError("--tenant-arena: --page-bytes is 0");
    }
    absl::flat_hash_set<std::string> named;
    for (const auto& [tenant, bytes] : engine_config.tenant_arenas) {
      if (tenant.empty() || !named.insert(tenant).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--tenant-arena: tenant \"", EchoClientText(tenant), "\" is empty or named twice"));
      }
      arena_bytes.push_back(bytes);
    }
    // The arenas are whole pages at the pool's end: the pool is whole pages too.
    engine_config.pool_bytes =
        engine_config.pool_bytes / engine_config.page_bytes * engine_config.page_bytes;
  }
  absl::StatusOr<std::unique_ptr<store::Backend>> backend = store::MakeBackend(
      config.backend, engine_config.pool_bytes, config.cuda_device, std::move(arena_bytes));
  if (!backend.ok()) return backend.status();
  if (config.device_step == "auto") {
    engine_config.device_step = (*backend)->prefers_device_step();
  } else if (config.device_step == "on" || config.device_step == "off") {
    engine_config.device_step = config.device_step == "on";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device_step: \"", EchoClientText(config.device_step), "\" is not one of auto, on, off"));
  }
  absl::StatusOr<std::unique_ptr<engine::Engine>> engine =
      engine::Engine::Create(engine_config, *std::move(backend), clock);
  if (!engine.ok()) return engine.status();
  server->engine_ = *std::move(engine);
  if (!config.kv_events.endpoint.empty()) {
    KvEventsConfig events = config.kv_events;
    if (config.kv_events_format != "array" && config.kv_events_format != "map") {
      return absl::InvalidArgumentError(absl::StrCat("--kv-events-format: \"",
                                                     EchoClientText(config.kv_events_format),
                                                     "\" is neither array nor map"));
    }
    events.map_form = config.kv_events_format == "map";
    if (config.kv_events_hash != "int" && config.kv_events_hash != "bytes") {
      return absl::InvalidArgumentError(absl::StrCat("--kv-events-hash: \"",
                                                     EchoClientText(config.kv_events_hash),
                                                     "\" is neither int nor bytes"));
    }
    events.int_hashes = config.kv_events_hash == "int";
    events.tenants = !config.auth_tokens.empty() || !config.tls_client_ca.empty();
    events.medium = config.backend == "cuda" ? "GPU" : "CPU";
    absl::StatusOr<std::unique_ptr<KvEventPublisher>> publisher =
        KvEventPublisher::Start(std::move(events));
    if (!publisher.ok()) return publisher.status();
    server->kv_events_ = *std::move(publisher);
    server->index_events_.Add(server->kv_events_.get());
  }
  if (!config.cluster_peers.empty() || !config.cluster_index.url.empty()) {
    absl::StatusOr<std::unique_ptr<PeerLinks>> links = Peers(config);
    if (!links.ok()) return links.status();
    server->peer_links_ = *std::move(links);
  }
  if (!config.cluster_peers.empty()) {
    if (config.cluster_pull_concurrency < 1 || config.cluster_pull_concurrency > 64) {
      return absl::InvalidArgumentError("--cluster-pull-concurrency: in [1, 64]");
    }
    server->mover_ =
        std::make_unique<SequenceMover>(server->engine_.get(), config.cluster_pull_max_bytes,
                                        config.cluster_pull_concurrency, server->peer_links_.get());
  }
  if (!config.cluster_index.url.empty()) {
    // A loss of events rebuilds this node's claims from the prefix index itself.
    absl::StatusOr<std::unique_ptr<ClusterIndex>> index =
        ClusterIndex::Start(config.cluster_index,
                            [engine = server->engine_.get()] { return engine->PublishedBlocks(); });
    if (!index.ok()) return index.status();
    server->cluster_index_ = *std::move(index);
    server->index_events_.Add(server->cluster_index_.get());
    if (config.cluster_pull_concurrency < 1 || config.cluster_pull_concurrency > 64) {
      return absl::InvalidArgumentError("--cluster-pull-concurrency: in [1, 64]");
    }
    server->puller_ = std::make_unique<PrefixPuller>(
        server->engine_.get(), server->cluster_index_.get(), config.cluster_index.node,
        config.cluster_pull_max_bytes, config.cluster_pull_concurrency, server->peer_links_.get());
  }
  if (!server->index_events_.empty()) server->engine_->set_index_events(&server->index_events_);
  // The CPU pool's segment: clients write into it only with in-place writes.
  for (const store::SharedMemoryExport& piece : server->engine_->backend().pool_pieces()) {
    if (auto segment = piece.segment.lock()) {
      const absl::Status sealed = segment->Seal(/*writers_too=*/!engine_config.in_place_writes);
      if (!sealed.ok()) return sealed;
    }
  }
  absl::StatusOr<std::unique_ptr<transport::AttachSocket>> attach =
      transport::AttachSocket::Start({DefaultAttachSocket(config), config.attach_uids});
  if (!attach.ok()) return attach.status();
  server->attach_ = *std::move(attach);
  transport::UcxPlane* ucx = nullptr;
  if (config.ucx && !config.ucx_trusted_network) {
    return absl::InvalidArgumentError(
        "--ucx: over TCP and shared memory UCX emulates remote reads with messages its "
        "handlers serve without checking a key or a region: any process that reaches kvmemd's "
        "UCX worker could read and write all of kvmemd's memory. Pass --ucx_trusted_network "
        "only where every such peer is trusted");
  }
  if (config.ucx) {
    spdlog::warn(
        "kvmemd: --ucx with --ucx_trusted_network: every process that reaches the UCX worker "
        "can read and write kvmemd's memory (UCX_TLS={}, UCX_NET_DEVICES={})",
        std::getenv("UCX_TLS") != nullptr ? std::getenv("UCX_TLS") : "(all)",
        std::getenv("UCX_NET_DEVICES") != nullptr ? std::getenv("UCX_NET_DEVICES") : "(all)");
#if KVMEM_WITH_UCX
    // The whole pool, its arenas included (its pieces lie side by side).
    const store::Backend& pool = server->engine_->backend();
    std::shared_ptr<const transport::SharedSegment> board =
        server->engine_->epoch_board().segment().lock();
    if (pool.pool_pieces().empty() || board == nullptr) {
      return absl::InvalidArgumentError(
          "--ucx: only the CPU backend's pool is registered for remote reads so far");
    }
    absl::StatusOr<std::unique_ptr<transport::UcxPlane>> plane = transport::UcxPlane::Start(
        {{pool.host_pool(), pool.pool_bytes()}, {board->data(), board->bytes()}});
    if (!plane.ok()) return plane.status();
    server->ucx_ = *std::move(plane);
    ucx = server->ucx_.get();
#else
    return absl::InvalidArgumentError("--ucx: this kvmemd was built without UCX (WITH_UCX)");
#endif
  }
  server->rpc_telemetry_ = std::make_unique<metrics::RpcTelemetry>(ServedMethods());
  server->service_ = std::make_unique<KvCacheService>(
      server->engine_.get(), KVMEM_VERSION, config.limits, clock, server->rpc_telemetry_.get(),
      server->auth_.get(), server->attach_.get());
  server->service_->set_ucx(ucx);
  server->service_->set_cluster_index(server->cluster_index_.get());
  server->service_->set_prefix_puller(server->puller_.get());
  server->service_->set_sequence_mover(server->mover_.get());

  transport::SegmentGuard::Install();  // step channels' segments may shrink under a read
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!own_accept) builder.AddListeningPort(config.listen, *credentials, &server->port_);
  builder.RegisterService(server->service_.get());
  builder.experimental().SetInterceptorCreators(RpcInterceptors(server->rpc_telemetry_.get()));
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<uint64_t>(max_message, INT32_MAX)));
  builder.SetMaxSendMessageSize(INT32_MAX);
  grpc::ResourceQuota quota("kvmemd");
  quota.Resize(static_cast<size_t>(config.grpc_memory_bytes));
  quota.SetMaxThreads(config.grpc_max_threads);
  builder.SetResourceQuota(quota);
  server->grpc_server_ = builder.BuildAndStart();
  if (server->grpc_server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", config.listen));
  }
  if (own_accept) {
    grpc::Server* grpc_server = server->grpc_server_.get();
    absl::StatusOr<std::unique_ptr<transport::UnixPeers>> peers =
        transport::UnixPeers::Listen(unix_address);
    if (!peers.ok()) return peers.status();
    server->unix_peers_ = *std::move(peers);
    // Before the first connection is accepted: its first call finds its peer.
    server->auth_->set_peers(server->unix_peers_.get());
    if (server->auth_->maps_uids(/*others=*/true)) server->unix_peers_->OpenToOtherUsers();
    server->unix_peers_->Serve(
        [grpc_server](int fd) { grpc::AddInsecureChannelFromFd(grpc_server, fd); });
  }
  server->collector_ = std::make_shared<metrics::Collector>(
      server->engine_.get(), server->rpc_telemetry_.get(),
      metrics::BuildInfo{KVMEM_VERSION, std::string(server->engine_->backend().kind()),
                         server->engine_->backend().device_name()});
  if (server->kv_events_) {
    server->collector_->set_kv_events([events = server->kv_events_.get()] {
      const KvEventCounters c = events->counters();
      return metrics::KvEventTotals{c.batches, c.events, c.dropped, c.replay_requests};
    });
  }
  if (server->puller_) {
    server->collector_->set_pulls([puller = server->puller_.get()] { return puller->totals(); });
  }
  if (server->mover_) {
    server->collector_->set_moves([mover = server->mover_.get()] { return mover->totals(); });
  }
#if KVMEM_WITH_UCX
  if (server->ucx_) {
    server->collector_->set_ucx([ucx = server->ucx_.get(), service = server->service_.get()] {
      const transport::UcxPlane::Counters c = ucx->counters();
      return metrics::UcxTotals{c.landed,
                                c.landed_bytes,
                                c.dropped,
                                c.failed,
                                c.receiving,
                                c.held,
                                service->ucx_payload_seconds()};
    });
  }
#endif
  if (server->cluster_index_) {
    server->collector_->set_cluster_index(
        [index = server->cluster_index_.get()] { return index->counters(); });
  }
  if (!config.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<metrics::Exporter>> exporter =
        metrics::Exporter::Start(config.metrics_listen, server->collector_);
    if (!exporter.ok()) return exporter.status();
    server->exporter_ = *std::move(exporter);
  }
  grpc::HealthCheckServiceInterface* health = server->grpc_server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  Server* raw = server.get();
  if (config.prefault_pool) server->prefaulter_ = std::thread([raw] { raw->PrefaultPool(); });
  const absl::Duration period = config.reaper_period;
  const absl::Duration idle = config.limits.append_stream_idle;
  const absl::Duration read_idle = config.limits.read_stream_idle;
  server->reaper_ = std::thread([raw, period, idle, read_idle] {
    // Leases, AppendStreams that went quiet (they hold their sequence while open), and
    // ReadKv streams whose client stopped reading (each holds a thread).
    const absl::Duration tick =
        std::min(period, std::max(std::min(idle, read_idle) / 4, absl::Milliseconds(10)));
    absl::Time next_reap = absl::Now();
    while (!raw->stop_reaper_.WaitForNotificationWithTimeout(tick)) {
      if (const int n = raw->service_->append_streams().CancelIdle(idle); n > 0) {
        spdlog::warn("{} AppendStream(s) idle for over {}s cancelled", n,
                     absl::ToDoubleSeconds(idle));
      }
      if (const int n = raw->service_->read_streams().CancelIdle(read_idle); n > 0) {
        spdlog::warn("{} ReadKv stream(s) whose client took no piece for {}s cancelled", n,
                     absl::ToDoubleSeconds(read_idle));
      }
      if (absl::Now() >= next_reap) {
        raw->engine_->ExpireLeases();
        raw->engine_->ReclaimToWatermark();
        if (raw->peer_links_ != nullptr) raw->peer_links_->DropIdleMappings();
        next_reap = absl::Now() + period;
      }
    }
  });
  return server;
}

absl::Status Server::ReloadTokens() {
  if (auth_ == nullptr) {
    return absl::FailedPreconditionError("kvmemd was started without --auth-tokens");
  }
  absl::Status reloaded = auth_->Reload();
  if (reloaded.ok() && unix_peers_ != nullptr && auth_->maps_uids(/*others=*/true)) {
    unix_peers_->OpenToOtherUsers();
  }
  return reloaded;
}

void Server::PrefaultPool() {
  pthread_setname_np(pthread_self(), "kvmem_prefault");
  absl::Cleanup ended = [this] { prefault_ended_.store(true, std::memory_order_release); };
  // In the order the pool hands pages out (lowest first), so that the pages the first
  // sequences take are mapped first; 1 MiB at a time, so that a drain stops it soon and
  // an mmap or munmap elsewhere in kvmemd (which waits for each call's hold of the address
  // space lock) waits about a millisecond at most.
  constexpr uint64_t kChunk = 1ull << 20;
  const store::Backend& backend = engine_->backend();
  const uint64_t total = backend.pool_bytes();
  const auto started = std::chrono::steady_clock::now();
  for (uint64_t at = 0; at < total; at += kChunk) {
    if (stop_prefault_.load(std::memory_order_relaxed)) return;
    if (absl::Status s = backend.Prefault(at, std::min(kChunk, total - at)); !s.ok()) {
      if (s.code() == absl::StatusCode::kUnimplemented) {
        spdlog::info("pool prefault: not done: {}", std::string(s.message()));
      } else {
        spdlog::warn("pool prefault stopped at byte {}: {} (the rest faults at first use)", at,
                     s.ToString());
      }
      return;
    }
    prefaulted_bytes_.store(std::min(total, at + kChunk), std::memory_order_release);
  }
  spdlog::info("pool prefaulted: {} bytes in {:.2f}s", total,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
}

void Server::Drain(absl::Duration deadline) {
  if (drained_) return;
  drained_ = true;
  StopPrefault();  // first: the draining calls get the cores
  const absl::Time end = absl::Now() + deadline;
  // Shutdown() of the health service turns every status NOT_SERVING for good; Check keeps
  // answering until gRPC itself shuts down below.
  grpc_server_->GetHealthCheckService()->Shutdown();
  CallGate& gate = service_->gate();
  gate.Close();
  if (!gate.AwaitQuiet(absl::Milliseconds(100), end)) {
    spdlog::warn("drain: {} calls still running after {}; cancelling them", gate.in_flight(),
                 absl::FormatDuration(deadline));
  }
  // Nothing admitted runs any more (or time is up): what gRPC cancels now is a call that
  // never reached a handler or one that overran the drain.
  // No connection is handed to gRPC once it shuts down.
  if (unix_peers_ != nullptr) unix_peers_->Stop();
  grpc_server_->Shutdown(absl::ToChronoTime(std::max(end, absl::Now())));
  grpc_server_->Wait();
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
}

void Server::StopPrefault() {
  stop_prefault_.store(true, std::memory_order_relaxed);
  if (prefaulter_.joinable()) prefaulter_.join();
}

Server::~Server() {
  if (grpc_server_ != nullptr) Drain(absl::Seconds(5));
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  StopPrefault();  // before the engine (and its backend) goes
  // Nothing calls the engine now: the cluster index's writer (whose rebuild reads the
  // engine's prefix index) stops before the engine goes, and /metrics (which reads the
  // index's and the puller's counters) before them.
  exporter_.reset();
  if (engine_ != nullptr) engine_->set_index_events(nullptr);
  puller_.reset();
  mover_.reset();
  cluster_index_.reset();
}

}  // namespace kvmem::service
