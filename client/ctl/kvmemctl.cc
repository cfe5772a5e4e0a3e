// kvmemctl: look inside a running kvmemd.
//   kvmemctl [--target=HOST:PORT|unix:PATH] info|stats|sequences
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "kvmem/client.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50551", "kvmemd address: HOST:PORT or unix:PATH");
ABSL_FLAG(std::string, auth_token_file, "",
          "a file holding the bearer token of a kvmemd with --auth-tokens (first line)");

namespace {

constexpr char kUsage[] = "usage: kvmemctl [--target=HOST:PORT|unix:PATH] info|stats|sequences";

std::string Bytes(uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1ull << 30));
  } else if (b >= (1ull << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / double(1ull << 20));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  }
  return buf;
}

int Info(kvmem::client::Client& client) {
  absl::StatusOr<kvmem::client::Info> info = client.GetInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "kvmemctl info: %s\n", info.status().ToString().c_str());
    return 1;
  }
  std::printf("kvmemd %s\n", info->version.c_str());
  std::printf("backend          %s (%s)\n", info->backend.c_str(), info->device_name.c_str());
  std::printf("pool             %s total, %s free, pages of %s\n", Bytes(info->pool_bytes).c_str(),
              Bytes(info->pool_free_bytes).c_str(), Bytes(info->page_bytes).c_str());
  std::printf("block tokens     %u (default)\n", info->default_block_tokens);
  std::printf("max sequences    %u\n", info->max_sequences);
  std::printf("lease            %s (default), at most %s\n",
              absl::FormatDuration(info->default_lease).c_str(),
              absl::FormatDuration(info->max_lease).c_str());
  std::printf("max message      %s of K+V per Append\n", Bytes(info->max_message_bytes).c_str());
  std::printf("policy steps     %s\n", info->device_step
                                           ? "in the backend (scores in device memory)"
                                           : "in host policy code");
  std::printf("same-host attach %s\n",
              !info->cuda_ipc_handle.empty() ? "CUDA IPC"
              : info->attach.ticket.empty()
                  ? "none"
                  : ("shared memory by descriptor at " + info->attach.socket).c_str());
  std::printf("policies:\n");
  for (const auto& p : info->policies) {
    std::printf("  %-14s %s\n", p.name.c_str(), p.description.c_str());
    for (const auto& param : p.params) {
      std::printf("    %-16s default %-10g range [%.10g, %.10g]  %s\n", param.name.c_str(),
                  param.default_value, param.min_value, param.max_value, param.description.c_str());
    }
    if (!p.step_signals.empty()) {
      std::printf("    step signals: %s\n", absl::StrJoin(p.step_signals, ", ").c_str());
    }
    if (!p.compress_signals.empty()) {
      std::printf("    compress signals: %s\n", absl::StrJoin(p.compress_signals, ", ").c_str());
    }
    if (!p.append_signals.empty()) {
      std::printf("    append signals: %s\n", absl::StrJoin(p.append_signals, ", ").c_str());
    }
  }
  std::printf("quantizers (recent window %u tokens by default):\n",
              info->default_quantization_recent_tokens);
  for (const auto& q : info->quantizers) {
    std::printf("  %-14s %s\n", q.name.c_str(), q.description.c_str());
  }
  return 0;
}

