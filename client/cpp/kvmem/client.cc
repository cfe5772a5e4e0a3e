#include "kvmem/client.h"

#include <atomic>
#include <memory>
#include <random>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/arena.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/half_arrays.h"
#include "kvmem/step_channel_client.h"
#include "kvmem/table_update.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::client {
namespace {

absl::Status FromRpcStatus(const google::rpc::Status& rich);

// The daemon's status, message unchanged; its google.rpc details become payloads.
absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  google::rpc::Status rich;
  if (status.error_details().empty() || !rich.ParseFromString(status.error_details())) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  rich.set_code(status.error_code());
  rich.set_message(status.error_message());
  return FromRpcStatus(rich);
}

// A google.rpc.Status (a call's, or a StepBatch entry's) with its details as payloads.
absl::Status FromRpcStatus(const google::rpc::Status& rich) {
  if (rich.code() == 0) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(rich.code()), rich.message());
  for (const google::protobuf::Any& detail : rich.details()) {
    out.SetPayload(detail.type_url(), absl::Cord(detail.value()));
    if (google::rpc::BadRequest bad; detail.UnpackTo(&bad)) {
      if (bad.field_violations_size() > 0 && !bad.field_violations(0).field().empty()) {
        out.SetPayload(kFieldPayload, absl::Cord(bad.field_violations(0).field()));
      }
    } else if (google::rpc::ErrorInfo info; detail.UnpackTo(&info)) {
      const auto& metadata = info.metadata();
      if (auto it = metadata.find("current_epoch"); it != metadata.end()) {
        out.SetPayload(kCurrentEpochPayload, absl::Cord(it->second));
      }
      if (auto it = metadata.find("current_version"); it != metadata.end()) {
        out.SetPayload(kCurrentVersionPayload, absl::Cord(it->second));
      }
    } else if (google::rpc::QuotaFailure quota; detail.UnpackTo(&quota)) {
      if (quota.violations_size() > 0) {
        out.SetPayload(kLimitPayload, absl::Cord(quota.violations(0).subject()));
      }
    }
  }
  return out;
}

absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

void ToProto(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t seconds = absl::IDivDuration(d, absl::Seconds(1), &d);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(absl::ToInt64Nanoseconds(d)));
}

template <typename Repeated>
auto ToVector(const Repeated& r) {
  return std::vector<typename Repeated::value_type>(r.begin(), r.end());
}

void ToProto(const PolicySpec& policy, v1::PolicySpec* out) {
  if (policy.name) out->set_name(*policy.name);
  out->set_quantization(static_cast<v1::Precision>(policy.quantization));
  if (policy.quantization_recent_tokens) {
    out->set_quantization_recent_tokens(*policy.quantization_recent_tokens);
  }
  for (const auto& [k, v] : policy.params) (*out->mutable_params())[k] = v;
}

void ToProto(const Layout& layout, v1::Layout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(static_cast<v1::DType>(layout.dtype));
  if (layout.block_tokens) out->set_block_tokens(*layout.block_tokens);
  out->set_vocab_size(layout.vocab_size);
}

Layout FromProto(const v1::Layout& layout) {
  Layout out{layout.num_layers(), layout.num_kv_heads(),
             layout.head_dim(),   static_cast<DType>(layout.dtype()),
             std::nullopt,        layout.vocab_size()};
  if (layout.has_block_tokens()) out.block_tokens = layout.block_tokens();
  return out;
}

// The tokens of an AppendRequest, an AppendStreamRequest chunk or a StepBatchEntry.
template <typename Request>
void FillTokens(const AppendArgs& args, Request* out) {
  out->mutable_positions()->Add(args.positions.begin(), args.positions.end());
  out->mutable_token_ids()->Add(args.token_ids.begin(), args.token_ids.end());
  out->set_k(std::string(args.k));
  out->set_v(std::string(args.v));
  out->mutable_token_entropy()->Add(args.token_entropy.begin(), args.token_entropy.end());
  out->mutable_layer_distance()->Add(args.layer_distance.begin(), args.layer_distance.end());
}

template <typename Request>
void ToProto(const AppendArgs& args, uint64_t id, Request* out) {
  out->set_sequence_id(id);
  FillTokens(args, out);
}

// An AppendResponse or AppendStreamResponse.
template <typename Response>
AppendResult AppendResultOf(const Response& r) {
  return AppendResult{r.appended_tokens(), r.max_stream_tokens(), r.epoch(), r.kv_bytes(),
                      r.table_version()};
}

StepResult StepResultOf(const v1::StepResponse& r) {
  StepResult out{r.confidence(),      std::nullopt,       r.evicted_tokens(), r.quantized_tokens(),
                 r.kv_bytes_before(), r.kv_bytes_after(), r.epoch(),          r.step(),
                 r.table_version()};
  if (r.has_budget_tokens()) out.budget_tokens = r.budget_tokens();
  return out;
}

BlockTable FromProto(const v1::BlockTable& r) {
  BlockTable table;
  table.sequence_id = r.sequence_id();
  table.epoch = r.epoch();
  table.version = r.version();
  table.positions = r.positions();
  table.block_tokens = r.block_tokens();
  table.block_bytes = r.block_bytes();
  table.layout = FromProto(r.layout());
  table.epoch_slot = r.epoch_slot();
  table.quantization = static_cast<Precision>(r.quantization());
  table.quantized_block_bytes = r.quantized_block_bytes();
  for (const v1::StreamTable& st : r.streams()) {
    StreamTable out{st.layer(), st.kv_head(), {}, ToVector(st.positions())};
    out.blocks.reserve(st.block_ids_size());
    for (int b = 0; b < st.block_ids_size(); ++b) {
      out.blocks.push_back({st.block_ids(b), st.block_offsets(b), st.block_starts(b),
                            st.block_counts(b), static_cast<Precision>(st.block_precisions(b))});
    }
    table.streams.push_back(std::move(out));
  }
  return table;
}

