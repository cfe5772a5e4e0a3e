// kvmemd: the kvmem daemon. Serves kvmem.v1.KvCache, grpc.health.v1 and reflection.
// SIGTERM or SIGINT drains: health turns NOT_SERVING, in-flight calls finish, exit code 0.
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/service/server.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50551", "host:port (port 0 picks one) or unix:path");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "host:port of the Prometheus /metrics endpoint (port 0 picks one); empty: none");
ABSL_FLAG(std::string, backend, "cpu", "cpu or cuda");
ABSL_FLAG(int32_t, cuda_device, 0, "GPU ordinal for --backend=cuda (run one kvmemd per GPU)");
ABSL_FLAG(std::string, device_step, "auto",
          "where confkv/h2o steps run: on = scores and selection in the backend (device memory "
          "on cuda), off = policy code on the host, auto = on for cuda, off for cpu");
ABSL_FLAG(uint64_t, pool_bytes, 1ull << 30, "pool size in bytes; never grows");
ABSL_FLAG(bool, pool_prefault, true,
          "map the whole pool ahead of use on a background thread (cpu backend), so that "
          "Appends do not page-fault on fresh pool memory");
ABSL_FLAG(uint64_t, page_bytes, 64 * 1024, "pool page size; a block must fit one page");
ABSL_FLAG(uint32_t, block_tokens, 16, "default tokens per block");
ABSL_FLAG(uint32_t, max_sequences, 1024, "most sequences held at once");
ABSL_FLAG(uint32_t, lease_seconds, 60, "default lease of a sequence; renewed by every call");
ABSL_FLAG(uint64_t, max_message_bytes, 64ull << 20, "K+V bytes one Append may carry");
ABSL_FLAG(uint64_t, host_metadata_bytes, 0,
          "host memory for the sequences' per-slot metadata outside the pool (positions, "
          "scores, signals); calls that would pass it are RESOURCE_EXHAUSTED; 0 = pool_bytes / 2 "
          "+ 64 MiB");
ABSL_FLAG(uint64_t, device_metadata_bytes, 0,
          "device memory for the slot states of the CUDA backend's device step (scores, "
          "positions, keep flags of every sequence, outside the pool); calls that would pass "
          "it are RESOURCE_EXHAUSTED; 0 = pool_bytes / 2 + 64 MiB");
ABSL_FLAG(bool, parallel_batches, true, "run a StepBatch's entries on every core");
ABSL_FLAG(bool, ucx, false,
          "run a UCX worker and register the pool and the epoch board for remote reads (RMA "
          "get; transports from UCX_TLS as usual), offered in GetInfo to callers that may read "
          "the pool (CPU backend)");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "publish the prefix index's blocks as vLLM-compatible KV events on this ZMQ PUB "
          "endpoint (tcp://127.0.0.1:5557, ipc:///path; empty: none)");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "with --kv-events-endpoint: a ZMQ ROUTER endpoint answering replay requests (empty: "
          "none)");
ABSL_FLAG(std::string, kv_events_topic, "", "with --kv-events-endpoint: the messages' topic");
ABSL_FLAG(std::string, kv_events_format, "array",
          "with --kv-events-endpoint: array (vLLM's positional array_like structs) or map");
ABSL_FLAG(std::string, kv_events_hash, "int",
          "with --kv-events-endpoint: int (a hash's last 8 bytes as a u64, vLLM's default) or "
          "bytes (the 32-byte sha256)");
ABSL_FLAG(bool, kv_events_trusted_network, false,
          "allow KV events endpoints beyond loopback (events carry every tenant's token ids)");
ABSL_FLAG(std::string, cluster_index, "",
          "share the prefix index's blocks with a fleet through this Redis/Valkey server "
          "(redis://[:password@]host[:port][/db] or unix:///path; empty: none; a password "
          "may come from KVMEM_CLUSTER_INDEX_PASSWORD instead), so that Lookup with `fleet` "
          "names the nodes that hold a prompt's longest prefix");
ABSL_FLAG(std::string, cluster_node_address, "",
          "with --cluster-index: the address routers and peers reach this kvmemd at "
          "(host:port), as the index names this node");
