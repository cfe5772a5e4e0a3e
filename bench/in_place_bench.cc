// The decode loop as a same-host serving engine drives kvmemd, the in-place path against the
// message path in one run: N sequences of one layout, a 512-token prompt each, then decode
// steps of one token per sequence, one StepBatch per step through the step channel.
//   bytes:    K/V and the attention rows (halves) in the message, as before;
//   in place: K/V written into the pool where the write plan says (the pool mapped
//             writable), rows (halves) in the channel's signal area, the entry carrying
//             only ids, versions, the plan and offsets;
//   in place + table area: the same, and no table in the answers: each table read where
//             it lies in the daemon's table area (--table_area_bytes), as a paged-attention
//             kernel reads it (the bench sums its blocks' slots, for the next rows).
// The three alternate (bytes, in place, in place + area, ...) on three daemons started
// alike in this process (every call crosses a unix socket and shared memory as between processes).
// The time of a step runs from putting its data where the daemon reads it (the message, or the pool
// and the area) to having the answer with the tables updated; the K/V and row values themselves are
// made once, as a model would have them.
//
// --backend=cuda (a CUDA build, on a GPU): the daemons keep their pools in device memory,
// and the in-place paths copy each step's K/V from device buffers (the model's) into the
// pool through the IPC mapping (CudaPool::WritePlanned: two copy launches and a wait per
// sequence).
//
//   in_place_bench [--backend=cpu|cuda] [--sequences=64] [--policy=confkv|window] [--steps=100]
//   [--shape=smollm2]
//                  [--only=bytes|in_place|area]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kernels/half_arrays.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"
#if KVMEM_WITH_CUDA
#include <cuda_runtime.h>

#include "kvmem/cuda_pool.h"
#endif
#include "kvmem/table_area.h"
#include "kvmem/v1/step_channel.h"
#include "server/service/server.h"

ABSL_FLAG(uint32_t, sequences, 64, "sequences in each batch");
ABSL_FLAG(std::string, policy, "confkv", "confkv (c_high = c_low = 256) or window (256)");
ABSL_FLAG(uint32_t, steps, 100, "timed decode steps per round (after 10 untimed)");
ABSL_FLAG(uint32_t, rounds, 2, "rounds of (bytes, in place, in place + table area)");
ABSL_FLAG(std::string, only, "", "time only this path: bytes, in_place or area (for a profiler)");
ABSL_FLAG(std::string, shape, "smollm2", "smollm2 (30x3x64) or llama8b (32x8x128)");
ABSL_FLAG(std::string, backend, "cpu", "the daemons' backend: cpu, or cuda (a CUDA build)");

