// A whole sequence moved between two kvmemd (MoveSequence, daemon to daemon), the holder a
// kvmemd process, the receiver in this one: an 8k-token Llama-8B-shape sequence (32x8x128 f16, 1
// GiB of K/V, by default), moved from the holder to the receiver by gRPC (the blocks in the
// export's messages), by UCX over TCP and by UCX over shared memory (RMA gets from the holder's
// pool), and copied out of the holder's pool mapped read-only (attach: the same host), each
// repeated --repeats times (the holder gets the sequence again between moves, untimed).
// GB/s = 1e9 block bytes per second of the MoveSequence call, the commit and the holder's
// release included. UCX_TLS picks the receiver's transports (a receiver per row); the
// holder's worker offers tcp and sm. The first move of a row connects to (or maps) the
// holder's pool; the others reuse it (best: the fastest move; mean: all of them).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvmem/client.h"
#include "server/service/server.h"
#include "tests/testing/kvmemd_process.h"

ABSL_FLAG(uint32_t, tokens, 8192, "tokens of the moved sequence");
ABSL_FLAG(uint32_t, layers, 32, "the layout's layers");
ABSL_FLAG(uint32_t, heads, 8, "the layout's KV heads");
ABSL_FLAG(uint32_t, dim, 128, "the layout's head dimension");
ABSL_FLAG(int, repeats, 3, "moves per transport");
ABSL_FLAG(std::string, kvmemd, KVMEMD_PATH, "the kvmemd binary the holder runs");
ABSL_FLAG(std::string, rows, "grpc,ucx-tcp,ucx-sm,attach",
          "the rows to run (grpc, ucx-tcp, ucx-sm, attach), comma-separated (one alone, for a "
          "profiler)");