// Brings `table` to the update's version. A delta applies only to the version it was made
// from; false when it cannot apply (the table moved meanwhile: a concurrent call on the
// same sequence answered first), and the table is left as it was.
bool ApplyUpdate(uint64_t sequence_id, const v1::TableUpdate& update, BlockTable* table) {
  if (update.has_table()) {
    if (update.table().sequence_id() != sequence_id) return false;
    *table = FromProto(update.table());
    return true;
  }
  if (!update.has_delta()) return false;
  const v1::TableDelta& d = update.delta();
  // Versions are unique to a sequence's history only: a table of another sequence (or one
  // that moved meanwhile) takes no delta.
  if (table->sequence_id != sequence_id || d.base_version() != table->version) return false;
  const int listed = d.stream_size(), runs = d.kept_at_size(), given = d.block_ids_size();
  if (d.block_count_size() != listed || d.run_count_size() != listed ||
      d.kept_from_size() != runs || d.kept_count_size() != runs ||
      d.block_offsets_size() != given || d.block_precisions_size() != given ||
      d.block_starts_size() != given || d.block_counts_size() != given) {
    return false;
  }
  // Checked whole before anything applies: streams ascending, each named once; each
  // stream's kept runs lie inside both lists, in order in both, and with its given entries
  // (and their positions) fill its new list exactly; the columns hold nothing more.
  struct Listed {
    int run = 0, given = 0;  // the stream's first run and given entry in the columns
    int position = 0;        // its given entries' first position
    bool in_place = false;   // every kept run stays at its index
  };
  std::vector<Listed> where(static_cast<size_t>(listed));
  int run = 0, entry = 0;
  uint64_t position = 0;
  for (int i = 0; i < listed; ++i) {
    const uint32_t s = d.stream(i);
    if (s >= table->streams.size() || (i > 0 && s <= d.stream(i - 1))) return false;
    const StreamTable& st = table->streams[s];
    if (d.run_count(i) > static_cast<uint32_t>(runs - run)) return false;
    Listed& w = where[static_cast<size_t>(i)];
    w = {run, entry, static_cast<int>(position), !table->positions};
    const int end = run + static_cast<int>(d.run_count(i));
    uint64_t at = 0, from = 0, kept = 0;
    for (; run < end; ++run) {
      if (d.kept_at(run) < at || d.kept_from(run) < from ||
          uint64_t{d.kept_from(run)} + d.kept_count(run) > st.blocks.size()) {
        return false;
      }
      at = uint64_t{d.kept_at(run)} + d.kept_count(run);
      from = uint64_t{d.kept_from(run)} + d.kept_count(run);
      kept += d.kept_count(run);
      w.in_place = w.in_place && d.kept_at(run) == d.kept_from(run);
    }
    if (at > d.block_count(i) || kept > d.block_count(i) ||
        d.block_count(i) - kept > static_cast<uint64_t>(given - entry)) {
      return false;
    }
    const int entries_end = entry + static_cast<int>(d.block_count(i) - kept);
    for (; entry < entries_end; ++entry) position += d.block_counts(entry);
    if (table->positions) {
      uint64_t held_slots = 0;
      for (const TableBlock& b : st.blocks) held_slots += b.count;
      if (held_slots != st.positions.size() ||
          position > static_cast<uint64_t>(d.positions_size())) {
        return false;
      }
    }
  }
  if (run != runs || entry != given ||
      (table->positions && position != static_cast<uint64_t>(d.positions_size()))) {
    return false;
  }
  const auto given_entry = [&d](int g) {
    return TableBlock{d.block_ids(g), d.block_offsets(g), d.block_starts(g), d.block_counts(g),
                      static_cast<Precision>(d.block_precisions(g))};
  };
  // Every new list is built before any is installed: an allocation failure leaves the
  // table as it was. A list whose kept entries all stay at their index (an append's new
  // tail, a window's changed first block) is not built but changed in place, into room
  // reserved here: a decode step then costs what changed, not the whole list (90 streams of
  // 500 entries at 8,000 tokens).
  std::vector<std::pair<std::vector<TableBlock>, std::vector<int64_t>>> built(
      static_cast<size_t>(listed));
  for (int i = 0; i < listed; ++i) {
    const Listed& w = where[static_cast<size_t>(i)];
    const StreamTable& st = table->streams[d.stream(i)];
    const int run_end = w.run + static_cast<int>(d.run_count(i));
    if (w.in_place) {
      std::vector<TableBlock>& blocks = table->streams[d.stream(i)].blocks;
      if (d.block_count(i) > blocks.capacity()) {  // contents unchanged; growth amortized
        blocks.reserve(std::max<size_t>(d.block_count(i), 2 * blocks.capacity()));
      }
      continue;
    }
    // Where each held block's positions start, when positions are kept.
    std::vector<size_t> first_slot;
    if (table->positions) {
      first_slot.reserve(st.blocks.size() + 1);
      first_slot.push_back(0);
      for (const TableBlock& b : st.blocks) first_slot.push_back(first_slot.back() + b.count);
    }
    std::vector<TableBlock>& blocks = built[static_cast<size_t>(i)].first;
    std::vector<int64_t>& positions = built[static_cast<size_t>(i)].second;
    blocks.reserve(d.block_count(i));
    int r = w.run, g = w.given, slot = w.position;
    while (blocks.size() < d.block_count(i)) {
      if (r < run_end && d.kept_at(r) == blocks.size()) {
        const uint32_t from = d.kept_from(r), count = d.kept_count(r);
        blocks.insert(blocks.end(), st.blocks.begin() + from, st.blocks.begin() + from + count);
        if (table->positions) {
          positions.insert(positions.end(),
                           st.positions.begin() + static_cast<ptrdiff_t>(first_slot[from]),
                           st.positions.begin() + static_cast<ptrdiff_t>(first_slot[from + count]));
        }
        ++r;
        continue;
      }
      blocks.push_back(given_entry(g));
      if (table->positions) {
        positions.insert(positions.end(), d.positions().begin() + slot,
                         d.positions().begin() + slot + d.block_counts(g));
        slot += static_cast<int>(d.block_counts(g));
      }
      ++g;
    }
  }
  for (int i = 0; i < listed; ++i) {  // nothing here allocates
    const Listed& w = where[static_cast<size_t>(i)];
    StreamTable& st = table->streams[d.stream(i)];
    if (!w.in_place) {
      st.blocks = std::move(built[static_cast<size_t>(i)].first);
      if (table->positions) st.positions = std::move(built[static_cast<size_t>(i)].second);
      continue;
    }
    // Kept runs stay where they are; the given entries fill the indices between them.
    st.blocks.resize(d.block_count(i));
    const int run_end = w.run + static_cast<int>(d.run_count(i));
    size_t at = 0;
    int g = w.given;
    for (int r = w.run; r <= run_end; ++r) {
      const size_t run_at = r < run_end ? d.kept_at(r) : st.blocks.size();
      for (; at < run_at; ++at, ++g) st.blocks[at] = given_entry(g);
      if (r < run_end) at = run_at + d.kept_count(r);
    }
  }
  table->version = d.version();
  table->epoch = d.epoch();
  return true;
}

