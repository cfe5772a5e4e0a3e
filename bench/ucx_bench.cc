// Moving K/V in and out of kvmemd, the same bytes by every path in one run: appends by gRPC
// (the K/V in the request, over loopback TCP) and by UCX active messages (kvmem/
// ucx_sender.h, over UCX's TCP and over its shared memory), reads by gRPC ReadKv, by UCX RMA
// (kvmem/ucx_pool.h) and by same-host attach (kvmem/shared_pool.h), against Redis SET/GET of
// the same bytes (a redis-server of the bench's own, on a unix socket) and memcpy. Chunks of
// about 64 KiB and 1 MiB (whole tokens, so a Llama-8B-shape token of 128 KiB is its smallest
// chunk), SmolLM2 (30x3x64) and Llama-8B (32x8x128) f16 layouts. GB/s = 1e9 bytes per
// second of K+V moved, each path repeated for at least --seconds.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"
#include "kvmem/ucx_pool.h"
#include "kvmem/ucx_sender.h"
#include "server/service/server.h"
#include "tests/testing/redis_server.h"

ABSL_FLAG(double, seconds, 0.5, "least time each path of each row is repeated for");
ABSL_FLAG(std::string, only, "",
          "time only these paths (comma-separated: memcpy, append_grpc, append_ucx_tcp, "
          "append_ucx_sm, redis, reads), e.g. for a profiler; the others print -");