namespace {

using kvmem::client::Client;

constexpr char kPeerToken[] = "move-bench-peer-token-0123456789";

std::unique_ptr<kvmem::service::Server> Start(uint64_t pool_bytes, std::vector<std::string> peers,
                                              const std::string& tokens,
                                              const std::string& peer_token_file) {
  kvmem::service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = pool_bytes;
  config.engine.max_sequences = 16;
  config.engine.max_append_bytes = 64ull << 20;
  config.ucx = config.ucx_trusted_network = peers.empty();  // the holder offers its pool
  config.prefault_pool = true;
  config.auth_tokens = tokens;
  config.cluster_peers = std::move(peers);
  config.cluster_peer_token_file = peer_token_file;
  config.cluster_pull_max_bytes = pool_bytes;
  auto server = kvmem::service::Server::Start(config);
  if (!server.ok()) {
    std::fprintf(stderr, "kvmemd: %s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  while (!(*server)->prefault_ended()) absl::SleepFor(absl::Milliseconds(20));
  if ((*server)->prefaulted_bytes() < pool_bytes) {
    std::fprintf(stderr, "the pool is not prefaulted (%llu of %llu bytes): page faults count\n",
                 static_cast<unsigned long long>((*server)->prefaulted_bytes()),
                 static_cast<unsigned long long>(pool_bytes));
  }
  return *std::move(server);
}

std::unique_ptr<Client> Connect(const std::string& address) {
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(300);
  options.auth_token = kPeerToken;
  return *Client::Connect(address, options);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  setenv("UCX_LOG_LEVEL", "fatal", 0);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  const uint32_t T = absl::GetFlag(FLAGS_tokens), L = absl::GetFlag(FLAGS_layers),
                 H = absl::GetFlag(FLAGS_heads), D = absl::GetFlag(FLAGS_dim);
  const uint64_t token_bytes = uint64_t{L} * H * D * 2 * 2;
  const uint64_t kv_bytes = token_bytes * T;
  const uint64_t pool_bytes = kv_bytes + kv_bytes / 8 + (64ull << 20);
  const std::string dir = std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "/tmp";
  const std::string tokens = absl::StrCat(dir, "/kvmem_move_bench_tokens.", getpid());
  const std::string peer = absl::StrCat(dir, "/kvmem_move_bench_peer.", getpid());
  std::ofstream(tokens) << "fleet " << kPeerToken << " admin\n";
  std::ofstream(peer) << kPeerToken << "\n";

  // The holder: a kvmemd process of its own (as UCX's perftest runs its two sides), its
  // worker offering TCP and shared memory. Its pool is not prefaulted: the prefill (untimed)
  // writes the pages the moves read.
  setenv("UCX_TLS", "tcp,sm,self", 1);
  kvmem::testing::KvmemdProcess holder = kvmem::testing::StartKvmemd(
      absl::GetFlag(FLAGS_kvmemd).c_str(),
      {"--listen=127.0.0.1:0", absl::StrCat("--pool_bytes=", pool_bytes), "--max_sequences=16",
       "--max_message_bytes=67108864", "--ucx", "--ucx_trusted_network", "--pool_prefault=false",
       absl::StrCat("--auth_tokens=", tokens), "--log-level=warn"});
  if (holder.port == 0) {
    std::fprintf(stderr, "the holder kvmemd did not start\n");
    return 1;
  }
  const std::string holder_address = absl::StrCat("127.0.0.1:", holder.port);
  std::unique_ptr<Client> on_holder = Connect(holder_address);

  // The sequence, prefilled on the holder in 8 MiB chunks of whole tokens.
  const kvmem::client::Layout layout{L, H, D, kvmem::client::DType::kF16, 16, 49152};
  const uint32_t per_chunk =
      std::max<uint32_t>(1, static_cast<uint32_t>((8ull << 20) / token_bytes));
  std::string k(uint64_t{L} * H * per_chunk * D * 2, '\0'), v(k.size(), '\0');
  for (size_t i = 0; i < k.size(); i += 2) {
    k[i] = static_cast<char>(i * 7);
    k[i + 1] = 0x3c;
    v[i] = static_cast<char>(i * 13);
    v[i + 1] = 0x3b;
  }
  const auto prefill = [&]() -> uint64_t {
    auto seq = on_holder->CreateSequence(layout, {"full", {}});
    if (!seq.ok()) {
      std::fprintf(stderr, "CreateSequence: %s\n", seq.status().ToString().c_str());
      std::exit(1);
    }
    std::vector<int64_t> positions;
    for (uint32_t t = 0; t < T; t += per_chunk) {
      const uint32_t n = std::min(per_chunk, T - t);
      positions.resize(n);
      for (uint32_t i = 0; i < n; ++i) positions[i] = t + i;
      const uint64_t bytes = uint64_t{L} * H * n * D * 2;
      // (The bytes' layout does not matter here, only their amount.)
      auto a = on_holder->Append(seq->id, {positions,
                                           {},
                                           std::string_view(k).substr(0, bytes),
                                           std::string_view(v).substr(0, bytes),
                                           {},
                                           {}});
      if (!a.ok()) {
        std::fprintf(stderr, "Append: %s\n", a.status().ToString().c_str());
        std::exit(1);
      }
    }
    return seq->id;
  };

  std::printf(
      "# MoveSequence of a %u-token %ux%ux%u f16 sequence (%.0f MiB of K/V), %d moves each\n", T, L,
      H, D, static_cast<double>(kv_bytes) / (1 << 20), absl::GetFlag(FLAGS_repeats));
  std::printf("%-10s %-10s %10s %10s %10s\n", "transport", "UCX_TLS", "GB/s best", "GB/s mean",
              "ms best");
  struct Row {
    const char* name;
    const char* transport;
    const char* tls;
  };
  const std::vector<std::string> rows = absl::StrSplit(absl::GetFlag(FLAGS_rows), ',');
  for (const Row& row : {Row{"grpc", "grpc", "tcp,sm,self"}, Row{"ucx-tcp", "ucx", "tcp"},
                         Row{"ucx-sm", "ucx", "sm,self"}, Row{"attach", "attach", "-"}}) {
    if (std::find(rows.begin(), rows.end(), row.name) == rows.end()) continue;
    // A receiver per row: it keeps its connection to the holder's pool (made with the
    // UCX_TLS of its first move) for the next.
    if (std::string_view(row.tls) != "-") setenv("UCX_TLS", row.tls, 1);
    std::unique_ptr<kvmem::service::Server> receiver =
        Start(pool_bytes, {holder_address}, tokens, peer);
    std::unique_ptr<Client> on_receiver = Connect(absl::StrCat("127.0.0.1:", receiver->port()));
    double best = 0, sum = 0, best_ms = 0;
    const int repeats = absl::GetFlag(FLAGS_repeats);
    for (int i = 0; i < repeats; ++i) {
      const uint64_t id = prefill();
      const absl::Time start = absl::Now();
      auto moved = on_receiver->MoveSequence(holder_address, id, std::nullopt, row.transport);
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      if (!moved.ok() || moved->transport != row.transport || !moved->source_released) {
        std::fprintf(stderr, "MoveSequence (%s, %s): %s\n", row.transport, row.tls,
                     moved.ok() ? moved->transport.c_str() : moved.status().ToString().c_str());
        std::exit(1);
      }
      const double gbs = static_cast<double>(moved->bytes) / seconds / 1e9;
      if (gbs > best) {
        best = gbs;
        best_ms = seconds * 1e3;
      }
      sum += gbs;
      (void)on_receiver->Release(moved->sequence.id);
    }
    std::printf("%-10s %-10s %10.2f %10.2f %10.1f\n", row.transport, row.tls, best, sum / repeats,
                best_ms);
  }
  std::remove(tokens.c_str());
  std::remove(peer.c_str());
  kill(holder.pid, SIGTERM);
  kvmem::testing::WaitExit(holder.pid);
  return 0;
}