template <typename Out>
void AddSignals(const std::vector<StreamSignal>& in, Out* out) {
  for (const StreamSignal& s : in) {
    auto* row = out->Add();
    row->set_layer(s.layer);
    row->set_kv_head(s.kv_head);
    if constexpr (std::is_same_v<std::decay_t<decltype(*row)>, v1::AttentionRow>) {
      row->mutable_weights()->Add(s.values.begin(), s.values.end());
    } else {
      row->mutable_scores()->Add(s.values.begin(), s.values.end());
    }
  }
}

// The client_table of a request that should bring `table` up to date.
void HoldTable(const BlockTable& table, v1::ClientTable* out) {
  out->set_version(table.version);
  out->set_positions(table.positions);
}

}  // namespace

namespace internal {
absl::Status FromRpcStatusForChannel(const google::rpc::Status& rich) {
  return FromRpcStatus(rich);
}
bool ApplyTableUpdate(uint64_t sequence_id, const v1::TableUpdate& update, BlockTable* table) {
  return ApplyUpdate(sequence_id, update, table);
}
}  // namespace internal

std::optional<uint64_t> CurrentEpoch(const absl::Status& status) {
  const auto payload = status.GetPayload(kCurrentEpochPayload);
  uint64_t epoch = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &epoch)) return std::nullopt;
  return epoch;
}

