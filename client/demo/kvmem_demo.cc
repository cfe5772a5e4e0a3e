// kvmem_demo: drives a running kvmemd the way a worker would, with synthetic K/V.
// Creates a `window` sequence (4 layers x 2 KV heads x head_dim 64, f16), appends a prompt,
// decodes step by step (append one token, Step), and prints what the daemon holds: the
// block table of one stream and the KV bytes against what a full cache would hold.
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50551", "kvmemd address");
ABSL_FLAG(uint32_t, prompt_tokens, 200, "prompt length");
ABSL_FLAG(uint32_t, decode_steps, 100, "decode steps after the prompt");
ABSL_FLAG(uint32_t, window, 64, "window policy: tokens kept per stream");

namespace {

using kvmem::client::Layout;

// Synthetic K/V: every element of token t encodes t, so what comes back can be checked.
std::string Payload(const Layout& layout, int64_t first, uint32_t n, uint16_t salt) {
  std::vector<uint16_t> data(size_t{layout.num_layers} * layout.num_kv_heads * n * layout.head_dim);
  size_t i = 0;
  for (uint32_t s = 0; s < layout.num_layers * layout.num_kv_heads; ++s) {
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t d = 0; d < layout.head_dim; ++d) {
        data[i++] = static_cast<uint16_t>((first + t) * 7 + s + salt);
      }
    }
  }
  return std::string(reinterpret_cast<const char*>(data.data()), data.size() * 2);
}

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvmem_demo: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto client = kvmem::client::Client::Connect(absl::GetFlag(FLAGS_target));
  if (!client.ok()) return Fail("connect", client.status());
  auto info = (*client)->GetInfo();
  if (!info.ok()) return Fail("GetInfo", info.status());
  std::printf("kvmemd %s, backend %s, pool %llu MiB\n", info->version.c_str(),
              info->backend.c_str(), static_cast<unsigned long long>(info->pool_bytes >> 20));

  const Layout layout{4, 2, 64, kvmem::client::DType::kF16, 16, 32000};
  const uint32_t window = absl::GetFlag(FLAGS_window);
  auto seq = (*client)->CreateSequence(layout, {"window", {{"window", double(window)}}});
  if (!seq.ok()) return Fail("CreateSequence", seq.status());
  std::printf("sequence %llu: policy window(W=%u), %u layers x %u KV heads x head_dim %u, f16\n",
              static_cast<unsigned long long>(seq->id), window, layout.num_layers,
              layout.num_kv_heads, layout.head_dim);

  const uint32_t prompt = absl::GetFlag(FLAGS_prompt_tokens);
  std::vector<int64_t> positions(prompt);
  std::iota(positions.begin(), positions.end(), 0);
  const std::string k = Payload(layout, 0, prompt, 0), v = Payload(layout, 0, prompt, 1);
  auto appended = (*client)->Append(seq->id, {positions, {}, k, v, {}, {}});
  if (!appended.ok()) return Fail("Append", appended.status());
  std::printf("prefill: appended %u tokens, KV bytes %llu\n", prompt,
              static_cast<unsigned long long>(appended->kv_bytes));

  uint64_t evicted = 0;
  kvmem::client::StepResult last;
  const uint32_t steps = absl::GetFlag(FLAGS_decode_steps);
  for (uint32_t t = 0; t < steps; ++t) {
    const int64_t pos = prompt + t;
    const std::string kt = Payload(layout, pos, 1, 0), vt = Payload(layout, pos, 1, 1);
    auto a = (*client)->Append(seq->id, {absl::MakeConstSpan(&pos, 1), {}, kt, vt, {}, {}});
    if (!a.ok()) return Fail("Append", a.status());
    auto step = (*client)->Step(seq->id, {});
    if (!step.ok()) return Fail("Step", step.status());
    evicted += step->evicted_tokens;
    last = *step;
  }
  const uint64_t total = prompt + steps;
  const uint64_t full_bytes =
      total * layout.num_layers * layout.num_kv_heads * 2 * layout.head_dim * 2;
  // A step's evicted_tokens counts stream slots; a token leaves every stream here.
  const uint32_t streams = layout.num_layers * layout.num_kv_heads;
  std::printf("decode: %u steps, %.1f tokens evicted (%llu stream slots), epoch %llu\n", steps,
              double(evicted) / streams, static_cast<unsigned long long>(evicted),
              static_cast<unsigned long long>(last.epoch));

  auto table = (*client)->GetBlockTable(seq->id);
  if (!table.ok()) return Fail("GetBlockTable", table.status());
  const auto& st = table->streams[0];
  std::printf("block table (layer 0, kv_head 0), epoch %llu, %u tokens per block:\n",
              static_cast<unsigned long long>(table->epoch), table->block_tokens);
  size_t first = 0;
  for (const auto& b : st.blocks) {
    std::printf("  block %-6u offset %-10llu slots [%2u, %2u)  positions %lld..%lld\n", b.id,
                static_cast<unsigned long long>(b.offset), b.start, b.start + b.count,
                static_cast<long long>(st.positions[first]),
                static_cast<long long>(st.positions[first + b.count - 1]));
    first += b.count;
  }

  // Same-host zero-copy read of that stream, checked against what was appended.
  if (info->shm_bytes != 0) {
    auto pool = kvmem::client::SharedPool::Attach(*info);
    if (!pool.ok()) return Fail("attach", pool.status());
    std::string k0, v0;
    if (auto s = (*pool)->ReadStream(*table, 0, 0, &k0, &v0); !s.ok()) return Fail("read", s);
    const std::string want = Payload(layout, st.positions.front(), 1, 0);
    const bool ok = std::memcmp(k0.data(), want.data(), layout.head_dim * 2) == 0;
    std::printf("same-host read of stream (0,0): %zu tokens in place, first token %s\n",
                k0.size() / (layout.head_dim * 2), ok ? "matches" : "DIFFERS");
    if (!ok) return 1;
  }

  auto stats = (*client)->GetStats(true);
  if (!stats.ok()) return Fail("Stats", stats.status());
  std::printf(
      "memory held: %llu KV bytes for %llu tokens (full cache would hold %llu: %.1f%% "
      "saved); pool %llu blocks in use\n",
      static_cast<unsigned long long>(last.kv_bytes_after), static_cast<unsigned long long>(total),
      static_cast<unsigned long long>(full_bytes),
      100.0 * (1.0 - double(last.kv_bytes_after) / double(full_bytes)),
      static_cast<unsigned long long>(stats->blocks_used));
  auto freed = (*client)->Release(seq->id);
  if (!freed.ok()) return Fail("Release", freed.status());
  std::printf("released: %llu blocks returned to the pool\n",
              static_cast<unsigned long long>(*freed));
  return 0;
}