ABSL_FLAG(int64_t, cluster_index_ttl_seconds, 30,
          "with --cluster-index: a claim lapses this long after its last renewal (renewed "
          "every third of it); a node that dies leaves claims that lapse so");
ABSL_FLAG(int64_t, cluster_index_timeout_ms, 50,
          "with --cluster-index: how long a Lookup waits for the index before it answers "
          "without the fleet");
ABSL_FLAG(uint32_t, cluster_index_connections, 4,
          "with --cluster-index: connections kept for lookups (each serves one at a time)");
ABSL_FLAG(uint64_t, cluster_pull_max_bytes, 256ull << 20,
          "with --cluster-index: the K/V bytes one PullPrefix may hold (a longer prefix is "
          "refused)");
ABSL_FLAG(std::string, cluster_peers, "",
          "comma-separated node addresses (their --cluster-node-address) PullPrefix may pull "
          "from, when the fleet's index names them as holders (with --cluster-index), and "
          "MoveSequence may move sequences from; empty: neither. The caller's bearer token goes "
          "to them: trusted daemons sharing this daemon's token file only");
ABSL_FLAG(std::string, cluster_peer_token_file, "",
          "a file holding the token this daemon presents to --cluster-peers for their pool's "
          "UCX key, so that MoveSequence and PullPrefix get blocks by RMA (a token the peers' "
          "--auth-tokens name as a peer's, or an admin's; the peers run --ucx); empty: by gRPC");
ABSL_FLAG(std::string, cluster_peer_tls_ca, "",
          "TLS to --cluster-peers: the CA (PEM file) their server certificates are signed by "
          "(each must name the peer's host as --cluster-peers gives it, localhost for a unix: "
          "peer); empty: plaintext "
          "calls to peers, bearer tokens included. No client certificate is presented: peers "
          "that ask one (--tls-client-ca) cannot be moved or pulled from");
ABSL_FLAG(int32_t, cluster_pull_concurrency, 2,
          "with --cluster-index: PullPrefix calls that run at once (more are refused)");
ABSL_FLAG(bool, ucx_trusted_network, false,
          "with --ucx: acknowledges that over TCP and shared memory (RMA emulated in software) "
          "every process that reaches the UCX worker can read and write kvmemd's memory; "
          "--ucx is refused without it");
ABSL_FLAG(bool, in_place_writes, false,
          "StepBatch hands out write plans and commits K/V that same-host clients write into "
          "the pool themselves (the pool mapped writable): serve one trust domain only");
ABSL_FLAG(uint64_t, table_area_bytes, 0,
          "a shared-memory table area of this size, where same-host readers find every "
          "sequence's block table (StepBatch then names the version to read there instead of "
          "sending the update); 0 = none");
ABSL_FLAG(std::string, prefix_hash_seed, "0",
          "seed of the prefix block hash chain: vLLM's PYTHONHASHSEED, for block names "
          "that match a vLLM deployment's");
ABSL_FLAG(double, cache_high_watermark, 0.95,
          "fraction of pool pages in use above which cached prefix blocks (published, held by "
          "no sequence) are reclaimed in the background");
ABSL_FLAG(uint64_t, tenant_quota_bytes, 0,
          "pool bytes the sequences of one tenant (the authenticated tenant, else one cache "
          "salt) may hold, published blocks included until reclaimed; 0: no quota");
ABSL_FLAG(std::string, tenant_arena, "",
          "comma-separated <tenant>:<bytes>: a part of the pool (whole pages, taken from its "
          "end) for that authenticated tenant's blocks alone, a shared-memory segment of its "
          "own that its same-host clients map (read-write with --in-place-writes) instead of "
          "the pool; needs identities and the CPU backend");
ABSL_FLAG(uint32_t, tenant_max_sequences, 0,
          "sequences one tenant (see --tenant-quota-bytes) may hold at once; 0: no limit but "
          "--max-sequences");