namespace {

using kvmem::client::Client;

struct Shape {
  const char* name;
  uint32_t layers, heads, dim;
  uint64_t token_bytes() const { return uint64_t{layers} * heads * dim * 2 * 2; }  // K+V, f16
};

struct Daemon {
  std::unique_ptr<kvmem::service::Server> server;
  std::unique_ptr<Client> client;
  std::unique_ptr<kvmem::client::UcxSender> sender;
  std::unique_ptr<kvmem::client::UcxPool> pool;
  std::unique_ptr<kvmem::client::SharedPool> attached;
};

// kvmemd in this process with --ucx over `tls` (UCX_TLS), gRPC on loopback TCP.
Daemon Start(const char* tls) {
  setenv("UCX_TLS", tls, 1);
  kvmem::service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 2ull << 30;
  config.engine.max_sequences = 64;
  config.engine.max_append_bytes = 64ull << 20;
  config.limits.ucx_max_payload_bytes = 64ull << 20;
  config.ucx = config.ucx_trusted_network = true;
  config.prefault_pool = true;  // as kvmemd does by default
  Daemon d;
  auto server = kvmem::service::Server::Start(config);
  if (!server.ok()) {
    std::fprintf(stderr, "kvmemd: %s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  d.server = *std::move(server);
  while (d.server->prefaulted_bytes() < config.engine.pool_bytes) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(60);
  d.client = *Client::Connect(absl::StrCat("127.0.0.1:", d.server->port()), options);
  const kvmem::client::Info info = *d.client->GetInfo();
  d.sender = *kvmem::client::UcxSender::Connect(info);
  d.pool = *kvmem::client::UcxPool::Connect(info);
  d.attached = *kvmem::client::SharedPool::Attach(info);
  return d;
}

// Runs `once` (which moves `bytes`) until `seconds` have passed and at least 5 times;
// GB/s over all of it.
double Rate(uint64_t bytes, const std::function<bool()>& once) {
  const absl::Duration least = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  uint64_t n = 0;
  const absl::Time start = absl::Now();
  absl::Duration spent;
  do {
    if (!once()) return -1;
    ++n;
    spent = absl::Now() - start;
  } while (n < 5 || spent < least);
  return static_cast<double>(bytes * n) / absl::ToDoubleSeconds(spent) / 1e9;
}

std::string Cell(double gbs) {
  if (std::isnan(gbs)) return "-";
  return gbs < 0 ? "failed" : absl::StrFormat("%.2f", gbs);
}

bool Timed(absl::string_view path) {
  const std::string only = absl::GetFlag(FLAGS_only);
  if (only.empty()) return true;
  for (absl::string_view p : absl::StrSplit(only, ',')) {
    if (p == path) return true;
  }
  return false;
}

// One chunk's K/V as a worker holds it: [L][H][n][D] halves, finite values.
struct Chunk {
  std::vector<int64_t> positions;
  std::string k, v;
};

Chunk MakeChunk(const Shape& shape, uint32_t tokens) {
  Chunk c;
  c.k.resize(uint64_t{shape.layers} * shape.heads * tokens * shape.dim * 2);
  c.v.resize(c.k.size());
  for (size_t i = 0; i < c.k.size(); i += 2) {
    c.k[i] = static_cast<char>(i * 7);
    c.k[i + 1] = 0x3c;
    c.v[i] = static_cast<char>(i * 13);
    c.v[i + 1] = 0x3b;
  }
  c.positions.resize(tokens);
  return c;
}

// Appends `c` again and again to one sequence (a new one each 256 MiB), by `append`.
double AppendRate(Daemon& d, const Shape& shape, Chunk& c,
                  const std::function<bool(uint64_t, const kvmem::client::AppendArgs&)>& append) {
  const kvmem::client::Layout layout{
      shape.layers, shape.heads, shape.dim, kvmem::client::DType::kF16, 16, 49152};
  uint64_t id = 0;
  int64_t next = 0;
  const uint64_t bytes = c.k.size() + c.v.size();
  const double rate = Rate(bytes, [&] {
    if (id == 0 || next * shape.token_bytes() > (256ull << 20)) {
      if (id != 0) (void)d.client->Release(id);
      auto seq = d.client->CreateSequence(layout, {"full", {}});
      if (!seq.ok()) return false;
      id = seq->id;
      next = 0;
    }
    for (int64_t& p : c.positions) p = next++;
    return append(id, {c.positions, {}, c.k, c.v, {}, {}});
  });
  if (id != 0) (void)d.client->Release(id);
  return rate;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  setenv("UCX_LOG_LEVEL", "fatal", 0);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  kvmem::testing::RedisServer redis;
  redisContext* r = nullptr;
  if (redis.Start()) {
    r = redisConnectUnix(redis.url().substr(std::strlen("unix://")).c_str());
    if (r != nullptr && r->err != 0) r = nullptr;
  }
  Daemon tcp = Start("tcp");
  Daemon shm = Start("sm,self");
  std::string far_src(256 << 20, 'k'), far_dst(256 << 20, '\0');
  const Shape shapes[] = {{"SmolLM2 30x3x64", 30, 3, 64}, {"Llama-8B 32x8x128", 32, 8, 128}};
  std::printf(
      "K+V moved per second, GB/s (1e9 bytes); kvmemd in this process, gRPC over loopback TCP, "
      "UCX over its tcp or sm transport, Redis on a unix socket\n\n");
  std::printf(
      "| shape | chunk | memcpy | append: gRPC | UCX tcp | UCX sm | Redis SET | read: gRPC "
      "ReadKv | UCX tcp | UCX sm | attach | Redis GET |\n|---|---|---|---|---|---|---|---|---|---|"
      "---|---|\n");
  for (const Shape& shape : shapes) {
    for (uint64_t target : {uint64_t{64} << 10, uint64_t{1} << 20}) {
      const uint32_t tokens = static_cast<uint32_t>(
          std::max<uint64_t>(1, (target + shape.token_bytes() / 2) / shape.token_bytes()));
      Chunk c = MakeChunk(shape, tokens);
      const uint64_t bytes = c.k.size() + c.v.size();
      // memcpy between two 256 MiB regions, a chunk at a time at the next offset: the
      // bytes come from and go to memory, not the cache, as the pool's do.
      const double skipped = std::nan("");
      const double memcpy_rate =
          !Timed("memcpy") ? skipped : Rate(bytes, [&, at = uint64_t{0}]() mutable {
            if (at + bytes > far_src.size()) at = 0;
            std::memcpy(far_dst.data() + at, far_src.data() + at, bytes);
            at += bytes;
            return far_dst[at - 1] != 1;  // keeps the copies
          });
      const double grpc_append =
          !Timed("append_grpc") ? skipped
                                : AppendRate(tcp, shape, c, [&](uint64_t id, const auto& args) {
                                    return tcp.client->Append(id, args).ok();
                                  });
      double ucx_append[2];
      Daemon* daemons[2] = {&tcp, &shm};
      for (int i = 0; i < 2; ++i) {
        Daemon& d = *daemons[i];
        ucx_append[i] = skipped;
        if (!Timed(i == 0 ? "append_ucx_tcp" : "append_ucx_sm")) continue;
        ucx_append[i] = AppendRate(d, shape, c, [&](uint64_t id, const auto& args) {
          auto appended = d.sender->Append(*d.client, id, args);
          if (!appended.ok()) std::fprintf(stderr, "%s\n", appended.status().ToString().c_str());
          return appended.ok();
        });
      }
      std::string kv = c.k + c.v;
      double redis_set = -1, redis_get = -1;
      if (!Timed("redis")) redis_set = redis_get = skipped;
      if (r != nullptr && Timed("redis")) {
        redis_set = Rate(bytes, [&] {
          auto* reply =
              static_cast<redisReply*>(redisCommand(r, "SET kvmem-bench %b", kv.data(), kv.size()));
          const bool ok = reply != nullptr && reply->type == REDIS_REPLY_STATUS;
          freeReplyObject(reply);
          return ok;
        });
        redis_get = Rate(bytes, [&] {
          auto* reply = static_cast<redisReply*>(redisCommand(r, "GET kvmem-bench"));
          const bool ok = reply != nullptr && reply->type == REDIS_REPLY_STRING &&
                          reply->len == static_cast<size_t>(bytes);
          freeReplyObject(reply);
          return ok;
        });
      }
      // Reads: one sequence holding exactly the chunk, read whole.
      double reads[4] = {skipped, skipped, skipped, skipped};
      if (Timed("reads")) {
        const kvmem::client::Layout layout{
            shape.layers, shape.heads, shape.dim, kvmem::client::DType::kF16, 16, 49152};
        for (int64_t i = 0; i < tokens; ++i) c.positions[i] = i;
        uint64_t ids[2];
        for (int i = 0; i < 2; ++i) {
          ids[i] = daemons[i]->client->CreateSequence(layout, {"full", {}})->id;
          if (!daemons[i]->client->Append(ids[i], {c.positions, {}, c.k, c.v, {}, {}}).ok()) {
            return 1;
          }
        }
        reads[0] = Rate(bytes, [&] { return tcp.client->ReadKv(ids[0]).ok(); });
        for (int i = 0; i < 2; ++i) {
          const kvmem::client::BlockTable table = *daemons[i]->client->GetBlockTable(ids[i]);
          reads[1 + i] = Rate(bytes, [&] { return daemons[i]->pool->ReadStreams(table).ok(); });
        }
        const kvmem::client::BlockTable table = *tcp.client->GetBlockTable(ids[0]);
        reads[3] = Rate(bytes, [&] { return tcp.attached->ReadStreams(table).ok(); });
        for (int i = 0; i < 2; ++i) (void)daemons[i]->client->Release(ids[i]);
      }
      std::printf("| %s | %u tokens, %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                  shape.name, tokens,
                  bytes >= (1 << 20) ? absl::StrFormat("%.2f MiB", bytes / 1048576.0).c_str()
                                     : absl::StrFormat("%.0f KiB", bytes / 1024.0).c_str(),
                  Cell(memcpy_rate).c_str(), Cell(grpc_append).c_str(), Cell(ucx_append[0]).c_str(),
                  Cell(ucx_append[1]).c_str(), Cell(redis_set).c_str(), Cell(reads[0]).c_str(),
                  Cell(reads[1]).c_str(), Cell(reads[2]).c_str(), Cell(reads[3]).c_str(),
                  Cell(redis_get).c_str());
      std::fflush(stdout);
    }
  }
  if (r != nullptr) redisFree(r);
  return 0;
}
