#include "server/metrics/exporter.h"

#include <cmath>
#include <deque>
#include <exception>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

namespace kvmem::metrics {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

using Labels = std::vector<ClientMetric::Label>;

class Families {
 public:
  MetricFamily& Family(std::string name, std::string help, MetricType type) {
    out_.push_back(MetricFamily{std::move(name), std::move(help), type, {}});
    return out_.back();
  }
  void Gauge(std::string name, std::string help, double value, Labels labels = {}) {
    Sample(Family(std::move(name), std::move(help), MetricType::Gauge), value, std::move(labels));
  }
  void Counter(std::string name, std::string help, double value) {
    Sample(Family(std::move(name), std::move(help), MetricType::Counter), value, {});
  }
  static void Sample(MetricFamily& f, double value, Labels labels) {
    ClientMetric m;
    m.label = std::move(labels);
    if (f.type == MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    f.metric.push_back(std::move(m));
  }
  static void Sample(MetricFamily& f, const engine::Histogram::Snapshot& h, Labels labels) {
    ClientMetric m;
    m.label = std::move(labels);
    m.histogram.sample_count = h.count;
    m.histogram.sample_sum = h.sum;
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.counts.size(); ++i) {
      cumulative += h.counts[i];
      m.histogram.bucket.push_back({cumulative, i < h.bounds.size()
                                                    ? h.bounds[i]
                                                    : std::numeric_limits<double>::infinity()});
    }
    f.metric.push_back(std::move(m));
  }
  std::vector<MetricFamily> Take() {
    return std::vector<MetricFamily>(std::make_move_iterator(out_.begin()),
                                     std::make_move_iterator(out_.end()));
  }

 private:
  std::deque<MetricFamily> out_;  // references to families stay valid as more are added
};

// One sample per transport, each always there (0 until used).
void SamplePeerBytes(MetricFamily& family, const PeerBytes& bytes) {
  const std::pair<const char*, uint64_t> transports[] = {
      {"attach", bytes.attach}, {"ucx", bytes.ucx}, {"grpc", bytes.grpc}};
  for (const auto& [transport, n] : transports) {
    Families::Sample(family, static_cast<double>(n), {{"transport", transport}});
  }
}

}  // namespace

