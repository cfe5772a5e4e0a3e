// The RPC wrappers of kvmem/client.h: each builds its request (kvmem/convert.h), calls
// through the retrying channel and reads the answer, keeping a passed BlockTable current
// (kvmem/table_update.h); StepBatch goes through a step channel when one is open.
#include "kvmem/client.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/arena.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/convert.h"
#include "kvmem/credentials.h"
#include "kvmem/policy_signals.h"
#include "kvmem/step_channel_router.h"
#include "kvmem/table_area.h"
#include "kvmem/table_update.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::client {

using internal::AddSignals;
using internal::AppendResultOf;
using internal::CompressResultOf;
using internal::FillStepSignals;
using internal::FillTokens;
using internal::FromGrpc;
using internal::FromProto;
using internal::FromRpcStatus;
using internal::HoldTable;
using internal::InfoOf;
using internal::SequenceStatsOf;
using internal::StatsCountersOf;
using internal::StepResultOf;
using internal::ToProto;
using internal::ToVector;

uint32_t DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// The first block of the arena a StepBatch builds its messages in (one per calling thread):
// room for a one-sequence step of SmolLM2's shape with its answer, K/V included.
constexpr size_t kArenaFirstBlock = 256 << 10;

struct Client::Impl {
  Impl(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
      : options(options),
        authorization(internal::Authorization(options)),
        channel(std::move(channel)),
        stub(v1::KvCache::NewStub(this->channel)),
        step_channels(stub.get(), options.deadline, options.step_channel_reopen, authorization) {}

  const ClientOptions options;
  const std::string authorization;  // every call's metadata value; empty without a token
  const std::shared_ptr<grpc::Channel> channel;
  const std::unique_ptr<v1::KvCache::Stub> stub;
  internal::StepChannelRouter step_channels;  // StepBatch's same-host channel
  absl::Mutex area_mu;
  // The table area (AttachTableArea); a StepBatch takes its own reference.
  std::shared_ptr<const TableReader> tables ABSL_GUARDED_BY(area_mu);
  // The channel whose signal area signal_area() handed out last: the area that
  // StepArgs::attention_offset refers to.
  std::weak_ptr<internal::StepChannelClient> area_channel ABSL_GUARDED_BY(area_mu);
  // Learned from GetInfo at the first CreateSequence.
  internal::PolicySignals policy_signals;
  std::atomic<uint64_t> table_refetches{0};
  std::atomic<uint64_t> table_area_reads{0};

  // The step request's signals, without those the sequence's policy does not use.
  template <typename Signals>
  void FillSignals(uint64_t sequence_id, const StepArgs& args, Signals* q) {
    const internal::PolicySignals::Needs needs = policy_signals.Of(sequence_id);
    FillStepSignals(args, needs.logit_stats, needs.attention_rows, q);
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
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    return FromGrpc(attempt(context));
  }
};

namespace {

// `low` then `high`, two pieces of one table (layers in order); ABORTED when they are of
// different table versions.
absl::StatusOr<BlockTable> JoinTables(BlockTable low, BlockTable high) {
  if (low.version != high.version || low.epoch != high.epoch) {
    return absl::AbortedError("GetBlockTable: the table changed between its pieces");
  }
  for (StreamTable& s : high.streams) low.streams.push_back(std::move(s));
  return low;
}

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

}  // namespace

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target: empty address");
  if (options.max_attempts < 1 || options.max_attempts > 5) {
    return absl::InvalidArgumentError("options.max_attempts: must be in [1, 5] (gRPC's limit)");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (options.max_attempts > 1) args.SetServiceConfigJSON(ServiceConfig(options));
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      internal::ChannelCredentials(options, &args);
  if (!credentials.ok()) return credentials.status();
  auto impl =
      std::make_unique<Impl>(options, grpc::CreateCustomChannel(target, *credentials, args));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<Info> Client::GetInfo() {
  v1::GetInfoResponse r;
  absl::Status s = impl_->Call(
      [&](grpc::ClientContext& c) { return impl_->stub->GetInfo(&c, v1::GetInfoRequest(), &r); });
  if (!s.ok()) return s;
  return InfoOf(r);
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
  return Append(sequence_id, q, table);
}

absl::StatusOr<AppendResult> Client::Append(uint64_t sequence_id, const AppendArgs& args,
                                            const UcxTransfer& ucx_payload, BlockTable* table) {
  v1::AppendRequest q;
  AppendArgs tokens = args;
  tokens.k = tokens.v = {};  // they go by UCX
  ToProto(tokens, sequence_id, &q);
  q.mutable_ucx_payload()->set_transfer_hi(ucx_payload.transfer_hi);
  q.mutable_ucx_payload()->set_transfer_lo(ucx_payload.transfer_lo);
  q.mutable_ucx_payload()->set_bytes(ucx_payload.bytes);
  return Append(sequence_id, q, table);
}

absl::StatusOr<AppendResult> Client::Append(uint64_t sequence_id, v1::AppendRequest& q,
                                            BlockTable* table) {
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
  if (args.attention_offset) {
    return absl::InvalidArgumentError(
        "attention_offset: rows in a signal area go only in a StepBatch through a step channel");
  }
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
  std::shared_ptr<const TableReader> tables;
  {
    absl::MutexLock lock(&impl_->area_mu);
    tables = impl_->tables;
  }
  for (const BatchEntry& e : entries) {
    v1::StepBatchEntry* entry = q.add_entries();
    entry->set_sequence_id(e.sequence_id);
    if (e.append) FillTokens(*e.append, entry->mutable_append());
    if (e.written_plan != 0) entry->mutable_append()->set_plan_id(e.written_plan);
    if (e.step) impl_->FillSignals(e.sequence_id, *e.step, entry->mutable_step());
    if (e.table != nullptr) {
      HoldTable(*e.table, entry->mutable_client_table());
      if (tables && e.table->version != 0 && !e.table->positions) {
        entry->mutable_client_table()->set_from_area(true);
      }
    }
    if (e.plan_tokens != 0) entry->set_plan_tokens(e.plan_tokens);
  }
  q.set_request_id(NewRequestId());
  v1::StepBatchResponse& r = *google::protobuf::Arena::CreateMessage<v1::StepBatchResponse>(&arena);
  absl::Status s;
  bool answered = false;
  // Rows in a signal area are at offsets into the area signal_area() handed out last. A
  // batch that goes any other way than through that area's channel carries them in the
  // message instead (the area is still mapped: its SignalArea::keep holds it).
  std::shared_ptr<internal::StepChannelClient> area_channel;
  {
    absl::MutexLock lock(&impl_->area_mu);
    area_channel = impl_->area_channel.lock();
  }
  auto inline_rows = [&] {
    internal::InlineAreaRows(
        area_channel ? area_channel->signal_area() : absl::Span<const uint8_t>(), &q);
  };
  std::shared_ptr<internal::StepChannelClient> ch = impl_->step_channels.ForBatch();
  if (ch && ch != area_channel) inline_rows();
  if (ch) {
    using Outcome = internal::StepChannelClient::Outcome;
    const Outcome outcome = ch->Call(q, absl::Now() + impl_->options.deadline, &r, &s);
    answered = outcome == Outcome::kAnswered;
    if (answered) impl_->step_channels.Answered();
    // A closed channel is dropped: this and later batches go by gRPC, this one under the
    // same request_id, which answers it once whether or not the channel ran it.
    if (outcome == Outcome::kChannelGone || ch->gone()) impl_->step_channels.Drop(ch.get());
  }
  if (!answered) {
    inline_rows();
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
    if (result.has_plan()) {
      const v1::WritePlan& p = result.plan();
      out[i].plan = WritePlan{p.plan_id(),
                              p.tokens(),
                              {p.block_offsets().begin(), p.block_offsets().end()},
                              {p.first_slots().begin(), p.first_slots().end()}};
    }
    if (result.has_plan_status()) out[i].plan_status = FromRpcStatus(result.plan_status());
    // An entry of which something applied but that came back without an update (the
    // batch's updates passed the daemon's message limit) has its table fetched: Sync
    // finds no update to apply.
    const bool applied = result.status().code() == 0 || result.has_append();
    if (entries[i].table != nullptr && result.table_in_area() != 0 && tables &&
        tables->Read(result.table_in_area(), entries[i].table).ok()) {
      impl_->table_area_reads.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    if (entries[i].table != nullptr && (result.has_table_update() || applied)) {
      absl::Status synced =
          impl_->Sync(entries[i].sequence_id, result.table_update(), entries[i].table);
      if (!synced.ok() && out[i].status.ok()) out[i].status = synced;
    }
  }
  return out;
}

absl::Status Client::AttachTableArea() {
  absl::StatusOr<Info> info = GetInfo();
  if (!info.ok()) return info.status();
  absl::StatusOr<std::unique_ptr<TableReader>> reader = TableReader::Attach(*info);
  if (!reader.ok()) return reader.status();
  absl::MutexLock lock(&impl_->area_mu);
  impl_->tables = *std::move(reader);
  return absl::OkStatus();
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
  return CompressResultOf(r);
}

absl::StatusOr<BlockTable> Client::GetBlockTable(uint64_t sequence_id, bool positions) {
  return impl_->FetchTable(sequence_id, positions);
}

absl::Status Client::OpenStepChannel(std::optional<uint64_t> capacity_bytes,
                                     uint64_t signal_bytes) {
  return impl_->step_channels.Open(capacity_bytes.value_or(8ull << 20), signal_bytes);
}

Client::SignalArea Client::signal_area() const {
  std::shared_ptr<internal::StepChannelClient> channel = impl_->step_channels.current();
  if (channel == nullptr || channel->gone()) return {};
  if (!channel->signal_area().empty()) {
    absl::MutexLock lock(&impl_->area_mu);
    impl_->area_channel = channel;
  }
  const absl::Span<uint8_t> bytes = channel->signal_area();
  return {std::move(channel), bytes};
}

void Client::CloseStepChannel() { impl_->step_channels.Close(); }

bool Client::step_channel_open() const { return impl_->step_channels.open(); }

uint64_t Client::step_channel_batches() const { return impl_->step_channels.batches(); }

uint64_t Client::table_area_reads() const {
  return impl_->table_area_reads.load(std::memory_order_relaxed);
}

uint64_t Client::table_refetches() const {
  return impl_->table_refetches.load(std::memory_order_relaxed);
}

absl::StatusOr<BlockTable> Client::Impl::FetchTable(uint64_t sequence_id, bool positions) {
  // Layers [begin, end) (end 0: all); a piece too large for one message is asked for in
  // halves.
  std::function<absl::StatusOr<BlockTable>(uint32_t, uint32_t)> fetch =
      [&](uint32_t begin, uint32_t end) -> absl::StatusOr<BlockTable> {
    v1::GetBlockTableRequest q;
    q.set_sequence_id(sequence_id);
    q.set_positions(positions);
    if (end != 0) {
      q.mutable_layers()->set_begin(begin);
      q.mutable_layers()->set_end(end);
    }
    v1::GetBlockTableResponse response;
    absl::Status s =
        Call([&](grpc::ClientContext& c) { return stub->GetBlockTable(&c, q, &response); });
    if (s.ok()) return FromProto(response.table());
    if (!absl::IsResourceExhausted(s) || !absl::StartsWith(s.message(), "layers:")) return s;
    if (end == 0) {  // the whole table: its first layer tells how many there are
      absl::StatusOr<BlockTable> first = fetch(0, 1);
      if (!first.ok()) return first.status();
      end = first->layout.num_layers;
      if (end == 1) return first;
      absl::StatusOr<BlockTable> rest = fetch(1, end);
      if (!rest.ok()) return rest.status();
      return JoinTables(*std::move(first), *std::move(rest));
    }
    if (end - begin < 2) return s;  // one layer past the limit: nothing smaller to ask
    const uint32_t middle = begin + (end - begin) / 2;
    absl::StatusOr<BlockTable> low = fetch(begin, middle);
    if (!low.ok()) return low.status();
    absl::StatusOr<BlockTable> high = fetch(middle, end);
    if (!high.ok()) return high.status();
    return JoinTables(*std::move(low), *std::move(high));
  };
  // Pieces of different versions (the sequence changed between them) are fetched again.
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<BlockTable> table = fetch(0, 0);
    if (table.ok() || !absl::IsAborted(table.status()) || attempt == 2) return table;
  }
}

absl::Status Client::Impl::Sync(uint64_t sequence_id, const v1::TableUpdate& update,
                                BlockTable* table) {
  if (internal::ApplyTableUpdate(sequence_id, update, table)) return absl::OkStatus();
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
  if (!policy_signals.known()) {
    absl::StatusOr<Info> info = client->GetInfo();
    if (!info.ok()) return;  // every signal is sent, as for a sequence of another client
    policy_signals.Learn(*info);
  }
  policy_signals.Record(sequence_id, policy);
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
  impl_->policy_signals.Inherit(sequence_id, r.sequence_id());
  return Sequence{r.sequence_id(), FromProto(r.lease()), 0, r.epoch_slot(),
                  r.epoch(),       r.table_version()};
}

absl::StatusOr<Client::Moved> Client::MoveSequence(const std::string& from_node,
                                                   uint64_t sequence_id,
                                                   std::optional<absl::Duration> lease,
                                                   const std::string& transport) {
  v1::MoveSequenceRequest q;
  q.set_from_node(from_node);
  q.set_transport(transport);
  q.set_sequence_id(sequence_id);
  if (lease) ToProto(*lease, q.mutable_lease());
  q.set_request_id(NewRequestId());
  v1::MoveSequenceResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->MoveSequence(&c, q, &r); });
  if (!s.ok()) return s;
  impl_->RecordPolicy(this, r.sequence_id(), r.policy());
  Moved moved;
  moved.sequence = Sequence{r.sequence_id(), FromProto(r.lease()), 0, r.epoch_slot(),
                            r.epoch(),       r.table_version()};
  moved.bytes = r.bytes();
  moved.source_released = r.source_released();
  moved.transport = r.transport();
  return moved;
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
    if (first) out = StatsCountersOf(r);
    for (const v1::SequenceStats& seq : r.sequences()) {
      out.sequences.push_back(SequenceStatsOf(seq));
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

absl::StatusOr<Pulled> Client::PullPrefix(const Layout& layout, const Prompt& prompt,
                                          const PullOptions& options) {
  v1::PullPrefixRequest q;
  ToProto(layout, q.mutable_layout());
  q.mutable_token_ids()->Add(prompt.token_ids.begin(), prompt.token_ids.end());
  q.set_cache_salt(prompt.cache_salt);
  q.set_model(prompt.model);
  q.set_from_node(options.from_node);
  q.set_transport(options.transport);
  q.set_min_tokens(options.min_tokens);
  v1::PullPrefixResponse r;
  absl::Status s =
      impl_->Call([&](grpc::ClientContext& c) { return impl_->stub->PullPrefix(&c, q, &r); });
  if (!s.ok()) return s;
  return Pulled{r.local_tokens(), r.pulled_tokens(), r.holder_tokens(),
                r.bytes(),        r.from_node(),     r.transport()};
}

}  // namespace kvmem::client