uint32_t DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// The first block of the arena a StepBatch builds its messages in (one per calling thread):
// room for a one-sequence step of SmolLM2's shape with its answer, K/V included.
constexpr size_t kArenaFirstBlock = 256 << 10;

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> stub;
  // The same-host step channel, when open (OpenStepChannel); a closed one is dropped at
  // the next StepBatch.
  absl::Mutex step_mu;
  std::shared_ptr<internal::StepChannelClient> step_channel ABSL_GUARDED_BY(step_mu);
  std::atomic<uint64_t> channel_batches{0};
  // While the caller wants a channel (OpenStepChannel succeeded, no CloseStepChannel since):
  // the capacity it asked for, and when a dropped channel may be opened again.
  std::optional<uint64_t> wanted_capacity ABSL_GUARDED_BY(step_mu);
  absl::Time reopen_at ABSL_GUARDED_BY(step_mu) = absl::InfinitePast();
  absl::Duration reopen_wait ABSL_GUARDED_BY(step_mu);
  // A reopened channel whose wait stays doubled until it answers a batch: read without the
  // lock on every answered batch, so that only the first after a reopen takes it.
  std::atomic<bool> reopen_unconfirmed{false};

  std::shared_ptr<internal::StepChannelClient> StepChannel() {
    absl::MutexLock lock(&step_mu);
    return step_channel;
  }
  // StepBatch's channel: the open one, or one opened again in place of a channel that closed
  // once its wait has passed (one thread tries; the others go by gRPC meanwhile).
  std::shared_ptr<internal::StepChannelClient> ChannelForBatch() {
    uint64_t capacity = 0;
    {
      absl::MutexLock lock(&step_mu);
      if (step_channel != nullptr || !wanted_capacity || absl::Now() < reopen_at) {
        return step_channel;
      }
      capacity = *wanted_capacity;
      reopen_wait = std::min(2 * reopen_wait, absl::Minutes(1));  // the wait if this fails
      reopen_at = absl::Now() + reopen_wait;
    }
    // The call's own deadline: a daemon that refuses a channel answers at once, and one
    // that does not answer would hold the batch as long over gRPC.
    absl::StatusOr<std::unique_ptr<internal::StepChannelClient>> opened =
        internal::StepChannelClient::Open(stub.get(), capacity, options.deadline);
    absl::MutexLock lock(&step_mu);
    // Kept only while still wanted and not replaced meanwhile (OpenStepChannel). The wait
    // stays doubled until the new channel answers a batch (ChannelAnswered): one that opens
    // but fails every batch is not reopened every first wait.
    if (opened.ok() && wanted_capacity && step_channel == nullptr) {
      step_channel = *std::move(opened);
      reopen_at = absl::InfinitePast();
      reopen_unconfirmed.store(true, std::memory_order_relaxed);
    }
    return step_channel;
  }
  void ChannelAnswered() {
    if (!reopen_unconfirmed.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&step_mu);
    reopen_wait = FirstReopenWait();
    reopen_unconfirmed.store(false, std::memory_order_relaxed);
  }
  void DropStepChannel(const internal::StepChannelClient* gone) {
    std::shared_ptr<internal::StepChannelClient> dropped;
    absl::MutexLock lock(&step_mu);
    if (step_channel.get() != gone) return;
    dropped = std::move(step_channel);
    reopen_at = absl::Now() + reopen_wait;  // never, for an infinite wait
  }
  absl::Duration FirstReopenWait() const {
    return std::max(options.step_channel_reopen, absl::Milliseconds(1));
  }

  // The step signals of each sequence's policy (sequences this client created or forked):
  // Step sends no others. Filled from GetInfo at the first CreateSequence.
  struct Needs {
    bool logit_stats = true, attention_rows = true;
  };
  std::atomic<uint64_t> table_refetches{0};
  absl::Mutex mu;
  absl::flat_hash_map<std::string, Needs> policy_needs ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<uint64_t, Needs> sequence_needs ABSL_GUARDED_BY(mu);

  Needs NeedsOf(uint64_t sequence_id) {
    absl::MutexLock lock(&mu);
    auto it = sequence_needs.find(sequence_id);
    return it == sequence_needs.end() ? Needs{} : it->second;
  }

  // The step request's signals, without those the sequence's policy does not use.
  template <typename Signals>
  void FillSignals(uint64_t sequence_id, const StepArgs& args, Signals* q) {
    const Needs needs = NeedsOf(sequence_id);
    q->set_epoch(args.epoch);
    if (args.logit_stats && needs.logit_stats) {
      v1::LogitStats* ls = q->mutable_logit_stats();
      ls->set_entropy(args.logit_stats->entropy);
      ls->set_p1(args.logit_stats->p1);
      ls->set_p2(args.logit_stats->p2);
      ls->mutable_top_logprobs()->Add(args.logit_stats->top_logprobs.begin(),
                                      args.logit_stats->top_logprobs.end());
    }
    if (!needs.attention_rows) return;
    if (!args.attention_f16) {
      AddSignals(args.attention, q->mutable_attention());
      return;
    }
    for (const StreamSignal& s : args.attention) {
      v1::AttentionRow* row = q->add_attention();
      row->set_layer(s.layer);
      row->set_kv_head(s.kv_head);
      std::string* half = row->mutable_weights_f16();
      half->resize(2 * s.values.size());
      kernels::FloatToHalf(s.values.data(), s.values.size(), half->data());  // little-endian
    }
  }

  // Applies a call's table update to `table`; when it cannot apply (the table moved under
  // a concurrent call), fetches the whole table instead.
  absl::Status Sync(uint64_t sequence_id, const v1::TableUpdate& update, BlockTable* table);
  // Notes which step signals sequence `sequence_id` (policy `policy`) uses.
  void RecordPolicy(Client* client, uint64_t sequence_id, const std::string& policy);
  absl::StatusOr<BlockTable> FetchTable(uint64_t sequence_id, bool positions);

  // Runs one call; gRPC retries it by the channel's retry policy.
  template <typename Attempt>
  absl::Status Call(Attempt attempt) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(options.deadline));
    context.set_wait_for_ready(options.wait_for_ready);
    return FromGrpc(attempt(context));
  }
};

// 128 random bits, hex: one per mutating call, repeated by its retries.
std::string NewRequestId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16), absl::Hex(rng(), absl::kZeroPad16));
}