std::vector<MetricFamily> Collector::Collect() const {
  const engine::EngineStats s = engine_->Stats(false);
  Families f;
  f.Gauge("kvmem_build_info", "kvmemd's version, backend and device (always 1)", 1,
          {{"backend", build_.backend}, {"device", build_.device}, {"version", build_.version}});

  // The pool.
  const uint64_t used = s.pool.pages_used * s.pool.page_bytes;
  const uint64_t cached_bytes = s.prefix.cached_bytes;
  f.Gauge("kvmem_pool_capacity_bytes", "pool size (never grows)",
          static_cast<double>(s.pool.pool_bytes));
  MetricFamily& bytes =
      f.Family("kvmem_pool_bytes",
               "pool bytes by state: sequences (pages in use, less the cached blocks' bytes: "
               "includes the pages' unused room), cached (blocks only the prefix cache holds, "
               "reclaimable), free (free pages)",
               MetricType::Gauge);
  Families::Sample(bytes, static_cast<double>(used - std::min(used, cached_bytes)),
                   {{"state", "sequences"}});
  Families::Sample(bytes, static_cast<double>(cached_bytes), {{"state", "cached"}});
  Families::Sample(bytes, static_cast<double>(s.pool_free_bytes), {{"state", "free"}});
  MetricFamily& arenas =
      f.Family("kvmem_pool_arena_bytes",
               "tenant arenas (--tenant-arena, within kvmem_pool_bytes): size and free pages",
               MetricType::Gauge);
  for (const engine::ArenaUsage& a : s.arenas) {
    Families::Sample(arenas, static_cast<double>(a.bytes),
                     {{"tenant", a.tenant}, {"state", "capacity"}});
    Families::Sample(arenas, static_cast<double>(a.free_bytes),
                     {{"tenant", a.tenant}, {"state", "free"}});
  }
  MetricFamily& blocks = f.Family("kvmem_pool_blocks", "pool blocks by state (as kvmem_pool_bytes)",
                                  MetricType::Gauge);
  // The pool and the prefix index are read one after the other: clamp, never wrap.
  Families::Sample(blocks,
                   static_cast<double>(s.pool.blocks_used -
                                       std::min(s.pool.blocks_used, s.prefix.cached_blocks)),
                   {{"state", "sequences"}});
  Families::Sample(blocks, static_cast<double>(s.prefix.cached_blocks), {{"state", "cached"}});
  MetricFamily& precision = f.Family(
      "kvmem_kv_block_bytes",
      "bytes of the blocks the sequences' tables name, by storage precision (a shared block "
      "counted by each sequence)",
      MetricType::Gauge);
  for (const auto& [name, value] : s.block_bytes_by_precision) {
    Families::Sample(precision, static_cast<double>(value), {{"precision", name}});
  }
  // KV events for routers (0 without --kv-events-endpoint).
  const KvEventTotals events = kv_events_ ? kv_events_() : KvEventTotals{};
  f.Counter("kvmem_kv_events_total", "KV events published (BlockStored, BlockRemoved, cleared)",
            static_cast<double>(events.events));
  f.Counter("kvmem_kv_event_batches_total", "KV event batches sent on the PUB socket",
            static_cast<double>(events.batches));
  f.Counter("kvmem_kv_events_dropped_total",
            "KV events dropped for a full queue (an AllBlocksCleared follows)",
            static_cast<double>(events.dropped));
  f.Counter("kvmem_kv_event_replays_total", "replay requests answered",
            static_cast<double>(events.replay_requests));
  {  // Remote appends by UCX (0 without --ucx).
    UcxTotals u;
    if (ucx_) {
      u = ucx_();
    } else {
      u.seconds = engine::Histogram(engine::LatencyBounds()).Read();
    }
    MetricFamily& transfers = f.Family(
        "kvmem_ucx_transfers_total",
        "UCX messages of remote appends' K/V, by result: landed (the append then applied or "
        "was refused as any Append), dropped (no call announced it, malformed, too many "
        "waiting), failed (announced, did not land: size, error, time)",
        MetricType::Counter);
    const std::pair<const char*, uint64_t> results[] = {
        {"landed", u.landed}, {"dropped", u.dropped}, {"failed", u.failed}};
    for (const auto& [result, n] : results) {
      Families::Sample(transfers, static_cast<double>(n),
                       {{"direction", "in"}, {"result", result}});
    }
    MetricFamily& bytes = f.Family("kvmem_ucx_bytes_total",
                                   "K/V bytes landed by UCX (remote reads are one-sided and not "
                                   "seen by kvmemd)",
                                   MetricType::Counter);
    Families::Sample(bytes, static_cast<double>(u.landed_bytes), {{"direction", "in"}});
    f.Gauge("kvmem_ucx_receives_in_flight",
            "UCX receives of remote appends' K/V in flight (one whose call gave up stays until "
            "UCX ends it)",
            static_cast<double>(u.receiving));
    f.Gauge("kvmem_ucx_held_messages",
            "UCX messages that arrived before the call announcing them, held for it",
            static_cast<double>(u.held));
    MetricFamily& seconds = f.Family(
        "kvmem_ucx_transfer_seconds",
        "a remote append's K/V: from its call's announcement to landed", MetricType::Histogram);
    Families::Sample(seconds, u.seconds, {{"direction", "in"}});
  }
  {  // The fleet's shared prefix index (0 without --cluster-index).
    ClusterIndexTotals c;
    if (cluster_index_) {
      c = cluster_index_();
    } else {
      c.write_seconds = c.lookup_seconds = engine::Histogram(engine::LatencyBounds()).Read();
    }
    MetricFamily& ops =
        f.Family("kvmem_cluster_index_updates_total",
                 "this node's claims in the fleet's prefix index, by outcome", MetricType::Counter);
    const std::pair<const char*, uint64_t> outcomes[] = {
        {"added", c.added}, {"removed", c.removed}, {"renewed", c.renewed}, {"dropped", c.dropped}};
    for (const auto& [outcome, n] : outcomes) {
      Families::Sample(ops, static_cast<double>(n), {{"outcome", outcome}});
    }
    f.Counter("kvmem_cluster_index_errors_total",
              "cluster index connections lost or refused, and error replies",
              static_cast<double>(c.errors));
    MetricFamily& lookups =
        f.Family("kvmem_cluster_index_lookups_total",
                 "fleet lookups, by whether the index answered in time", MetricType::Counter);
    Families::Sample(lookups, static_cast<double>(c.lookups_answered), {{"result", "answered"}});
    Families::Sample(lookups, static_cast<double>(c.lookups_unavailable),
                     {{"result", "unavailable"}});
    f.Gauge("kvmem_cluster_index_entries", "prefix blocks this node claims in the fleet's index",
            static_cast<double>(c.entries));
    f.Gauge("kvmem_cluster_index_connected", "1 while the index's writer is connected",
            c.connected ? 1.0 : 0.0);
    f.Gauge("kvmem_cluster_index_last_renewal_seconds",
            "how long the last renewal of every claim of this node took (a third of the TTL "
            "is its limit)",
            c.last_renewal_seconds);
    MetricFamily& seconds = f.Family(
        "kvmem_cluster_index_seconds",
        "cluster index round trips: a pipeline of updates (write), a fleet lookup (lookup)",
        MetricType::Histogram);
    Families::Sample(seconds, c.write_seconds, {{"op", "write"}});
    Families::Sample(seconds, c.lookup_seconds, {{"op", "lookup"}});
  }
  {  // PullPrefix (0 without --cluster-index)
    PullTotals p;
    if (pulls_) {
      p = pulls_();
    } else {
      p.seconds = engine::Histogram(engine::LatencyBounds()).Read();
    }
    MetricFamily& pulls =
        f.Family("kvmem_prefix_pulls_total",
                 "PullPrefix calls past their request's checks, by result: pulled (a prefix added "
                 "here), nothing (no peer held more), failed (the index, the holder, a limit, a "
                 "from_node no peer matches)",
                 MetricType::Counter);
    const std::pair<const char*, uint64_t> results[] = {
        {"pulled", p.pulled}, {"nothing", p.nothing}, {"failed", p.failed}};
    for (const auto& [result, n] : results) {
      Families::Sample(pulls, static_cast<double>(n), {{"result", result}});
    }
    f.Counter("kvmem_prefix_pulled_tokens_total", "prompt tokens pulled from peers and published",
              static_cast<double>(p.tokens));
    SamplePeerBytes(
        f.Family("kvmem_prefix_pulled_bytes_total",
                 "K+V bytes read from peers by PullPrefix, by transport", MetricType::Counter),
        p.bytes);
    Families::Sample(f.Family("kvmem_prefix_pull_seconds", "a PullPrefix call, whatever its end",
                              MetricType::Histogram),
                     p.seconds, {});
  }
  {  // MoveSequence (0 without --cluster-peers)
    MoveTotals m;
    if (moves_) {
      m = moves_();
    } else {
      m.seconds = engine::Histogram(engine::LatencyBounds()).Read();
    }
    MetricFamily& moves = f.Family(
        "kvmem_sequence_moves_total",
        "MoveSequence calls past their request's checks, by result: moved (the sequence is "
        "here and the holder released it), unreleased (here, the holder's release unconfirmed), "
        "failed (it stayed with the holder)",
        MetricType::Counter);
    const std::pair<const char*, uint64_t> results[] = {
        {"moved", m.moved - m.unreleased}, {"unreleased", m.unreleased}, {"failed", m.failed}};
    for (const auto& [result, n] : results) {
      Families::Sample(moves, static_cast<double>(n), {{"result", result}});
    }
    SamplePeerBytes(
        f.Family("kvmem_sequence_moved_bytes_total",
                 "block bytes of sequences moved here, by transport", MetricType::Counter),
        m.bytes);
    Families::Sample(f.Family("kvmem_sequence_move_seconds",
                              "a MoveSequence call, whatever its end", MetricType::Histogram),
                     m.seconds, {});
  }
  f.Counter("kvmem_pool_moved_bytes_total",
            "pool bytes moved by compaction, merges and copy-on-write",
            static_cast<double>(s.bytes_moved));

  // Sequences and their memory.
  f.Gauge("kvmem_sequences", "sequences held", s.sequences_active);
  f.Counter("kvmem_sequences_created_total", "sequences created (and forked)",
            static_cast<double>(s.sequences_created));
  f.Counter("kvmem_sequences_poisoned_total",
            "sequences poisoned by a failure past a mutation's point of no return",
            static_cast<double>(s.sequences_poisoned));
  f.Counter("kvmem_blocks_forsaken_total",
            "blocks a move kept out of circulation for good (a get abandoned in flight)",
            static_cast<double>(s.blocks_forsaken));
  f.Counter("kvmem_leases_expired_total", "sequences released because their lease lapsed",
            static_cast<double>(s.leases_expired));
  f.Gauge("kvmem_kv_bytes",
          "K/V bytes the sequences' tables hold (shared blocks counted per sequence)",
          static_cast<double>(s.kv_bytes));
  f.Gauge("kvmem_kv_full_cache_bytes",
          "bytes a full cache of the same sequences' tokens at the layout's dtype would hold",
          static_cast<double>(s.full_cache_bytes));
  f.Gauge("kvmem_host_metadata_bytes", "host memory of the sequences' metadata outside the pool",
          static_cast<double>(s.host_metadata_bytes));
  f.Gauge("kvmem_host_metadata_budget_bytes", "the budget of kvmem_host_metadata_bytes",
          static_cast<double>(s.host_metadata_budget_bytes));
  f.Gauge("kvmem_table_area_bytes", "bytes of the table area's heap its tables take",
          static_cast<double>(s.table_area_used_bytes));
  f.Gauge("kvmem_table_area_budget_bytes", "the table area's heap (--table_area_bytes, 0: none)",
          static_cast<double>(s.table_area_heap_bytes));
  f.Counter("kvmem_table_area_misses_total",
            "table writes that found no room in the table area (answers carried the update)",
            static_cast<double>(s.table_area_misses));
  f.Gauge("kvmem_slot_state_bytes", "the sequences' slot state (scores, positions) in the backend",
          static_cast<double>(s.slot_state_bytes));
  f.Gauge("kvmem_device_slot_state_bytes",
          "of kvmem_slot_state_bytes, in device memory (the CUDA backend's device step)",
          static_cast<double>(s.device_slot_state_bytes));
  f.Gauge("kvmem_device_metadata_budget_bytes",
          "the budget of kvmem_device_slot_state_bytes (--device-metadata-bytes)",
          static_cast<double>(s.device_metadata_budget_bytes));

  // Per policy.
  struct PerPolicy {
    const char* name;
    const char* help;
    double (*value)(const engine::PolicyCounts&);
  };
  const PerPolicy counters[] = {
      {"kvmem_tokens_appended_total", "tokens appended (positions, whatever the stream count)",
       [](const engine::PolicyCounts& c) { return double(c.tokens_appended); }},
      {"kvmem_tokens_evicted_total",
       "tokens evicted: stream slots evicted divided by the sequence's streams",
       [](const engine::PolicyCounts& c) { return c.tokens_evicted; }},
      {"kvmem_stream_slots_evicted_total", "stream slots evicted (a token in each stream)",
       [](const engine::PolicyCounts& c) { return double(c.stream_slots_evicted); }},
      {"kvmem_tokens_quantized_total",
       "tokens moved to quantized blocks: stream slots divided by the sequence's streams",
       [](const engine::PolicyCounts& c) { return c.tokens_quantized; }},
      {"kvmem_stream_slots_quantized_total", "stream slots moved to quantized blocks",
       [](const engine::PolicyCounts& c) { return double(c.stream_slots_quantized); }},
  };
  for (const PerPolicy& p : counters) {
    MetricFamily& family = f.Family(p.name, p.help, MetricType::Counter);
    for (const engine::PolicyCounts& c : s.policies) {
      Families::Sample(family, p.value(c), {{"policy", c.policy}});
    }
  }
  const engine::Telemetry& t = engine_->telemetry();
  struct PerPolicyHistogram {
    const char* name;
    const char* help;
    const engine::Histogram& (*of)(const engine::PolicyTelemetry&);
  };
  MetricFamily& step =
      f.Family("kvmem_step_duration_seconds",
               "engine time of a Step (StepBatch entry) by policy and where its scoring ran "
               "(host: policy code; device: the backend's slot state)",
               MetricType::Histogram);
  for (const auto& p : t.policies()) {
    Families::Sample(step, p->step_seconds[0].Read(), {{"policy", p->policy}, {"where", "host"}});
    Families::Sample(step, p->step_seconds[1].Read(), {{"policy", p->policy}, {"where", "device"}});
  }
  const PerPolicyHistogram histograms[] = {
      {"kvmem_append_duration_seconds",
       "time of an Append in the engine, from its first chunk to its commit (an AppendStream: "
       "the whole stream, the client's pauses included)",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& {
         return p.append_seconds;
       }},
      {"kvmem_compress_duration_seconds", "engine time of a Compress",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& {
         return p.compress_seconds;
       }},
      {"kvmem_confidence", "the confidence a step computed (CONF-KV policies), 0..1",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& { return p.confidence; }},
      {"kvmem_budget_tokens", "the budget a step chose, tokens per stream",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& {
         return p.budget_tokens;
       }},
      {"kvmem_evicted_attention_mass",
       "per step with attention rows: the row's weight on the slots the step evicted, mean over "
       "streams (0..1; a budget too tight evicts mass)",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& {
         return p.evicted_attention_mass;
       }},
      {"kvmem_quantized_attention_mass",
       "per step with attention rows: the row's weight on slots held quantized, mean over streams",
       [](const engine::PolicyTelemetry& p) -> const engine::Histogram& {
         return p.quantized_attention_mass;
       }},
  };
  for (const PerPolicyHistogram& h : histograms) {
    MetricFamily& family = f.Family(h.name, h.help, MetricType::Histogram);
    for (const auto& p : t.policies()) {
      Families::Sample(family, h.of(*p).Read(), {{"policy", p->policy}});
    }
  }

  // Prefix sharing.
  f.Counter("kvmem_prefix_queries_total", "Lookups and creations that named a prompt",
            static_cast<double>(s.prefix.queries));
  f.Counter("kvmem_prefix_hits_total", "of those, the ones that matched at least one block",
            static_cast<double>(s.prefix.hits));
  f.Counter("kvmem_prefix_reused_tokens_total", "tokens mapped into new sequences",
            static_cast<double>(s.prefix.reused_tokens));
  f.Counter("kvmem_prefix_reclaimed_bytes_total",
            "pool bytes of cached blocks given back under pressure",
            static_cast<double>(s.prefix.reclaimed_bytes));
  f.Gauge("kvmem_prefix_entries", "published block ranges in the prefix cache",
          static_cast<double>(s.prefix.entries));

  // RPCs.
  if (rpc_ != nullptr) {
    MetricFamily& calls =
        f.Family("kvmem_rpc_requests_total",
                 "KvCache calls by method and status code (StepBatch: over gRPC and step channels)",
                 MetricType::Counter);
    MetricFamily& seconds =
        f.Family("kvmem_rpc_duration_seconds",
                 "KvCache call latency in the daemon by method (StepBatch through a step "
                 "channel: from the request seen to the answer written)",
                 MetricType::Histogram);
    for (const auto& m : rpc_->methods()) {
      for (int code = 0; code < RpcTelemetry::kCodes; ++code) {
        const uint64_t n = m->calls[code].load(std::memory_order_relaxed);
        if (n == 0 && code != 0) continue;  // codes appear once seen; OK always
        Families::Sample(calls, static_cast<double>(n),
                         {{"code", StatusCodeName(code)}, {"method", m->label}});
      }
      Families::Sample(seconds, m->seconds.Read(), {{"method", m->label}});
    }
    MetricFamily& moved =
        f.Family("kvmem_data_plane_bytes_total",
                 "bytes of KvCache messages by transport and direction", MetricType::Counter);
    Families::Sample(moved, static_cast<double>(rpc_->bytes_in.load()),
                     {{"direction", "in"}, {"transport", "grpc"}});
    Families::Sample(moved, static_cast<double>(rpc_->bytes_out.load()),
                     {{"direction", "out"}, {"transport", "grpc"}});
    Families::Sample(moved, static_cast<double>(rpc_->channel_bytes_in.load()),
                     {{"direction", "in"}, {"transport", "step_channel"}});
    Families::Sample(moved, static_cast<double>(rpc_->channel_bytes_out.load()),
                     {{"direction", "out"}, {"transport", "step_channel"}});
    f.Counter("kvmem_step_channel_batches_total",
              "StepBatch calls answered through same-host step channels (in "
              "kvmem_rpc_requests_total too)",
              static_cast<double>(rpc_->channel_batches.load()));
  }
  return f.Take();
}

std::string Render(const Collector& collector) {
  return prometheus::TextSerializer().Serialize(collector.Collect());
}

absl::StatusOr<std::unique_ptr<Exporter>> Exporter::Start(const std::string& listen,
                                                          std::shared_ptr<Collector> collector) {
  std::unique_ptr<Exporter> exporter(new Exporter());
  try {
    exporter->exposer_ = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: cannot serve /metrics on '", listen, "': ", e.what()));
  }
  exporter->collector_ = std::move(collector);
  exporter->exposer_->RegisterCollectable(exporter->collector_);
  const std::vector<int> ports = exporter->exposer_->GetListeningPorts();
  exporter->port_ = ports.empty() ? 0 : ports[0];
  return exporter;
}

Exporter::~Exporter() = default;

}  // namespace kvmem::metrics