int Stats(kvmem::client::Client& client, bool sequences) {
  absl::StatusOr<kvmem::client::Stats> stats = client.GetStats(sequences);
  if (!stats.ok()) {
    std::fprintf(stderr, "kvmemctl: %s\n", stats.status().ToString().c_str());
    return 1;
  }
  if (!sequences) {
    std::printf("pool             %s used of %s (%llu/%llu pages), %llu blocks\n",
                Bytes(stats->pool_used_bytes).c_str(), Bytes(stats->pool_bytes).c_str(),
                static_cast<unsigned long long>(stats->pages_used),
                static_cast<unsigned long long>(stats->pages_total),
                static_cast<unsigned long long>(stats->blocks_used));
    std::printf("sequences        %u active, %llu created, %llu leases expired, %llu poisoned\n",
                stats->sequences_active, static_cast<unsigned long long>(stats->sequences_created),
                static_cast<unsigned long long>(stats->leases_expired),
                static_cast<unsigned long long>(stats->sequences_poisoned));
    if (stats->blocks_forsaken > 0) {  // a move abandoned a get in flight: see the log
      std::printf("forsaken         %llu blocks, %llu bytes kept out of use for good\n",
                  static_cast<unsigned long long>(stats->blocks_forsaken),
                  static_cast<unsigned long long>(stats->bytes_forsaken));
    }
    const double saved =
        stats->full_cache_bytes > 0
            ? 100.0 * (1.0 - double(stats->kv_bytes) / double(stats->full_cache_bytes))
            : 0.0;
    std::printf("kv memory        %s held by the sequences, %s for a full cache (%.1f%% saved)\n",
                Bytes(stats->kv_bytes).c_str(), Bytes(stats->full_cache_bytes).c_str(), saved);
    // Tokens are a sequence's positions; stream slots the same tokens in each stream.
    std::printf(
        "tokens           %llu appended, %.1f evicted, %.1f quantized "
        "(%llu / %llu stream slots)\n",
        static_cast<unsigned long long>(stats->tokens_appended), stats->tokens_evicted,
        stats->tokens_quantized, static_cast<unsigned long long>(stats->stream_slots_evicted),
        static_cast<unsigned long long>(stats->stream_slots_quantized));
    std::printf("steps            %llu\n", static_cast<unsigned long long>(stats->steps));
    for (const kvmem::client::PolicyCounters& p : stats->policies) {
      if (p.tokens_appended == 0 && p.steps == 0) continue;
      std::printf("  %-14s %llu tokens appended, %.1f evicted, %.1f quantized, %llu steps\n",
                  p.policy.c_str(), static_cast<unsigned long long>(p.tokens_appended),
                  p.tokens_evicted, p.tokens_quantized, static_cast<unsigned long long>(p.steps));
    }
    std::printf("slot state       %s (scores and positions in the backend, outside the pool)\n",
                Bytes(stats->slot_state_bytes).c_str());
    std::printf("host metadata    %s of %s (per-slot metadata outside the pool)\n",
                Bytes(stats->host_metadata_bytes).c_str(),
                Bytes(stats->host_metadata_budget_bytes).c_str());
    std::printf(
        "prefix cache     %llu queries, %llu hits, %llu tokens reused; %llu entries, "
        "%llu blocks (%llu only cached), %s reclaimed\n",
        static_cast<unsigned long long>(stats->prefix_queries),
        static_cast<unsigned long long>(stats->prefix_hits),
        static_cast<unsigned long long>(stats->prefix_reused_tokens),
        static_cast<unsigned long long>(stats->prefix_entries),
        static_cast<unsigned long long>(stats->prefix_indexed_blocks),
        static_cast<unsigned long long>(stats->prefix_cached_blocks),
        Bytes(stats->prefix_reclaimed_bytes).c_str());
    return 0;
  }
  std::printf("%8s %-10s %10s %8s %12s %8s %8s %8s %8s %7s %11s\n", "id", "policy", "appended",
              "longest", "kv bytes", "blocks", "epoch", "steps", "lease s", "parent", "slot state");
  for (const auto& s : stats->sequences) {
    const std::string parent = s.parent_id ? std::to_string(*s.parent_id) : "-";
    std::printf("%8llu %-10s %10llu %8u %12s %8llu %8llu %8llu %8.1f %7s %11s\n",
                static_cast<unsigned long long>(s.sequence_id), s.policy.c_str(),
                static_cast<unsigned long long>(s.appended_tokens), s.max_stream_tokens,
                Bytes(s.kv_bytes).c_str(), static_cast<unsigned long long>(s.blocks),
                static_cast<unsigned long long>(s.epoch), static_cast<unsigned long long>(s.steps),
                absl::ToDoubleSeconds(s.lease_remaining), parent.c_str(),
                Bytes(s.slot_state_bytes).c_str());
  }
  if (stats->sequences.empty()) std::printf("(no sequences)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string command = args.size() == 2 ? args[1] : "";
  if (command != "info" && command != "stats" && command != "sequences") {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  kvmem::client::ClientOptions options;
  options.deadline = absl::Seconds(5);
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = kvmem::client::ReadAuthToken(file);
    if (!token.ok()) {
      std::fprintf(stderr, "kvmemctl: %s\n", token.status().ToString().c_str());
      return 2;
    }
    options.auth_token = *token;
  }
  absl::StatusOr<std::unique_ptr<kvmem::client::Client>> client =
      kvmem::client::Client::Connect(absl::GetFlag(FLAGS_target), options);
  if (!client.ok()) {
    std::fprintf(stderr, "kvmemctl: %s\n", client.status().ToString().c_str());
    return 1;
  }
  if (command == "info") return Info(**client);
  return Stats(**client, command == "sequences");
}