// gRPC's retry policy for every KvCache method: mutating ones are safe to retry because
// they carry request ids (the daemon answers a repeat with the first response).
std::string ServiceConfig(const ClientOptions& o) {
  return absl::StrCat(
      R"({"methodConfig":[{"name":[{"service":"kvmem.v1.KvCache"}],"retryPolicy":{)",
      R"("maxAttempts":)", std::min(o.max_attempts, 5), R"(,"initialBackoff":")",
      absl::ToDoubleSeconds(o.initial_backoff), R"(s","maxBackoff":")",
      absl::ToDoubleSeconds(o.max_backoff),
      R"(s","backoffMultiplier":2,"retryableStatusCodes":["UNAVAILABLE"]}}]})");
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty address");
  if (options.max_attempts < 1 || options.max_attempts > 5) {
    return absl::InvalidArgumentError("options.max_attempts: must be in [1, 5] (gRPC's limit)");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (options.max_attempts > 1) args.SetServiceConfigJSON(ServiceConfig(options));
  impl->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::KvCache::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<Info> Client::GetInfo() {
  v1::GetInfoResponse r;
  absl::Status s = impl_->Call(
      [&](grpc::ClientContext& c) { return impl_->stub->GetInfo(&c, v1::GetInfoRequest(), &r); });
  if (!s.ok()) return s;
  Info info;
  info.version = r.version();
  info.backend = r.backend();
  info.device_name = r.device_name();
  info.pool_bytes = r.pool_bytes();
  info.pool_free_bytes = r.pool_free_bytes();
  info.page_bytes = r.page_bytes();
  info.default_block_tokens = r.default_block_tokens();
  info.max_sequences = r.max_sequences();
  info.default_lease = FromProto(r.default_lease());
  info.max_lease = FromProto(r.max_lease());
  info.max_message_bytes = r.max_message_bytes();
  info.device_step = r.device_step();
  for (const v1::PolicyInfo& p : r.policies()) {
    PolicyInfo pi{p.name(),
                  p.description(),
                  {},
                  ToVector(p.step_signals()),
                  ToVector(p.compress_signals()),
                  ToVector(p.append_signals())};
    for (const v1::ParamInfo& param : p.params()) {
      pi.params.push_back({param.name(), param.default_value(), param.min_value(),
                           param.max_value(), param.description()});
    }
    info.policies.push_back(std::move(pi));
  }
  for (const v1::QuantizerInfo& q : r.quantizers()) {
    info.quantizers.push_back({static_cast<Precision>(q.precision()), q.name(), q.description()});
  }
  info.default_quantization_recent_tokens = r.default_quantization_recent_tokens();
  switch (r.pool_export_case()) {
    case v1::GetInfoResponse::kSharedMemory:
      info.shm_name = r.shared_memory().name();
      info.shm_bytes = r.shared_memory().segment_bytes();
      break;
    case v1::GetInfoResponse::kCudaIpc:
      info.cuda_ipc_handle = r.cuda_ipc().handle();
      info.cuda_device_uuid = r.cuda_ipc().device_uuid();
      info.cuda_pool_bytes = r.cuda_ipc().pool_bytes();
      break;
    case v1::GetInfoResponse::POOL_EXPORT_NOT_SET:
      break;
  }
  info.epoch_board_name = r.epoch_board().name();
  info.epoch_stride = r.epoch_board().stride();
  info.epoch_slots = r.epoch_board().slots();
  return info;
}

absl::StatusOr<Sequence> Client::CreateSequence(const Layout& layout, const PolicySpec& policy,
                                                std::optional<absl::Duration> lease,
                                                const Prompt* prompt) {
  v1::CreateSequenceRequest q;
  ToProto(layout, q.mutable_layout());
  ToProto(policy, q.mutable_policy());
  if (lease) ToProto(*lease, q.mutable_lease());
  if (prompt != nullptr) {
    q.mutable_prompt_token_ids()->Add(prompt->token_ids.begin(), prompt->token_ids.end());
    q.set_cache_salt(prompt->cache_salt);
    q.set_model(prompt->model);
    q.set_auto_publish(prompt->auto_publish);
    q.set_document_tokens(prompt->document_tokens);
  }
  q.set_request_id(NewRequestId());
  v1::CreateSequenceResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->CreateSequence(&c, q, &r); });
  if (!s.ok()) return s;
  impl_->RecordPolicy(this, r.sequence_id(), policy.name.value_or("full"));
  return Sequence{r.sequence_id(), FromProto(r.lease()), r.block_tokens(),        r.epoch_slot(),
                  r.epoch(),       r.table_version(),    r.reused_prefix_tokens()};
}

absl::StatusOr<AppendResult> Client::Append(uint64_t sequence_id, const AppendArgs& args,
                                            BlockTable* table) {
  v1::AppendRequest q;
  ToProto(args, sequence_id, &q);
  if (table != nullptr) HoldTable(*table, q.mutable_client_table());
  q.set_request_id(NewRequestId());
  v1::AppendResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Append(&c, q, &r); });
  if (!s.ok()) return s;
  if (table != nullptr) {
    if (absl::Status synced = impl_->Sync(sequence_id, r.table_update(), table); !synced.ok()) {
      return synced;
    }
  }
  return AppendResultOf(r);
}

absl::StatusOr<AppendResult> Client::AppendStream(uint64_t sequence_id,
                                                  absl::Span<const AppendArgs> chunks,
                                                  BlockTable* table) {
  v1::AppendStreamResponse r;
  const std::string request_id = NewRequestId();
  absl::Status s = impl_->Call([&](grpc::ClientContext& c) {
    std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
        impl_->stub->AppendStream(&c, &r);
    for (const AppendArgs& chunk : chunks) {
      v1::AppendStreamRequest q;
      ToProto(chunk, sequence_id, &q);
      if (&chunk == chunks.data()) {
        q.set_request_id(request_id);
        if (table != nullptr) HoldTable(*table, q.mutable_client_table());
      }
      if (!writer->Write(q)) break;  // the daemon ended the call; Finish() says why
    }
    writer->WritesDone();
    return writer->Finish();
  });
  if (!s.ok()) return s;
  if (table != nullptr) {
    if (absl::Status synced = impl_->Sync(sequence_id, r.table_update(), table); !synced.ok()) {
      return synced;
    }
  }
  return AppendResultOf(r);
}

absl::StatusOr<StepResult> Client::Step(uint64_t sequence_id, const StepArgs& args,
                                        BlockTable* table) {
  v1::StepRequest q;
  q.set_sequence_id(sequence_id);
  impl_->FillSignals(sequence_id, args, &q);
  if (table != nullptr) HoldTable(*table, q.mutable_client_table());
  q.set_request_id(NewRequestId());
  v1::StepResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Step(&c, q, &r); });
  if (!s.ok()) return s;
  if (table != nullptr) {
    if (absl::Status synced = impl_->Sync(sequence_id, r.table_update(), table); !synced.ok()) {
      return synced;
    }
  }
  return StepResultOf(r);
}

