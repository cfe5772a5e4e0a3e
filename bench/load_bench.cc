// A mixed load from many clients of several tenants against a kvmemd process, as a serving
// fleet's workers would drive it: each client, as its tenant, creates two sequences (each
// under one of several policies), appends a prompt, runs decode steps of both by StepBatch
// (one token appended per step, with attention rows and logit statistics), reads the K/V
// back and checks every retained byte, forks one now and then and reads the child, and
// releases everything; over and over until the time is up. Printed: calls and p50 / p99 /
// max latency per RPC, unexpected errors and wrong reads (both must be 0), the daemon's
// anonymous RSS a tenth of the way in, half way and at the end, and the pool, sequences and host
// metadata once every client has released all (back to zero). Exit 1 on any error, wrong read or
// leftover.
//
//   ./build/bench/load_bench --clients=64 --tenants=4 --seconds=300
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kvmem/client.h"
#include "tests/testing/kvmemd_process.h"
#include "tests/testing/payload.h"

ABSL_FLAG(int, clients, 64, "client threads, each with its own connection");
ABSL_FLAG(int, tenants, 4, "tenants (bearer tokens); client i is tenant i mod tenants");
ABSL_FLAG(double, seconds, 300, "how long the load runs");
ABSL_FLAG(std::string, kvmemd, KVMEMD_PATH, "the kvmemd binary to start");
ABSL_FLAG(std::vector<std::string>, kvmemd_flags, {},
          "more kvmemd flags, comma-separated (--request-id-entries=1000,...)");

namespace kvmem {
namespace {

constexpr uint32_t kL = 4, kH = 2, kD = 64;
using Clock = std::chrono::steady_clock;

client::Layout TheLayout() { return {kL, kH, kD, client::DType::kF16, 16, 49152}; }

const std::vector<client::PolicySpec>& Policies() {
  static const auto* policies = new std::vector<client::PolicySpec>{
      {"full", {}},
      {"window", {{"window", 64}}},
      {"h2o", {{"budget", 64}}},
      {"confkv", {{"c_high", 48}, {"c_low", 96}, {"protect", 8}}},
      {"streaming_llm", {{"budget", 64}, {"sinks", 4}}},
  };
  return *policies;
}

// What every client records; merged at the end.
struct Tally {
  std::map<std::string, std::vector<double>> ms;  // per RPC
  uint64_t cycles = 0, unexpected = 0, wrong_reads = 0, slots_checked = 0;
  std::vector<std::string> first_errors;
};

class Worker {
 public:
  Worker(std::unique_ptr<client::Client> c, uint32_t seed) : c_(std::move(c)), rng_(seed) {}

  void Run(Clock::time_point end) {
    while (Clock::now() < end) {
      Cycle();
      ++tally.cycles;
    }
  }
  Tally tally;

 private:
  struct Seq {
    uint64_t id = 0;
    uint16_t salt = 0;  // K is salt, V salt + 1: a misplaced row of another sequence shows
    int64_t next = 0;   // the next position
    client::BlockTable table;
  };

  template <typename F>
  auto Timed(const char* rpc, F&& call) {
    const auto start = Clock::now();
    auto result = call();
    tally.ms[rpc].push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    if (!result.ok()) Unexpected(rpc, result.status());
    return result;
  }
  void Unexpected(const char* rpc, const absl::Status& s) {
    ++tally.unexpected;
    if (tally.first_errors.size() < 5)
      tally.first_errors.push_back(absl::StrCat(rpc, ": ", s.ToString()));
  }

  // K/V of `n` tokens from `seq.next` on.
  void Append(Seq& seq, uint32_t n) {
    const std::vector<int64_t> positions = testing::Range(seq.next, n);
    const std::string k = testing::Payload16(kL * kH, seq.next, n, kD, seq.salt);
    const std::string v = testing::Payload16(kL * kH, seq.next, n, kD, seq.salt + 1);
    if (Timed("Append", [&] {
          return c_->Append(seq.id, {positions, {}, k, v, {}, {}}, &seq.table);
        }).ok()) {
      seq.next += n;
    }
  }