namespace {

using kvmem::client::BatchEntry;
using kvmem::client::BlockTable;
using kvmem::client::Client;

constexpr uint32_t kPrompt = 512;

struct Daemon {
  std::unique_ptr<kvmem::service::Server> server;
  std::unique_ptr<Client> client;
  std::unique_ptr<kvmem::client::SharedPool> pool;
#if KVMEM_WITH_CUDA
  std::unique_ptr<kvmem::client::CudaPool> cuda_pool;
#endif
  std::unique_ptr<kvmem::client::TableReader> tables;
};

Daemon Start(const std::string& name, uint64_t pool_bytes, uint64_t table_area_bytes) {
  kvmem::service::ServerConfig config;
  config.backend = absl::GetFlag(FLAGS_backend);
  const std::string socket = absl::StrCat("/tmp/kvmem-bench-", getpid(), "-", name);
  config.listen = "unix:" + socket;
  config.metrics_listen = "";
  config.engine.pool_bytes = pool_bytes;
  config.engine.max_sequences = 4096;
  config.engine.in_place_writes = true;
  config.engine.table_area_bytes = table_area_bytes;
  config.prefault_pool = true;  // as kvmemd does by default
  Daemon d;
  absl::StatusOr<std::unique_ptr<kvmem::service::Server>> server =
      kvmem::service::Server::Start(config);
  if (!server.ok()) {
    std::fprintf(stderr, "kvmemd: %s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  d.server = *std::move(server);
  while (!d.server->prefault_ended()) absl::SleepFor(absl::Milliseconds(20));
  if (d.server->prefaulted_bytes() < pool_bytes && absl::GetFlag(FLAGS_backend) == "cpu") {
    std::fprintf(stderr, "%s: the pool is not prefaulted (%llu of %llu bytes): page faults count\n",
                 name.c_str(), static_cast<unsigned long long>(d.server->prefaulted_bytes()),
                 static_cast<unsigned long long>(pool_bytes));
  }
  d.client = *Client::Connect("unix:" + socket);
  return d;
}

struct Seq {
  uint64_t id = 0;
  BlockTable table;               // the area path: as attached (layout, epoch slot), not kept
  std::vector<uint32_t> lengths;  // the area path: live slots per stream, from the area
  uint64_t epoch = 0;
  kvmem::client::WritePlan plan;
  int64_t next = kPrompt;
};

// One batched step's wall time and its parts, µs: the worker's own work before the call
// (K/V and rows written), the StepBatch call, and the table reads after it.
struct Timing {
  double total, before, call, after;
};

struct Run {
  Daemon daemon;
  std::vector<Seq> seqs;
  std::string name;  // bytes, in_place, area
  bool in_place = false;
  bool area = false;
};

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Writes sequence `s`'s attention rows for this step (halves: each stream's retained slots
// and the new token) into the signal area at `offset`, in the area's layout, as the model's
// attention kernel would; returns the bytes written.
uint64_t WriteRows(absl::Span<uint8_t> area, uint64_t offset, const Seq& s,
                   const kvmem::client::Layout& layout, bool from_area,
                   const std::string& row_halves) {
  namespace rows = kvmem::v1::signal_area;
  const uint32_t streams = layout.num_layers * layout.num_kv_heads;
  std::vector<uint32_t> lengths(streams);
  uint64_t values = 0;
  for (uint32_t st = 0; st < streams; ++st) {
    uint32_t live = 0;
    if (from_area) {
      live = s.lengths[st];
    } else {
      for (const kvmem::client::TableBlock& b : s.table.streams[st].blocks) live += b.count;
    }
    lengths[st] = live + 1;
    values += lengths[st];
  }
  const uint64_t bytes = sizeof(rows::RowsHeader) + streams * sizeof(rows::RowEntry) + 2 * values;
  if (offset > area.size() || bytes > area.size() - offset) {
    std::fprintf(stderr, "the signal area is too small for a step's rows\n");
    std::exit(1);
  }
  uint8_t* at = area.data() + offset;
  const rows::RowsHeader header{streams, rows::kF16};
  std::memcpy(at, &header, sizeof header);
  at += sizeof header;
  for (uint32_t st = 0; st < streams; ++st) {
    const rows::RowEntry entry{st / layout.num_kv_heads, st % layout.num_kv_heads, lengths[st], 0};
    std::memcpy(at, &entry, sizeof entry);
    at += sizeof entry;
  }
  for (uint32_t st = 0; st < streams; ++st) {
    std::memcpy(at, row_halves.data(), 2 * lengths[st]);
    at += 2 * lengths[st];
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint32_t n = absl::GetFlag(FLAGS_sequences);
  const std::string policy = absl::GetFlag(FLAGS_policy);
  const bool llama = absl::GetFlag(FLAGS_shape) == "llama8b";
  const kvmem::client::Layout layout{llama ? 32u : 30u,
                                     llama ? 8u : 3u,
                                     llama ? 128u : 64u,
                                     kvmem::client::DType::kF16,
                                     16,
                                     49152};
  const uint32_t streams = layout.num_layers * layout.num_kv_heads;
  const uint64_t row = uint64_t{layout.head_dim} * 2;
  const kvmem::client::PolicySpec spec =
      policy == "window" ? kvmem::client::PolicySpec{"window", {{"window", 256}}}
                         : kvmem::client::PolicySpec{"confkv", {{"c_high", 256}, {"c_low", 256}}};
  const bool rows_needed = policy != "window";
  // Pool: the prompt of every sequence, twice over for the blocks in flight.
  const uint64_t pool_bytes = uint64_t{n} * kPrompt * streams * row * 2 * 2 + (256ull << 20);

  // The values a model would produce: one prompt's K/V, one token's, one row per stream.
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> small(0x2000, 0x3800);  // finite halves
  auto halves = [&](uint64_t count) {
    std::string out(count * 2, '\0');
    for (uint64_t i = 0; i < count; ++i) {
      const uint16_t h = static_cast<uint16_t>(small(rng));
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
    return out;
  };
  const std::string prompt_k = halves(uint64_t{streams} * kPrompt * layout.head_dim);
  const std::string prompt_v = halves(uint64_t{streams} * kPrompt * layout.head_dim);
  const std::string token_k = halves(uint64_t{streams} * layout.head_dim);
  const std::string token_v = halves(uint64_t{streams} * layout.head_dim);
  std::uniform_real_distribution<float> weight(0.001f, 0.01f);
  std::vector<float> row_values(kPrompt + 1);
  for (float& w : row_values) w = weight(rng);
  // The same values as halves, as the model's attention kernel would leave them: the in-place
  // paths copy a row's prefix into the signal area (no float vectors made per step).
  std::string row_halves(row_values.size() * 2, '\0');
  kvmem::kernels::FloatToHalf(row_values.data(), row_values.size(), row_halves.data());

  const bool cuda = absl::GetFlag(FLAGS_backend) == "cuda";
#if KVMEM_WITH_CUDA
  // The model's K/V of a step, in device memory (CudaPool::WritePlanned copies from there).
  void* device_k = nullptr;
  void* device_v = nullptr;
  if (cuda) {
    if (cudaMalloc(&device_k, token_k.size()) != cudaSuccess ||
        cudaMalloc(&device_v, token_v.size()) != cudaSuccess ||
        cudaMemcpy(device_k, token_k.data(), token_k.size(), cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaMemcpy(device_v, token_v.data(), token_v.size(), cudaMemcpyHostToDevice) !=
            cudaSuccess) {
      std::fprintf(stderr, "no device memory for the model's K/V\n");
      return 1;
    }
  }
#else
  if (cuda) {
    std::fprintf(stderr, "--backend=cuda: this build has no CUDA (WITH_CUDA off)\n");
    return 1;
  }
#endif
  std::vector<int64_t> prompt_positions(kPrompt);
  for (uint32_t i = 0; i < kPrompt; ++i) prompt_positions[i] = i;
  const std::string only = absl::GetFlag(FLAGS_only);
  std::vector<Run> runs;
  for (const char* name : {"bytes", "in_place", "area"}) {
    if (!only.empty() && only != name) continue;
    runs.emplace_back().name = name;
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    runs[r].in_place = runs[r].name != "bytes";
    runs[r].area = runs[r].name == "area";
    runs[r].daemon = Start(runs[r].name, pool_bytes, runs[r].area ? 64ull << 20 : 0);
    Client& c = *runs[r].daemon.client;
    if (runs[r].area) {
      absl::StatusOr<kvmem::client::Info> info = c.GetInfo();
      Check(info.status(), "GetInfo");
      auto tables = kvmem::client::TableReader::Attach(*info);
      Check(tables.status(), "TableReader::Attach");
      runs[r].daemon.tables = *std::move(tables);
    }
    Check(c.OpenStepChannel(16ull << 20, runs[r].in_place ? 16ull << 20 : 0), "OpenStepChannel");
    if (runs[r].in_place) {
      absl::StatusOr<kvmem::client::Info> info = c.GetInfo();
      Check(info.status(), "GetInfo");
      if (cuda) {
#if KVMEM_WITH_CUDA
        auto pool = kvmem::client::CudaPool::Attach(*info, /*writable=*/true);
        Check(pool.status(), "CudaPool::Attach");
        runs[r].daemon.cuda_pool = *std::move(pool);
#endif
      } else {
        auto pool = kvmem::client::SharedPool::Attach(*info, /*writable=*/true);
        Check(pool.status(), "SharedPool::Attach");
        runs[r].daemon.pool = *std::move(pool);
      }
    }
    for (uint32_t i = 0; i < n; ++i) {
      absl::StatusOr<kvmem::client::Sequence> seq = c.CreateSequence(layout, spec);
      Check(seq.status(), "CreateSequence");
      Seq s;
      s.id = seq->id;
      Check(c.Append(s.id, {prompt_positions, {}, prompt_k, prompt_v, {}, {}}, &s.table).status(),
            "Append");
      s.epoch = s.table.epoch;
      for (const kvmem::client::StreamTable& st : s.table.streams) {
        uint32_t live = 0;
        for (const kvmem::client::TableBlock& b : st.blocks) live += b.count;
        s.lengths.push_back(live);
      }
      runs[r].seqs.push_back(std::move(s));
    }
    if (runs[r].in_place) {  // every sequence's first plan, in one batch
      std::vector<BatchEntry> entries(n);
      for (uint32_t i = 0; i < n; ++i) {
        entries[i].sequence_id = runs[r].seqs[i].id;
        entries[i].plan_tokens = 1;
      }
      absl::StatusOr<std::vector<kvmem::client::BatchResult>> out = c.StepBatch(entries);
      Check(out.status(), "StepBatch (plans)");
      for (uint32_t i = 0; i < n; ++i) {
        Check((*out)[i].plan_status, "plan");
        runs[r].seqs[i].plan = *(*out)[i].plan;
      }
    }
  }

  // One decode step of every sequence; returns its wall times.
  std::vector<BatchEntry> entries(n);
  std::vector<std::vector<int64_t>> positions(n);
  auto step = [&](Run& run) {
    Client& c = *run.daemon.client;
    const auto started = std::chrono::steady_clock::now();
    const Client::SignalArea area = run.in_place ? c.signal_area() : Client::SignalArea{};
    uint64_t offset = 0;
    for (uint32_t i = 0; i < n; ++i) {
      Seq& s = run.seqs[i];
      positions[i] = {s.next};
      BatchEntry& e = entries[i];
      e = BatchEntry{};
      e.sequence_id = s.id;
      e.table = run.area ? nullptr : &s.table;
      kvmem::client::StepArgs args;
      args.epoch = run.area ? s.epoch : s.table.epoch;
      args.logit_stats = kvmem::client::LogitStats{2.0f, 0.5f, 0.2f, {}};
      args.attention_f16 = true;
      if (rows_needed && !run.in_place) {
        args.attention.resize(streams);
        for (uint32_t st = 0; st < streams; ++st) {
          size_t len = 1;  // the retained slots and the new token
          if (run.area) {
            len += s.lengths[st];
          } else {
            for (const kvmem::client::TableBlock& b : s.table.streams[st].blocks) len += b.count;
          }
          args.attention[st] = {
              st / layout.num_kv_heads, st % layout.num_kv_heads,
              std::vector<float>(row_values.begin(), row_values.begin() + static_cast<long>(len))};
        }
      }
      if (run.in_place) {
        if (cuda) {
#if KVMEM_WITH_CUDA
          Check(run.daemon.cuda_pool->WritePlanned(s.plan, s.table, 1, device_k, device_v,
                                                   token_k.size()),
                "WritePlanned");
#endif
        } else {
          Check(run.daemon.pool->WritePlanned(s.plan, s.table, 1, token_k, token_v),
                "WritePlanned");
        }
        e.append = kvmem::client::AppendArgs{positions[i], {}, {}, {}, {}, {}};
        e.written_plan = s.plan.plan_id;
        e.plan_tokens = 1;
        if (rows_needed) {
          args.attention_offset = offset;
          offset += (WriteRows(area.bytes, offset, s, layout, run.area, row_halves) + 7) / 8 * 8;
        }
      } else {
        e.append = kvmem::client::AppendArgs{positions[i], {}, token_k, token_v, {}, {}};
      }
      e.step = std::move(args);
    }
    const auto called = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<kvmem::client::BatchResult>> out = c.StepBatch(entries);
    Check(out.status(), "StepBatch");
    const auto answered = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < n; ++i) {
      Check((*out)[i].status, "entry");
      if (run.in_place) {
        Check((*out)[i].plan_status, "plan");
        run.seqs[i].plan = *(*out)[i].plan;
      }
      ++run.seqs[i].next;
    }
    if (run.area) {
      // What the model's attention does with the table, where it lies: reads every stream's
      // blocks (here: their slot counts) and checks the slot did not move under the read.
      for (uint32_t i = 0; i < n; ++i) {
        Seq& s = run.seqs[i];
        const uint64_t version = (*out)[i].step->table_version;
        for (;;) {
          absl::StatusOr<kvmem::client::TableView> view =
              run.daemon.tables->View(s.table.epoch_slot, s.id, version);
          Check(view.status(), "TableReader::View");
          for (uint32_t st = 0; st < streams; ++st) {
            uint32_t live = 0;
            for (const kvmem::v1::table_area::Entry& b : view->stream(st)) live += b.count;
            s.lengths[st] = live;
          }
          s.epoch = view->epoch;
          if (run.daemon.tables->Unchanged(*view)) break;
        }
      }
    }
    const auto done = std::chrono::steady_clock::now();
    auto us = [](auto from, auto to) {
      return std::chrono::duration<double, std::micro>(to - from).count();
    };
    return Timing{us(started, done), us(started, called), us(called, answered), us(answered, done)};
  };

  const uint32_t steps = absl::GetFlag(FLAGS_steps);
  std::printf(
      "%s backend, %s shape (%ux%ux%u f16), %s, %u sequences, %u-token prompts, %u timed "
      "steps per round; median and 10th percentile per batched step\n",
      cuda ? "CUDA" : "CPU", llama ? "Llama-8B" : "SmolLM2", layout.num_layers, layout.num_kv_heads,
      layout.head_dim, policy.c_str(), n, kPrompt, steps);
  std::printf(
      "| round | path | µs per batched step (median) | p10 | µs per sequence-step | of which: "
      "writes / call / table reads (medians) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (uint32_t round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (Run& run : runs) {
      for (int w = 0; w < 10; ++w) step(run);
      std::vector<double> total, before, call, after;
      for (uint32_t t = 0; t < steps; ++t) {
        const Timing timing = step(run);
        total.push_back(timing.total);
        before.push_back(timing.before);
        call.push_back(timing.call);
        after.push_back(timing.after);
      }
      for (std::vector<double>* v : {&total, &before, &call, &after})
        std::sort(v->begin(), v->end());
      auto median = [](const std::vector<double>& v) { return v[v.size() / 2]; };
      const char* path = run.area ? "in place + table area" : run.in_place ? "in place" : "bytes";
      std::printf("| %u | %s | %.0f | %.0f | %.1f | %.0f / %.0f / %.0f |\n", round + 1, path,
                  median(total), total[total.size() / 10], median(total) / n, median(before),
                  median(call), median(after));
      std::fflush(stdout);
    }
  }
  for (const Run& run : runs) {
    if (run.daemon.client->table_refetches() > 0) {
      std::printf("(%s: %llu tables fetched again: an update or the area missed)\n",
                  run.name.c_str(),
                  static_cast<unsigned long long>(run.daemon.client->table_refetches()));
    }
  }
  return 0;
}