absl::StatusOr<std::vector<BatchResult>> Client::StepBatch(absl::Span<const BatchEntry> entries) {
  // The request and the response live in an arena: the response of a batch is one
  // TableDelta per changed stream (90 for SmolLM2), whose messages and repeated fields would
  // otherwise each be allocated and freed one by one, every decode step. The arena's first
  // block is this thread's, reused from call to call.
  // A call nested on the same thread (a callback, a fiber) gets an arena of its own.
  thread_local std::unique_ptr<char[]> first_block(new char[kArenaFirstBlock]);
  thread_local bool first_block_in_use = false;
  google::protobuf::ArenaOptions arena_options;
  const bool own_block = !first_block_in_use;
  if (own_block) {
    arena_options.initial_block = first_block.get();
    arena_options.initial_block_size = kArenaFirstBlock;
    first_block_in_use = true;
  }
  absl::Cleanup release_block = [own_block] {
    if (own_block) first_block_in_use = false;
  };
  google::protobuf::Arena arena(arena_options);
  v1::StepBatchRequest& q = *google::protobuf::Arena::CreateMessage<v1::StepBatchRequest>(&arena);
  for (const BatchEntry& e : entries) {
    v1::StepBatchEntry* entry = q.add_entries();
    entry->set_sequence_id(e.sequence_id);
    if (e.append) FillTokens(*e.append, entry->mutable_append());
    if (e.step) impl_->FillSignals(e.sequence_id, *e.step, entry->mutable_step());
    if (e.table != nullptr) HoldTable(*e.table, entry->mutable_client_table());
  }
  q.set_request_id(NewRequestId());
  v1::StepBatchResponse& r = *google::protobuf::Arena::CreateMessage<v1::StepBatchResponse>(&arena);
  absl::Status s;
  bool answered = false;
  if (std::shared_ptr<internal::StepChannelClient> ch = impl_->ChannelForBatch()) {
    using Outcome = internal::StepChannelClient::Outcome;
    const Outcome outcome = ch->Call(q, absl::Now() + impl_->options.deadline, &r, &s);
    answered = outcome == Outcome::kAnswered;
    if (answered) {
      impl_->channel_batches.fetch_add(1, std::memory_order_relaxed);
      impl_->ChannelAnswered();
    }
    // A closed channel is dropped: this and later batches go by gRPC, this one under the
    // same request_id, which answers it once whether or not the channel ran it.
    if (outcome == Outcome::kChannelGone || ch->gone()) impl_->DropStepChannel(ch.get());
  }
  if (!answered) {
    r.Clear();
    s = impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->StepBatch(&c, q, &r); });
  }
  if (!s.ok()) return s;
  if (r.results_size() != static_cast<int>(entries.size())) {
    return absl::InternalError(
        absl::StrCat("StepBatch: ", r.results_size(), " results for ", entries.size(), " entries"));
  }
  std::vector<BatchResult> out(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const v1::StepBatchResult& result = r.results(static_cast<int>(i));
    out[i].status = FromRpcStatus(result.status());
    if (result.has_append()) out[i].appended = AppendResultOf(result.append());
    if (result.has_step()) out[i].step = StepResultOf(result.step());
    // An entry of which something applied but that came back without an update (the
    // batch's updates passed the daemon's message limit) has its table fetched: Sync
    // finds no update to apply.
    const bool applied = result.status().code() == 0 || result.has_append();
    if (entries[i].table != nullptr && (result.has_table_update() || applied)) {
      absl::Status synced =
          impl_->Sync(entries[i].sequence_id, result.table_update(), entries[i].table);
      if (!synced.ok() && out[i].status.ok()) out[i].status = synced;
    }
  }
  return out;
}

absl::StatusOr<CompressResult> Client::Compress(uint64_t sequence_id, const CompressArgs& args,
                                                BlockTable* table) {
  v1::CompressRequest q;
  q.set_sequence_id(sequence_id);
  q.set_epoch(args.epoch);
  if (args.target_tokens) q.set_target_tokens(*args.target_tokens);
  AddSignals(args.window_scores, q.mutable_window_scores());
  AddSignals(args.attention, q.mutable_attention());
  if (table != nullptr) HoldTable(*table, q.mutable_client_table());
  q.set_request_id(NewRequestId());
  v1::CompressResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Compress(&c, q, &r); });
  if (!s.ok()) return s;
  if (table != nullptr) {
    if (absl::Status synced = impl_->Sync(sequence_id, r.table_update(), table); !synced.ok()) {
      return synced;
    }
  }
  CompressResult out;
  out.evicted_tokens = r.evicted_tokens();
  out.quantized_tokens = r.quantized_tokens();
  out.kv_bytes_before = r.kv_bytes_before();
  out.kv_bytes_after = r.kv_bytes_after();
  out.epoch = r.epoch();
  out.table_version = r.table_version();
  for (const v1::LayerKept& l : r.layers()) {
    out.layers.push_back({l.layer(), l.kept_tokens(), l.before_tokens()});
  }
  return out;
}

absl::StatusOr<BlockTable> Client::GetBlockTable(uint64_t sequence_id, bool positions) {
  return impl_->FetchTable(sequence_id, positions);
}

absl::Status Client::OpenStepChannel(std::optional<uint64_t> capacity_bytes) {
  absl::StatusOr<std::unique_ptr<internal::StepChannelClient>> opened =
      internal::StepChannelClient::Open(impl_->stub.get(), capacity_bytes.value_or(8ull << 20),
                                        impl_->options.deadline);
  if (!opened.ok()) return opened.status();
  std::shared_ptr<internal::StepChannelClient> replaced;
  absl::MutexLock lock(&impl_->step_mu);
  replaced = std::move(impl_->step_channel);
  impl_->step_channel = *std::move(opened);
  impl_->wanted_capacity = impl_->step_channel->capacity();
  impl_->reopen_wait = impl_->FirstReopenWait();
  return absl::OkStatus();
}