ABSL_FLAG(uint64_t, tenant_host_metadata_bytes, 0,
          "host metadata (per-slot vectors, slot states) one tenant's sequences and calls in "
          "flight may hold, within --host-metadata-bytes; 0: no limit apart");
ABSL_FLAG(double, cache_low_watermark, 0.85,
          "fraction of pool pages in use the background reclaim brings the pool down to");
ABSL_FLAG(int64_t, reclaim_reserve_pages, -1,
          "free pool pages only quantization may take, so that a full pool can still quantize "
          "its way to free memory; -1 = about 1% of the pages");
ABSL_FLAG(uint64_t, max_stream_buffer_bytes, 256ull << 20,
          "request bytes of the chunks all AppendStreams are applying at once (each chunk is "
          "written to the pool as it arrives); past it a stream gets RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_append_streams, 16,
          "AppendStreams open at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_step_channels, 16,
          "same-host step channels (OpenStepChannel) open at once, each served by one thread; "
          "more get RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, step_channel_bytes, 256ull << 20,
          "memory all step channels may hold together: each its segment (twice its capacity), "
          "a request's copy and parse, and its answer as built and serialized (8 x its "
          "capacity in all)");
ABSL_FLAG(uint64_t, grpc_memory_bytes, 1ull << 30,
          "memory gRPC's transports may hold (its ResourceQuota)");
ABSL_FLAG(uint64_t, parse_memory_bytes, 1ull << 30,
          "most bytes that requests being served may take once parsed: each request's parse is "
          "bounded from its wire form and reserved before it is parsed (a request of tiny "
          "records parses into many times its size); past it, RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, grpc_max_threads, 256,
          "threads that run calls (gRPC ResourceQuota); calls past it get RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, request_id_entries, 100000,
          "responses of mutating calls kept so that a retry with the same request_id gets the "
          "first answer instead of applying twice");
ABSL_FLAG(uint32_t, request_id_seconds, 600, "how long a response is kept for retries");
ABSL_FLAG(uint32_t, max_read_streams, 32,
          "ReadKv streams open at once (each holds a thread while its client reads)");
ABSL_FLAG(double, read_stream_idle_seconds, 30,
          "a ReadKv stream whose client takes no piece for this long is cancelled");
ABSL_FLAG(uint32_t, tenant_max_calls, 0,
          "calls one tenant may have inside kvmemd at once (an open step channel, AppendStream "
          "or ReadKv counts for its life), past which a call is RESOURCE_EXHAUSTED; below "
          "--grpc-max-threads, no tenant can hold every thread; 0: no limit");
ABSL_FLAG(double, append_stream_idle_seconds, 60,
          "an AppendStream that sends nothing for this long is cancelled (it holds its "
          "sequence and reserved blocks while open)");
ABSL_FLAG(uint64_t, request_id_bytes, 64ull << 20, "most bytes of responses kept for retries");
ABSL_FLAG(uint64_t, ucx_max_payload_bytes, 256ull << 20,
          "with --ucx: the most K/V bytes one Append may announce as a UCX payload "
          "(AppendRequest.ucx_payload; reserved from --ucx-payload-memory-bytes while it lands)");
ABSL_FLAG(uint64_t, ucx_payload_memory_bytes, 1ull << 30,
          "with --ucx: the most bytes all announced UCX payloads may hold at once (a budget of "
          "their own, so that calls announcing payloads they never send hold up only other "
          "remote appends)");
ABSL_FLAG(double, ucx_payload_timeout_seconds, 30,
          "with --ucx: how long an Append that announces a UCX payload waits for it to land");
ABSL_FLAG(double, drain_seconds, 5,
          "on SIGTERM, how long calls already accepted may run before they are cancelled; new "
          "calls get UNAVAILABLE meanwhile");
ABSL_FLAG(std::string, auth_tokens, "",
          "a file of bearer tokens, one '<tenant> <token> [admin]' per line, read again on "
          "SIGHUP; every call must then carry 'authorization: Bearer <token>'. On a unix "
          "--listen, a line '<tenant> uid:<n> [admin]' makes the peers of that uid (SO_PEERCRED) "
          "that tenant without a token. Empty: one trust domain, served only on a unix socket "
          "or loopback");