  // Every retained byte of every stream against what was appended at its position.
  void Check(const Seq& seq, uint64_t id) {
    auto kv = Timed("ReadKv", [&] { return c_->ReadKv(id); });
    if (!kv.ok()) return;
    for (const client::StreamKv& s : *kv) {
      const uint32_t stream = s.layer * kH + s.kv_head;
      const bool ordered =
          std::is_sorted(s.positions.begin(), s.positions.end()) &&
          (s.positions.empty() || (s.positions.front() >= 0 && s.positions.back() < seq.next));
      if (!ordered || s.k != testing::Expected16(stream, s.positions, kD, seq.salt) ||
          s.v != testing::Expected16(stream, s.positions, kD, seq.salt + 1)) {
        ++tally.wrong_reads;
        if (tally.first_errors.size() < 5) {
          tally.first_errors.push_back(
              absl::StrCat("wrong read of sequence ", id, " stream ", stream));
        }
      }
      tally.slots_checked += s.positions.size();
    }
  }

  void Cycle() {
    std::vector<Seq> seqs(2);
    for (Seq& seq : seqs) {
      const client::PolicySpec& policy = Policies()[rng_() % Policies().size()];
      auto made = Timed("CreateSequence", [&] { return c_->CreateSequence(TheLayout(), policy); });
      if (!made.ok()) return Release(seqs);
      seq.id = made->id;
      seq.salt = static_cast<uint16_t>(2 * (made->id % 4000));
      Append(seq, 32 + rng_() % 160);
    }
    const int steps = 16 + static_cast<int>(rng_() % 48);
    for (int step = 0; step < steps; ++step) {
      std::vector<std::vector<int64_t>> positions(seqs.size());
      std::vector<std::string> ks(seqs.size()), vs(seqs.size());
      std::vector<client::BatchEntry> entries(seqs.size());
      for (size_t i = 0; i < seqs.size(); ++i) {
        Seq& seq = seqs[i];
        positions[i] = {seq.next};
        ks[i] = testing::Payload16(kL * kH, seq.next, 1, kD, seq.salt);
        vs[i] = testing::Payload16(kL * kH, seq.next, 1, kD, seq.salt + 1);
        client::StepArgs args;
        args.epoch = seq.table.epoch;
        args.logit_stats =
            client::LogitStats{1.0f + static_cast<float>(rng_() % 100) / 50, 0.6f, 0.2f, {}};
        for (const client::StreamTable& st : seq.table.streams) {
          uint32_t slots = 1;  // the token this entry appends
          for (const client::TableBlock& b : st.blocks) slots += b.count;
          client::StreamSignal row{st.layer, st.kv_head,
                                   std::vector<float>(slots, 1.0f / static_cast<float>(slots))};
          row.values[rng_() % slots] += 0.5f;  // some tokens matter more
          args.attention.push_back(std::move(row));
        }
        entries[i].sequence_id = seq.id;
        entries[i].append = client::AppendArgs{positions[i], {}, ks[i], vs[i], {}, {}};
        entries[i].step = std::move(args);
        entries[i].table = &seq.table;
      }
      auto results = Timed("StepBatch", [&] { return c_->StepBatch(entries); });
      if (!results.ok()) break;
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (!(*results)[i].status.ok()) Unexpected("StepBatch entry", (*results)[i].status);
        if ((*results)[i].appended) ++seqs[i].next;
      }
    }
    for (const Seq& seq : seqs) Check(seq, seq.id);
    if (rng_() % 4 == 0) {
      auto child = Timed("Fork", [&] { return c_->Fork(seqs[0].id); });
      if (child.ok()) {
        Check(seqs[0], child->id);
        (void)Timed("Release", [&] { return c_->Release(child->id); });
      }
    }
    if (rng_() % 8 == 0) (void)Timed("Stats", [&] { return c_->GetStats(true); });
    Release(seqs);
  }

  void Release(std::vector<Seq>& seqs) {
    for (Seq& seq : seqs) {
      if (seq.id != 0) (void)Timed("Release", [&] { return c_->Release(seq.id); });
      seq.id = 0;
    }
  }