void Client::CloseStepChannel() {
  std::shared_ptr<internal::StepChannelClient> closed;
  absl::MutexLock lock(&impl_->step_mu);
  closed = std::move(impl_->step_channel);
  impl_->wanted_capacity.reset();
}

bool Client::step_channel_open() const {
  std::shared_ptr<internal::StepChannelClient> ch = impl_->StepChannel();
  return ch != nullptr && !ch->gone();
}

uint64_t Client::step_channel_batches() const {
  return impl_->channel_batches.load(std::memory_order_relaxed);
}

uint64_t Client::table_refetches() const {
  return impl_->table_refetches.load(std::memory_order_relaxed);
}

absl::StatusOr<BlockTable> Client::Impl::FetchTable(uint64_t sequence_id, bool positions) {
  v1::GetBlockTableRequest q;
  q.set_sequence_id(sequence_id);
  q.set_positions(positions);
  v1::GetBlockTableResponse response;
  absl::Status s =
      Call([&](grpc::ClientContext& c) { return stub->GetBlockTable(&c, q, &response); });
  if (!s.ok()) return s;
  return FromProto(response.table());
}

absl::Status Client::Impl::Sync(uint64_t sequence_id, const v1::TableUpdate& update,
                                BlockTable* table) {
  if (ApplyUpdate(sequence_id, update, table)) return absl::OkStatus();
  // No update (the sequence went right after the call) or one for another version.
  table_refetches.fetch_add(1, std::memory_order_relaxed);
  absl::StatusOr<BlockTable> fetched = FetchTable(sequence_id, table->positions);
  if (fetched.ok()) {
    *table = *std::move(fetched);
  } else {
    // The call itself applied; the table is marked as none held, so that the next call gets
    // the whole table (or says why the sequence cannot serve), and as of no epoch, so that
    // a same-host read through it fails its check instead of reading an old table.
    table->version = 0;
    table->epoch = 0;
  }
  return absl::OkStatus();
}

void Client::Impl::RecordPolicy(Client* client, uint64_t sequence_id, const std::string& policy) {
  bool known;
  {
    absl::MutexLock lock(&mu);
    known = !policy_needs.empty();
  }
  if (!known) {
    absl::StatusOr<Info> info = client->GetInfo();
    if (!info.ok()) return;  // every signal is sent, as for a sequence of another client
    absl::MutexLock lock(&mu);
    for (const PolicyInfo& p : info->policies) {
      Needs needs{false, false};
      for (const std::string& s : p.step_signals) {
        if (s == "logit_stats") needs.logit_stats = true;
        if (s == "attention_rows") needs.attention_rows = true;
      }
      policy_needs[p.name] = needs;
    }
  }
  absl::MutexLock lock(&mu);
  auto it = policy_needs.find(policy);
  if (it != policy_needs.end()) sequence_needs[sequence_id] = it->second;
}

absl::StatusOr<std::vector<StreamKv>> Client::ReadKv(uint64_t sequence_id,
                                                     std::optional<uint64_t> epoch,
                                                     std::optional<LayerRange> layers) {
  v1::ReadKvRequest q;
  q.set_sequence_id(sequence_id);
  if (epoch) q.set_epoch(*epoch);
  if (layers) {
    q.mutable_layers()->set_begin(layers->begin);
    q.mutable_layers()->set_end(layers->end);
  }
  std::vector<StreamKv> out;
  absl::Status s = impl_->Call([&](grpc::ClientContext& c) {
    out.clear();
    std::unique_ptr<grpc::ClientReader<v1::ReadKvResponse>> reader = impl_->stub->ReadKv(&c, q);
    v1::ReadKvResponse chunk;
    while (reader->Read(&chunk)) {
      // A stream comes in pieces, in order: a piece past a stream's first continues it.
      if (chunk.first_slot() > 0) {
        if (out.empty() || out.back().layer != chunk.layer() ||
            out.back().kv_head != chunk.kv_head() ||
            out.back().positions.size() != chunk.first_slot()) {
          c.TryCancel();
          (void)reader->Finish();  // the call's own status does not matter: the read is bad
          return grpc::Status(grpc::StatusCode::INTERNAL,
                              absl::StrCat("ReadKv: a piece of stream (layer ", chunk.layer(),
                                           ", kv_head ", chunk.kv_head(), ") at slot ",
                                           chunk.first_slot(), " does not continue the read"));
        }
        StreamKv& stream = out.back();
        stream.positions.insert(stream.positions.end(), chunk.positions().begin(),
                                chunk.positions().end());
        stream.k.append(chunk.k());
        stream.v.append(chunk.v());
        continue;
      }
      out.push_back({chunk.layer(), chunk.kv_head(), chunk.epoch(), ToVector(chunk.positions()),
                     std::move(*chunk.mutable_k()), std::move(*chunk.mutable_v())});
    }
    return reader->Finish();
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<Sequence> Client::Fork(uint64_t sequence_id, std::optional<absl::Duration> lease) {
  v1::ForkRequest q;
  q.set_sequence_id(sequence_id);
  if (lease) ToProto(*lease, q.mutable_lease());
  q.set_request_id(NewRequestId());
  v1::ForkResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Fork(&c, q, &r); });
  if (!s.ok()) return s;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->sequence_needs.find(sequence_id);
    if (it != impl_->sequence_needs.end()) impl_->sequence_needs[r.sequence_id()] = it->second;
  }
  return Sequence{r.sequence_id(), FromProto(r.lease()), 0, r.epoch_slot(),
                  r.epoch(),       r.table_version()};
}