ABSL_FLAG(std::string, tls_cert, "", "TLS: the server's certificate chain (PEM file)");
ABSL_FLAG(std::string, tls_key, "", "TLS: the server's private key (PEM file)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "TLS: require client certificates signed by this CA (PEM file); a certificate's "
          "common name is its tenant");
ABSL_FLAG(bool, allow_unauthenticated_remote, false,
          "serve a non-loopback --listen without --auth-tokens (anyone who reaches it can read "
          "and change every sequence)");
ABSL_FLAG(std::string, attach_socket, "",
          "where same-host clients receive the shared-memory segments' descriptors: @name "
          "(abstract unix socket) or a path; empty: an abstract name of its own");
ABSL_FLAG(std::string, attach_uids, "",
          "comma-separated uids whose processes may attach (SO_PEERCRED); empty: kvmemd's own");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");

namespace {
// Flags are documented with dashes (--pool-bytes); absl names them with underscores.
// Rewrites the name part of each "--flag[=value]" argument so both spellings work.
std::vector<char*> DashesToUnderscores(int argc, char** argv, std::vector<std::string>* storage) {
  storage->reserve(argc);
  std::vector<char*> out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && arg.rfind("--", 0) == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    storage->push_back(std::move(arg));
    out.push_back(storage->back().data());
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvmemd: KV-cache memory service for LLM inference");
  // No other process of kvmemd's user may read its memory or open its descriptors through
  // /proc (ptrace, /proc/<pid>/fd, mem): the segments go only to callers with a ticket.
  prctl(PR_SET_DUMPABLE, 0);
  std::vector<std::string> storage;
  std::vector<char*> args = DashesToUnderscores(argc, argv, &storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  // Abseil's lock-order graph costs every lock a lookup (a few % of a decode step); lock
  // order is checked where it is cheap: the tests, and the TSan build (scripts/tsan.sh).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Logs go to stderr; stdout carries only the READY line a supervisor waits for.
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvmemd"));
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));

