// What /metrics costs the decode loop: an in-process kvmemd (CPU backend) steps 16 sequences
// of SmolLM2's shape (30 layers x 3 KV heads x 64, f16) with one StepBatch per token,
// `window` policy, over a unix socket, in alternating phases with and without a scraper
// that GETs /metrics every second (Prometheus's shortest common interval). Phases alternate
// so that a shared machine's load falls on both alike; prints each phase's StepBatch rate and
// the ratio of the medians.
//
//   build-perf/bench/metrics_overhead_bench [--phases=8] [--phase_seconds=10]
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kvmem/client.h"
#include "server/service/server.h"
#include "tests/testing/payload.h"

ABSL_FLAG(int, phases, 8, "phases, alternating without and with scraping");
ABSL_FLAG(double, phase_seconds, 10, "length of each phase");

namespace {

constexpr uint32_t kL = 30, kH = 3, kD = 64, kSequences = 16;

// One GET of /metrics; the bytes of the answer.
size_t Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  size_t total = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const char request[] = "GET /metrics HTTP/1.0\r\n\r\n";
    (void)!write(fd, request, sizeof request - 1);
    char buf[65536];
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) total += static_cast<size_t>(n);
  }
  close(fd);
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace kvmem;
  service::ServerConfig config;
  const std::string sock = "/tmp/kvmem-metrics-bench-" + std::to_string(getpid()) + ".sock";
  config.listen = "unix:" + sock;
  config.metrics_listen = "127.0.0.1:0";
  config.engine.pool_bytes = 1ull << 30;
  config.engine.page_bytes = 256 * 1024;
  auto server = service::Server::Start(config);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  auto client = *client::Client::Connect("unix:" + sock);
  const client::Layout layout{kL, kH, kD, client::DType::kF16, 16, 49152};
  std::vector<uint64_t> ids;
  std::vector<int64_t> next(kSequences, 256);
  for (uint32_t i = 0; i < kSequences; ++i) {
    auto seq = client->CreateSequence(layout, {"window", {{"window", 256}}});
    if (!seq.ok()) return 1;
    ids.push_back(seq->id);
    const std::vector<int64_t> positions = testing::Range(0, 256);
    const std::string k = testing::Payload16(kL * kH, 0, 256, kD, 0);
    const std::string v = testing::Payload16(kL * kH, 0, 256, kD, 1);
    if (!client->Append(seq->id, {positions, {}, k, v, {}, {}}).ok()) return 1;
  }
  const std::string k1 = testing::Payload16(kL * kH, 0, 1, kD, 0);
  const std::string v1 = testing::Payload16(kL * kH, 0, 1, kD, 1);
  const int port = (*server)->metrics_port();
  std::printf(
      "kvmemd in process, 16 sequences x (30 x 3 x 64, f16), window 256; /metrics %zu "
      "bytes\n| phase | scraping | StepBatch/s | scrapes |\n|---|---|---|---|\n",
      Scrape(port));
  std::vector<double> off, on;
  for (int phase = 0; phase < absl::GetFlag(FLAGS_phases); ++phase) {
    const bool scraping = phase % 2 == 1;
    std::atomic<bool> stop{false};
    std::atomic<int> scrapes{0};
    std::thread scraper;
    if (scraping) {
      scraper = std::thread([&] {
        while (!stop) {
          Scrape(port);
          ++scrapes;
          for (int i = 0; i < 100 && !stop; ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      });
    }
    const auto start = std::chrono::steady_clock::now();
    const auto end = start + std::chrono::duration<double>(absl::GetFlag(FLAGS_phase_seconds));
    uint64_t batches = 0;
    std::vector<std::vector<int64_t>> positions(kSequences);
    while (std::chrono::steady_clock::now() < end) {
      std::vector<client::BatchEntry> entries(kSequences);
      for (uint32_t i = 0; i < kSequences; ++i) {
        positions[i] = {next[i]++};
        entries[i].sequence_id = ids[i];
        entries[i].append = client::AppendArgs{positions[i], {}, k1, v1, {}, {}};
        entries[i].step = client::StepArgs{};
      }
      auto results = client->StepBatch(entries);
      if (!results.ok()) {
        std::fprintf(stderr, "StepBatch: %s\n", results.status().ToString().c_str());
        return 1;
      }
      ++batches;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stop = true;
    if (scraper.joinable()) scraper.join();
    const double rate = batches / seconds;
    (scraping ? on : off).push_back(rate);
    std::printf("| %d | %s | %.1f | %d |\n", phase, scraping ? "every 1 s" : "no", rate,
                scrapes.load());
    std::fflush(stdout);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("median StepBatch/s: %.1f without scraping, %.1f with; with / without = %.4f\n",
              median(off), median(on), median(on) / median(off));
  // What one scrape costs by itself (the machine's noise hides 2 % above): back to back,
  // with the 16 sequences held.
  constexpr int kScrapes = 50;
  const auto start = std::chrono::steady_clock::now();
  const clock_t cpu_start = std::clock();
  for (int i = 0; i < kScrapes; ++i) Scrape(port);
  const double wall_ms =
      1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
      kScrapes;
  const double cpu_ms = 1e3 * double(std::clock() - cpu_start) / CLOCKS_PER_SEC / kScrapes;
  std::printf(
      "one scrape: %.2f ms wall, %.2f ms CPU (this process: daemon and scraper); at one "
      "scrape a second, %.2f %% of one core\n",
      wall_ms, cpu_ms, cpu_ms / 10.0);
  return 0;
}