absl::StatusOr<uint64_t> Client::Release(uint64_t sequence_id) {
  v1::ReleaseRequest q;
  q.set_sequence_id(sequence_id);
  q.set_request_id(NewRequestId());
  v1::ReleaseResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Release(&c, q, &r); });
  if (!s.ok()) return s;
  return r.freed_blocks();
}

absl::StatusOr<std::vector<absl::Status>> Client::KeepAlive(
    absl::Span<const uint64_t> sequence_ids) {
  v1::KeepAliveRequest q;
  q.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
  v1::KeepAliveResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->KeepAlive(&c, q, &r); });
  if (!s.ok()) return s;
  std::vector<absl::Status> results;
  for (const v1::KeepAliveResult& one : r.results()) {
    results.emplace_back(static_cast<absl::StatusCode>(one.status().code()),
                         one.status().message());
  }
  return results;
}

absl::StatusOr<Stats> Client::GetStats(bool include_sequences) {
  // The largest page the daemon gives: the fewest round trips.
  constexpr uint32_t kPageSize = 1000;
  v1::StatsRequest q;
  q.set_include_sequences(include_sequences);
  if (include_sequences) q.set_page_size(kPageSize);
  Stats out;
  for (bool first = true;; first = false) {
    v1::StatsResponse r;
    absl::Status s =
        impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Stats(&c, q, &r); });
    if (!s.ok()) return s;
    if (first) {
      out.pool_bytes = r.pool_bytes();
      out.pool_used_bytes = r.pool_used_bytes();
      out.pool_free_bytes = r.pool_free_bytes();
      out.pages_total = r.pages_total();
      out.pages_used = r.pages_used();
      out.blocks_used = r.blocks_used();
      out.sequences_active = r.sequences_active();
      out.tokens_appended = r.tokens_appended();
      out.tokens_evicted = r.tokens_evicted();
      out.tokens_quantized = r.tokens_quantized();
      out.stream_slots_evicted = r.stream_slots_evicted();
      out.stream_slots_quantized = r.stream_slots_quantized();
      out.sequences_created = r.sequences_created();
      out.kv_bytes = r.kv_bytes();
      out.full_cache_bytes = r.full_cache_bytes();
      for (const v1::PolicyCounters& p : r.policies()) {
        out.policies.push_back({p.policy(), p.tokens_appended(), p.tokens_evicted(),
                                p.tokens_quantized(), p.stream_slots_evicted(),
                                p.stream_slots_quantized(), p.steps()});
      }
      out.steps = r.steps();
      out.leases_expired = r.leases_expired();
      out.slot_state_bytes = r.slot_state_bytes();
      out.host_metadata_bytes = r.host_metadata_bytes();
      out.host_metadata_budget_bytes = r.host_metadata_budget_bytes();
      out.sequences_poisoned = r.sequences_poisoned();
      out.prefix_queries = r.prefix().queries_total();
      out.prefix_hits = r.prefix().hits_total();
      out.prefix_reused_tokens = r.prefix().reused_tokens_total();
      out.prefix_reclaimed_bytes = r.prefix().reclaimed_bytes_total();
      out.prefix_entries = r.prefix().entries();
      out.prefix_indexed_blocks = r.prefix().indexed_blocks();
      out.prefix_cached_blocks = r.prefix().cached_blocks();
    }
    for (const v1::SequenceStats& seq : r.sequences()) {
      SequenceStats one{seq.sequence_id(),
                        seq.policy(),
                        seq.appended_tokens(),
                        seq.max_stream_tokens(),
                        seq.kv_bytes(),
                        seq.blocks(),
                        seq.epoch(),
                        seq.steps(),
                        FromProto(seq.lease_remaining()),
                        std::nullopt,
                        seq.pool_bytes_held(),
                        seq.quantization(),
                        seq.slot_state_bytes()};
      if (seq.has_parent_id()) one.parent_id = seq.parent_id();
      out.sequences.push_back(std::move(one));
    }
    if (r.next_page_token().empty()) return out;
    if (r.next_page_token() == q.page_token()) {
      return absl::InternalError("Stats: the daemon answered the same page token again");
    }
    q.set_page_token(r.next_page_token());
  }
}

absl::StatusOr<uint64_t> Client::Publish(uint64_t sequence_id,
                                         std::optional<uint64_t> up_to_tokens) {
  v1::PublishRequest q;
  q.set_sequence_id(sequence_id);
  if (up_to_tokens) q.set_up_to_tokens(*up_to_tokens);
  v1::PublishResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Publish(&c, q, &r); });
  if (!s.ok()) return s;
  return r.published_tokens();
}

absl::StatusOr<uint64_t> Client::PublishDocument(uint64_t sequence_id) {
  v1::PublishRequest q;
  q.set_sequence_id(sequence_id);
  q.set_compressed_document(true);
  v1::PublishResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Publish(&c, q, &r); });
  if (!s.ok()) return s;
  return r.published_tokens();
}

absl::StatusOr<uint64_t> Client::Lookup(const Layout& layout, const Prompt& prompt,
                                        const PolicySpec& policy) {
  v1::LookupRequest q;
  ToProto(layout, q.mutable_layout());
  q.set_document_tokens(prompt.document_tokens);
  ToProto(policy, q.mutable_policy());
  q.mutable_token_ids()->Add(prompt.token_ids.begin(), prompt.token_ids.end());
  q.set_cache_salt(prompt.cache_salt);
  q.set_model(prompt.model);
  v1::LookupResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->Lookup(&c, q, &r); });
  if (!s.ok()) return s;
  return r.matched_tokens();
}

}  // namespace kvmem::client