  // Signals are taken by a dedicated sigwait, never by an async handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  kvmem::service::ServerConfig config;
  config.listen = absl::GetFlag(FLAGS_listen);
  config.auth_tokens = absl::GetFlag(FLAGS_auth_tokens);
  config.allow_unauthenticated_remote = absl::GetFlag(FLAGS_allow_unauthenticated_remote);
  config.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  config.tls_key = absl::GetFlag(FLAGS_tls_key);
  config.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  config.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  config.backend = absl::GetFlag(FLAGS_backend);
  config.device_step = absl::GetFlag(FLAGS_device_step);
  config.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  config.engine.pool_bytes = absl::GetFlag(FLAGS_pool_bytes);
  config.prefault_pool = absl::GetFlag(FLAGS_pool_prefault);
  config.engine.page_bytes = absl::GetFlag(FLAGS_page_bytes);
  config.engine.default_block_tokens = absl::GetFlag(FLAGS_block_tokens);
  config.engine.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  config.engine.default_lease = absl::Seconds(absl::GetFlag(FLAGS_lease_seconds));
  config.engine.max_append_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  config.engine.host_metadata_bytes = absl::GetFlag(FLAGS_host_metadata_bytes);
  config.engine.device_metadata_bytes = absl::GetFlag(FLAGS_device_metadata_bytes);
  config.engine.in_place_writes = absl::GetFlag(FLAGS_in_place_writes);
  config.ucx = absl::GetFlag(FLAGS_ucx);
  config.ucx_trusted_network = absl::GetFlag(FLAGS_ucx_trusted_network);
  config.kv_events.endpoint = absl::GetFlag(FLAGS_kv_events_endpoint);
  config.kv_events.replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint);
  config.kv_events.topic = absl::GetFlag(FLAGS_kv_events_topic);
  config.kv_events_format = absl::GetFlag(FLAGS_kv_events_format);
  config.kv_events_hash = absl::GetFlag(FLAGS_kv_events_hash);
  config.kv_events.trusted_network = absl::GetFlag(FLAGS_kv_events_trusted_network);
  config.cluster_index.url = absl::GetFlag(FLAGS_cluster_index);
  config.cluster_index.node = absl::GetFlag(FLAGS_cluster_node_address);
  config.cluster_index.ttl = absl::Seconds(absl::GetFlag(FLAGS_cluster_index_ttl_seconds));
  config.cluster_index.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_cluster_index_timeout_ms));
  config.cluster_index.lookup_connections = absl::GetFlag(FLAGS_cluster_index_connections);
  config.cluster_pull_max_bytes = absl::GetFlag(FLAGS_cluster_pull_max_bytes);
  config.cluster_pull_concurrency = absl::GetFlag(FLAGS_cluster_pull_concurrency);
  config.cluster_peer_token_file = absl::GetFlag(FLAGS_cluster_peer_token_file);
  config.cluster_peer_tls_ca = absl::GetFlag(FLAGS_cluster_peer_tls_ca);
  for (absl::string_view peer :
       absl::StrSplit(absl::GetFlag(FLAGS_cluster_peers), ',', absl::SkipEmpty())) {
    config.cluster_peers.emplace_back(peer);
  }
  config.engine.table_area_bytes = absl::GetFlag(FLAGS_table_area_bytes);
  config.engine.reclaim_reserve_pages = absl::GetFlag(FLAGS_reclaim_reserve_pages);
  config.engine.parallel_batches = absl::GetFlag(FLAGS_parallel_batches);
  config.engine.prefix_hash_seed = absl::GetFlag(FLAGS_prefix_hash_seed);
  config.engine.cache_high_watermark = absl::GetFlag(FLAGS_cache_high_watermark);
  config.engine.cache_low_watermark = absl::GetFlag(FLAGS_cache_low_watermark);
  config.engine.tenant_quota_bytes = absl::GetFlag(FLAGS_tenant_quota_bytes);
  config.engine.tenant_max_sequences = absl::GetFlag(FLAGS_tenant_max_sequences);
  config.engine.tenant_host_metadata_bytes = absl::GetFlag(FLAGS_tenant_host_metadata_bytes);
  config.limits.max_stream_buffer_bytes = absl::GetFlag(FLAGS_max_stream_buffer_bytes);
  config.limits.max_append_streams = absl::GetFlag(FLAGS_max_append_streams);
  config.limits.max_read_streams = absl::GetFlag(FLAGS_max_read_streams);
  config.limits.read_stream_idle = absl::Seconds(absl::GetFlag(FLAGS_read_stream_idle_seconds));
  config.limits.tenant_max_calls = absl::GetFlag(FLAGS_tenant_max_calls);
  config.limits.max_step_channels = absl::GetFlag(FLAGS_max_step_channels);
  config.limits.step_channel_bytes = absl::GetFlag(FLAGS_step_channel_bytes);
  config.limits.request_id_entries = absl::GetFlag(FLAGS_request_id_entries);
  config.limits.request_id_ttl = absl::Seconds(absl::GetFlag(FLAGS_request_id_seconds));
  config.limits.request_id_bytes = absl::GetFlag(FLAGS_request_id_bytes);
  config.limits.ucx_max_payload_bytes = absl::GetFlag(FLAGS_ucx_max_payload_bytes);
  config.limits.ucx_payload_memory_bytes = absl::GetFlag(FLAGS_ucx_payload_memory_bytes);
  config.limits.ucx_payload_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_ucx_payload_timeout_seconds));
  config.limits.append_stream_idle = absl::Seconds(absl::GetFlag(FLAGS_append_stream_idle_seconds));
  config.grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes);
  config.grpc_max_threads = absl::GetFlag(FLAGS_grpc_max_threads);
  config.parse_memory_bytes = absl::GetFlag(FLAGS_parse_memory_bytes);
  config.attach_socket = absl::GetFlag(FLAGS_attach_socket);
  for (absl::string_view arena :
       absl::StrSplit(absl::GetFlag(FLAGS_tenant_arena), ',', absl::SkipEmpty())) {
    const size_t colon = arena.rfind(':');
    uint64_t bytes = 0;
    if (colon == absl::string_view::npos || !absl::SimpleAtoi(arena.substr(colon + 1), &bytes)) {
      spdlog::error("kvmemd: --tenant-arena: \"{}\" is not <tenant>:<bytes>", std::string(arena));
      return 2;
    }
    config.engine.tenant_arenas.emplace_back(
        std::string(absl::StripAsciiWhitespace(arena.substr(0, colon))), bytes);
  }
  for (absl::string_view uid :
       absl::StrSplit(absl::GetFlag(FLAGS_attach_uids), ',', absl::SkipEmpty())) {
    uint32_t value = 0;
    if (!absl::SimpleAtoi(uid, &value)) {
      spdlog::error("kvmemd: --attach-uids: \"{}\" is not a uid", std::string(uid));
      return 2;
    }
    config.attach_uids.push_back(value);
  }

  // One thread takes the signals, from before the pool is allocated (seconds for a large
  // one): SIGTERM or SIGINT while kvmemd starts ends it there, before it serves (its
  // segments have no names: their memory goes with the process); once Start has returned,
  // they drain it (main, below) and SIGHUP reloads the tokens.
  std::atomic<kvmem::service::Server*> serving{nullptr};
  absl::Notification stop;
  std::atomic<int> stop_signal{0};
  std::atomic<bool> stopping{false};
  std::thread signal_thread([&] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0) {
      kvmem::service::Server* server = serving.load();
      if (sig == SIGHUP && server == nullptr) {
        spdlog::info(
            "kvmemd: SIGHUP while starting: ignored (the tokens are read as kvmemd starts)");
      } else if (sig == SIGHUP) {
        const absl::Status reloaded = server->ReloadTokens();
        if (reloaded.ok()) {
          spdlog::info("kvmemd: SIGHUP: tokens read again from {}", config.auth_tokens);
        } else {
          spdlog::warn("kvmemd: SIGHUP: tokens kept as they were: {}", reloaded.ToString());
        }
      } else if (server == nullptr) {
        stopping = true;  // main, if Start fails for it, leaves the exit to this thread
        spdlog::info("kvmemd: signal {} received while starting: stopped before serving", sig);
        spdlog::default_logger()->flush();
        std::_Exit(0);
      } else {
        stop_signal = sig;
        stop.Notify();
        return;
      }
    }
  });
  spdlog::info("kvmemd: starting (pool of {} bytes)", config.engine.pool_bytes);
  absl::StatusOr<std::unique_ptr<kvmem::service::Server>> server =
      kvmem::service::Server::Start(config);
  if (!server.ok()) {
    // A stop while starting: that thread ends kvmemd, and says why.
    while (stopping) std::this_thread::sleep_for(std::chrono::seconds(1));
    spdlog::error("kvmemd: {}", server.status().ToString());
    spdlog::default_logger()->flush();
    std::_Exit(2);  // the signal thread still waits
  }
  serving = server->get();  // it serves from here: a SIGTERM drains it
  const auto& info = (*server)->engine();
  spdlog::info("kvmemd listening on {} (port {}), backend {} ({}), pool {} bytes", config.listen,
               (*server)->port(), std::string(info.backend().kind()), info.backend().device_name(),
               info.config().pool_bytes);
  if ((*server)->metrics_port() != 0) {
    spdlog::info("kvmemd: /metrics on port {}", (*server)->metrics_port());
  }
  // A line a supervising script can wait for; port=0 when kvmemd listens on a unix socket.
  const bool unix_socket = absl::StartsWith(config.listen, "unix:");
  std::printf("READY port=%d metrics_port=%d listen=%s\n", unix_socket ? 0 : (*server)->port(),
              (*server)->metrics_port(), config.listen.c_str());
  std::fflush(stdout);

  stop.WaitForNotification();
  signal_thread.join();
  spdlog::info("kvmemd: signal {} received, draining", stop_signal.load());
  (*server)->Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  server->reset();
  spdlog::info("kvmemd: drained, exiting");
  return 0;
}