  std::unique_ptr<client::Client> c_;
  std::mt19937 rng_;
};

// The daemon's anonymous resident memory (its heap: the pool is shared memory), in bytes.
uint64_t RssAnon(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  uint64_t kb = 0;
  while (status >> key) {
    if (key == "RssAnon:") {
      status >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(i), v.end());
  return v[i];
}

int Main() {
  const int clients = absl::GetFlag(FLAGS_clients),
            tenants = std::max(1, absl::GetFlag(FLAGS_tenants));
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const std::string tokens = absl::StrCat("/tmp/kvmem_load_tokens.", getpid());
  {
    std::ofstream file(tokens);
    for (int t = 0; t < tenants; ++t)
      file << "tenant" << t << " load-token-tenant-" << t << "-0123456789\n";
    file << "ops load-token-admin-0123456789 admin\n";
  }
  std::vector<std::string> flags = {"--listen=127.0.0.1:0", "--pool-bytes=536870912",
                                    "--auth-tokens=" + tokens, "--lease-seconds=600"};
  for (const std::string& f : absl::GetFlag(FLAGS_kvmemd_flags)) flags.push_back(f);
  testing::KvmemdProcess d = testing::StartKvmemd(absl::GetFlag(FLAGS_kvmemd).c_str(), flags);
  if (d.port == 0) {
    std::fprintf(stderr, "load: kvmemd did not start\n");
    return 1;
  }
  const std::string target = absl::StrCat("127.0.0.1:", d.port);
  auto connect = [&](const std::string& token) {
    client::ClientOptions options;
    options.auth_token = token;
    options.deadline = absl::Seconds(60);
    return *client::Client::Connect(target, options);
  };
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < clients; ++i) {
    workers.push_back(std::make_unique<Worker>(
        connect(absl::StrCat("load-token-tenant-", i % tenants, "-0123456789")), 1000 + i));
  }
  const auto start = Clock::now();
  const auto end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w, end] { w->Run(end); });
  // The daemon's heap a tenth of the way in (warmed up), half way, then at the end.
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 10));
  const uint64_t rss_early = RssAnon(d.pid);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds * 0.4));
  const uint64_t rss_half = RssAnon(d.pid);
  for (std::thread& t : threads) t.join();
  const uint64_t rss_end = RssAnon(d.pid);
  const double ran = std::chrono::duration<double>(Clock::now() - start).count();

  Tally all;
  for (auto& w : workers) {
    for (auto& [rpc, ms] : w->tally.ms) all.ms[rpc].insert(all.ms[rpc].end(), ms.begin(), ms.end());
    all.cycles += w->tally.cycles;
    all.unexpected += w->tally.unexpected;
    all.wrong_reads += w->tally.wrong_reads;
    all.slots_checked += w->tally.slots_checked;
    for (const std::string& e : w->tally.first_errors) {
      if (all.first_errors.size() < 10) all.first_errors.push_back(e);
    }
  }
  std::printf(
      "load: %d clients, %d tenants, %.0f s: %llu cycles, %llu unexpected errors, %llu wrong reads "
      "(%llu slots checked)\n",
      clients, tenants, ran, static_cast<unsigned long long>(all.cycles),
      static_cast<unsigned long long>(all.unexpected),
      static_cast<unsigned long long>(all.wrong_reads),
      static_cast<unsigned long long>(all.slots_checked));
  for (const std::string& e : all.first_errors) std::printf("  %s\n", e.c_str());
  std::printf("%-16s %9s %9s %9s %9s\n", "rpc", "calls", "p50 ms", "p99 ms", "max ms");
  for (auto& [rpc, ms] : all.ms) {
    const double max = ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end());
    const size_t n = ms.size();
    std::printf("%-16s %9zu %9.2f %9.2f %9.2f\n", rpc.c_str(), n, Percentile(ms, 0.5),
                Percentile(ms, 0.99), max);
  }
  auto admin = connect("load-token-admin-0123456789");
  auto stats = admin->GetStats(true);
  bool clean = stats.ok() && stats->pages_used == 0 && stats->sequences_active == 0 &&
               stats->host_metadata_bytes == 0;
  std::printf(
      "daemon RssAnon: %.1f MiB at %.0f s, %.1f MiB at %.0f s, %.1f MiB at the end "
      "(%+.1f%% from the first)\n",
      rss_early / 1048576.0, seconds / 10, rss_half / 1048576.0, seconds / 2, rss_end / 1048576.0,
      rss_early == 0 ? 0.0
                     : 100.0 * (static_cast<double>(rss_end) - static_cast<double>(rss_early)) /
                           static_cast<double>(rss_early));
  if (stats.ok()) {
    std::printf(
        "after every release: %llu pool pages in use, %u sequences, %llu bytes of host metadata\n",
        static_cast<unsigned long long>(stats->pages_used), stats->sequences_active,
        static_cast<unsigned long long>(stats->host_metadata_bytes));
  } else {
    std::printf("Stats: %s\n", stats.status().ToString().c_str());
  }
  std::fflush(stdout);
  testing::StopKvmemd(d);
  std::remove(tokens.c_str());
  return all.unexpected == 0 && all.wrong_reads == 0 && clean && all.cycles > 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvmem

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvmem::Main();
}
