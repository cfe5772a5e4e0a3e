#include "server/service/kv_cache_service.h"

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvmem/v1/step_channel.h"
#include "server/common/client_text.h"
#include "server/service/convert.h"
#include "server/service/daemon_info.h"

namespace kvmem::service {

absl::Status KvCacheService::StillWanted(grpc::ServerContext* context, absl::string_view method) {
  // The deadline only: IsCancelled() polls the call's completion queue on the sync server,
  // work on every decode step; a cancelled call's answer is dropped by gRPC anyway.
  if (context != nullptr && context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        absl::StrCat(method, ": the call's deadline passed before it ran; nothing was applied"));
  }
  return absl::OkStatus();
}

grpc::Status KvCacheService::GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*,
                                     v1::GetInfoResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  DescribeDaemon(*engine_, version_, response);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::CreateSequence(grpc::ServerContext* context,
                                            const v1::CreateSequenceRequest* request,
                                            v1::CreateSequenceResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  return RunMutation(context, "CreateSequence", 0, *request, response, [&]() -> absl::Status {
    if (!request->has_layout()) {
      return absl::InvalidArgumentError("layout: required");
    }
    const engine::EngineConfig& config = engine_->config();
    absl::StatusOr<engine::Layout> layout =
        FromProto(request->layout(), config.default_block_tokens);
    if (!layout.ok()) return layout.status();
    absl::StatusOr<std::string> policy_name = PolicyNameFromProto(request->policy());
    if (!policy_name.ok()) return policy_name.status();
    policy::ParamOverrides params(request->policy().params().begin(),
                                  request->policy().params().end());
    absl::StatusOr<engine::QuantConfig> quant = QuantFromProto(request->policy());
    if (!quant.ok()) return quant.status();
    absl::StatusOr<absl::Duration> lease =
        LeaseFromProto(request->has_lease() ? &request->lease() : nullptr, "lease", config);
    if (!lease.ok()) return lease.status();
    engine::PromptPrefix prompt;
    prompt.model = request->model();
    prompt.salt = request->cache_salt();
    prompt.token_ids =
        absl::MakeConstSpan(request->prompt_token_ids().data(), request->prompt_token_ids().size());
    prompt.auto_publish = request->auto_publish();
    prompt.document_tokens = request->document_tokens();
    absl::StatusOr<engine::CreateResult> created =
        engine_->CreateSequence(*layout, *policy_name, params, *quant, *lease, prompt);
    if (!created.ok()) return created.status();
    response->set_sequence_id(created->sequence_id);
    response->set_reused_prefix_tokens(static_cast<uint32_t>(created->reused_prefix_tokens));
    ToProto(absl::Seconds(created->lease_seconds), response->mutable_lease());
    response->set_block_tokens(created->block_tokens);
    response->set_epoch_slot(created->epoch_slot);
    response->set_epoch(created->epoch);
    response->set_table_version(created->version);
    return absl::OkStatus();
  });
}

namespace {
// AppendResponse or AppendStreamResponse.
template <typename Response>
void FillAppendResponse(uint64_t id, const engine::AppendResult& r, Response* out) {
  out->set_sequence_id(id);
  out->set_appended_tokens(r.appended_tokens);
  out->set_max_stream_tokens(r.max_stream_tokens);
  out->set_epoch(r.epoch);
  out->set_kv_bytes(r.kv_bytes);
  out->set_table_version(r.version);
}
}  // namespace

grpc::Status KvCacheService::Append(grpc::ServerContext* context, const v1::AppendRequest* request,
                                    v1::AppendResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(context, "Append", id, *request, response, held, &update,
                     [&]() -> absl::Status {
                       const engine::AppendChunk chunk = ChunkView(*request);
                       absl::StatusOr<engine::AppendResult> result =
                           engine_->Append(id, absl::MakeConstSpan(&chunk, 1), held);
                       if (!result.ok()) return result.status();
                       FillAppendResponse(id, *result, response);
                       update = std::move(result->table);
                       return absl::OkStatus();
                     });
}

grpc::Status KvCacheService::AppendStream(grpc::ServerContext* context,
                                          grpc::ServerReader<v1::AppendStreamRequest>* reader,
                                          v1::AppendStreamResponse* response) {
  const CallGate::Ticket call = gate_.Enter();  // held through the stream (a drain waits)
  if (!call.admitted()) return ToGrpc(DrainingError());
  absl::StatusOr<AppendStreamBudget::Lease> held = streams_.Open(context);
  if (!held.ok()) return ToGrpc(held.status());
  v1::AppendStreamRequest request;
  if (!reader->Read(&request)) {
    return ToGrpc(context->IsCancelled()
                      ? absl::CancelledError("AppendStream: cancelled before its first chunk")
                      : absl::InvalidArgumentError("AppendStream: no chunk was sent"));
  }
  const uint64_t id = request.sequence_id();
  const std::optional<engine::HeldTable> table = HeldFromProto(request);  // the first chunk's
  std::optional<engine::TableUpdate> update;
  if (absl::Status s = StillWanted(context, "AppendStream"); !s.ok()) return ToGrpc(s, id);
  bool ran = false;                                  // else replayed
  const bool keyed = !request.request_id().empty();  // (the chunks are cleared as they go)
  // Each chunk goes into pool blocks reserved for the stream as it arrives (the engine's
  // AppendSession), so the daemon holds one chunk at a time, not the stream; the whole
  // stream is applied at its end, or nothing is. A retry under the same request_id must
  // resend the whole stream: every chunk counts in its fingerprint.
  auto run = [&](uint64_t* whole) -> absl::Status {
    ran = true;
    absl::StatusOr<std::unique_ptr<engine::AppendSession>> session = engine_->BeginAppend(id);
    if (!session.ok()) return session.status();
    size_t index = 0;
    do {
      if (request.sequence_id() != id) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunk ", index, ": sequence_id: ", request.sequence_id(),
                         " differs from the stream's first chunk (", id, ")"));
      }
      if (keyed) *whole = RequestCache::StreamFingerprint(*whole, request);
      const uint64_t bytes = request.ByteSizeLong();
      if (absl::Status s = held->Reserve(bytes); !s.ok()) return s;
      absl::Status added = (*session)->Add(ChunkView(request));
      held->Return(bytes);
      held->Touch();
      if (!added.ok()) return added;
      ++index;
      request.Clear();
    } while (reader->Read(&request));
    // Read() also ends when the client cancels or its connection breaks: only a stream that
    // the client closed is applied.
    if (context->IsCancelled()) {
      return absl::CancelledError(
          "AppendStream: the stream was cancelled or broken before its end; nothing was "
          "appended");
    }
    absl::StatusOr<engine::AppendResult> result = (*session)->Commit(table);
    if (!result.ok()) return result.status();
    FillAppendResponse(id, *result, response);
    update = std::move(result->table);
    return absl::OkStatus();
  };
  // A repeat of a stream that applied: its chunks are read and fingerprinted, not applied.
  auto rest = [&]() -> absl::StatusOr<uint64_t> {
    uint64_t whole = 0;
    do {
      const uint64_t bytes = request.ByteSizeLong();
      if (absl::Status s = held->Reserve(bytes); !s.ok()) return s;
      whole = RequestCache::StreamFingerprint(whole, request);
      held->Return(bytes);
      held->Touch();
      request.Clear();
    } while (reader->Read(&request));
    if (context->IsCancelled()) {
      return absl::CancelledError("AppendStream: the repeated stream was cancelled or broken");
    }
    return whole;
  };
  const absl::Status status =
      requests_.RunStream("AppendStream", id, request, request.request_id(), response, run, rest);
  if (status.ok() && table) AnswerHeldTable(ran, id, *table, update, response);
  return ToGrpc(status, id);
}

grpc::Status KvCacheService::Step(grpc::ServerContext* context, const v1::StepRequest* request,
                                  v1::StepResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(context, "Step", id, *request, response, held, &update, [&]() -> absl::Status {
    SignalStorage storage;
    absl::StatusOr<engine::StepInput> input = StepInputView(*request, &storage);
    if (!input.ok()) return input.status();
    absl::StatusOr<engine::StepResult> result = engine_->Step(id, *input, held);
    if (!result.ok()) return result.status();
    ToProto(*result, response);
    update = std::move(result->table);
    return absl::OkStatus();
  });
}

void KvCacheService::FillTableUpdate(uint64_t id, const engine::HeldTable& held,
                                     uint64_t version_before, v1::TableUpdate* out) {
  // After a mutation that applied: if the sequence went meanwhile (released, lapsed), the
  // response goes without an update and the client's next call finds out why.
  absl::StatusOr<engine::TableUpdate> update =
      engine_->GetTableUpdate(id, held.version, held.positions, version_before);
  if (update.ok()) ToProto(*update, out);
}

grpc::Status KvCacheService::StepBatch(grpc::ServerContext* context,
                                       const v1::StepBatchRequest* request,
                                       v1::StepBatchResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  return RunStepBatch(context, *request, engine_->config().max_append_bytes, response);
}

namespace {

// An entry's attention rows from its channel's signal area (StepSignals.attention_offset).
absl::StatusOr<engine::StepInput> AttentionFromArea(const v1::StepSignals& step,
                                                    const transport::StepChannel* channel,
                                                    engine::StepInput input, uint64_t* budget,
                                                    SignalStorage* storage) {
  if (channel == nullptr) {
    return absl::InvalidArgumentError(
        "attention_offset: rows in a signal area come only through a step channel opened with "
        "signal_bytes; this batch came over gRPC");
  }
  if (!step.attention().empty()) {
    return absl::InvalidArgumentError(
        "attention_offset: set with attention rows in the message too; send one of the two");
  }
  absl::StatusOr<std::vector<engine::StreamSignal>> rows = SignalsFromArea(
      [channel](uint64_t offset, uint64_t bytes, void* out) {
        return channel->CopySignals(offset, bytes, out, "attention_offset");
      },
      step.attention_offset(), "attention_offset", budget, storage);
  if (!rows.ok()) return rows.status();
  input.attention = *std::move(rows);
  return input;
}

}  // namespace

grpc::Status KvCacheService::RunStepBatch(grpc::ServerContext* context,
                                          const v1::StepBatchRequest& request_message,
                                          uint64_t max_update_bytes,
                                          v1::StepBatchResponse* response,
                                          const transport::StepChannel* channel) {
  const v1::StepBatchRequest* const request = &request_message;
  std::vector<std::optional<engine::TableUpdate>> updates;  // per entry, kept out of the cache
  const grpc::Status status =
      RunMutation(context, "StepBatch", 0, *request, response, [&]() -> absl::Status {
        const int n = request->entries_size();
        if (n == 0 || n > kMaxBatchEntries) {
          return absl::InvalidArgumentError(
              absl::StrCat("entries: ", n, " entries; a batch has 1 to ", kMaxBatchEntries));
        }
        std::vector<engine::StepCall> calls(n);
        std::vector<SignalStorage> storage(n);
        // The signal area's bytes the batch's entries may copy, in all (SignalsFromArea).
        uint64_t area_budget = channel != nullptr ? channel->signal_bytes() : 0;
        for (int i = 0; i < n; ++i) {
          const v1::StepBatchEntry& entry = request->entries(i);
          engine::StepCall& call = calls[i];
          call.sequence_id = entry.sequence_id();
          if (entry.has_append()) {
            call.append = ChunkView(entry.append());
            call.plan_id = entry.append().plan_id();
          }
          call.plan_tokens = entry.plan_tokens();
          if (entry.has_step()) {
            absl::StatusOr<engine::StepInput> input = StepInputView(entry.step(), &storage[i]);
            if (input.ok() && entry.step().has_attention_offset()) {
              input = AttentionFromArea(entry.step(), channel, *std::move(input), &area_budget,
                                        &storage[i]);
            }
            if (input.ok()) {
              call.step = *std::move(input);
            } else {
              call.rejected = absl::Status(input.status().code(),
                                           absl::StrCat("step.", input.status().message()));
            }
          }
          call.held = HeldFromProto(entry);
        }
        absl::StatusOr<std::vector<engine::StepOutcome>> outcomes = engine_->StepBatch(calls);
        if (!outcomes.ok()) return outcomes.status();
        updates.resize(n);
        for (int i = 0; i < n; ++i) {
          engine::StepOutcome& out = (*outcomes)[i];
          v1::StepBatchResult* result = response->add_results();
          *result->mutable_status() = ToRpcStatus(out.status, calls[i].sequence_id);
          if (out.appended) {
            FillAppendResponse(calls[i].sequence_id, *out.appended, result->mutable_append());
          }
          if (out.step) ToProto(*out.step, result->mutable_step());
          if (out.plan && out.plan->ok()) ToProto(**out.plan, result->mutable_plan());
          if (out.plan && !out.plan->ok()) {
            *result->mutable_plan_status() = ToRpcStatus(out.plan->status(), calls[i].sequence_id);
          }
          updates[i] = std::move(out.table);
        }
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  // The table updates go in after the answer is kept for retries (a replay computes fresh
  // ones), and only up to --max-message-bytes in all: past it an entry's update is left
  // out, and a client that sees an applied entry without one fetches its table.
  uint64_t update_bytes = 0;
  for (int i = 0; i < response->results_size() && i < request->entries_size(); ++i) {
    const v1::StepBatchEntry& entry = request->entries(i);
    if (!entry.has_client_table()) continue;
    // Past the limit nothing more is converted: a cleared message keeps its memory (the
    // channel's arena), so converting each update to drop it would hold them all.
    if (update_bytes > max_update_bytes) break;
    v1::StepBatchResult* result = response->mutable_results(i);
    if (i < static_cast<int>(updates.size()) && updates[i]) {
      ToProto(*updates[i], result->mutable_table_update());
    } else if (result->status().code() == 0 || result->has_append()) {  // a replay
      const uint64_t made =
          std::max(result->append().table_version(), result->step().table_version());
      FillTableUpdate(entry.sequence_id(), *HeldFromProto(entry), ReplayedVersionBefore(made),
                      result->mutable_table_update());
    } else {
      continue;  // nothing of the entry applied: the client's table is still current
    }
    update_bytes += result->table_update().ByteSizeLong();
    if (update_bytes > max_update_bytes) {
      response->mutable_results(i)->clear_table_update();
    }
  }
  return grpc::Status::OK;
}

// Every batch's answer fits its channel once trimmed (transport::StepChannel::FitAnswer).
static_assert(KvCacheService::kMaxBatchEntries * transport::StepChannel::kMaxTrimmedResultBytes <=
              transport::StepChannel::MaxAnswerBytes(transport::StepChannel::kMinCapacity));

grpc::Status KvCacheService::OpenStepChannel(
    grpc::ServerContext* context, const v1::OpenStepChannelRequest* request,
    grpc::ServerWriter<v1::OpenStepChannelResponse>* writer) {
  std::optional<transport::StepChannelBudget::Lease>
      lease;  // given back after the channel is freed
  std::unique_ptr<transport::StepChannel> channel;
  {
    const CallGate::Ticket call = gate_.Enter();
    if (!call.admitted()) return ToGrpc(DrainingError());
    // Lengths in the segment are 32-bit: at most 1 GiB per area.
    const uint64_t max_capacity =
        std::min<uint64_t>(engine_->config().max_append_bytes + (4ull << 20), 1ull << 30);
    const uint64_t capacity = request->has_capacity_bytes()
                                  ? request->capacity_bytes()
                                  : transport::StepChannel::kDefaultCapacity;
    if (capacity < transport::StepChannel::kMinCapacity || capacity > max_capacity) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "capacity_bytes: ", capacity, " is outside [", transport::StepChannel::kMinCapacity, ", ",
          max_capacity, "] (1 MiB to --max-message-bytes + 4 MiB, at most 1 GiB)")));
    }
    const uint64_t signal_bytes = request->signal_bytes();
    if (signal_bytes > transport::StepChannel::kMaxSignalBytes) {
      return ToGrpc(absl::InvalidArgumentError(
          absl::StrCat("signal_bytes: ", signal_bytes, " is past the limit of ",
                       transport::StepChannel::kMaxSignalBytes, " (1 GiB)")));
    }
    absl::StatusOr<transport::StepChannelBudget::Lease> opened =
        channels_.Open(transport::StepChannel::HeldBytes(capacity, signal_bytes));
    if (!opened.ok()) return ToGrpc(opened.status());
    lease.emplace(*std::move(opened));
    absl::StatusOr<std::unique_ptr<transport::StepChannel>> created =
        transport::StepChannel::Create(
            capacity, [](const absl::Status& s) { return ToGrpc(s); }, signal_bytes);
    if (!created.ok()) return ToGrpc(created.status());
    channel = *std::move(created);
    v1::OpenStepChannelResponse response;
    response.set_name(channel->name());
    response.set_segment_bytes(channel->segment_bytes());
    response.set_capacity_bytes(channel->capacity());
    response.set_layout_version(v1::step_channel::kLayoutVersion);
    response.set_nonce(channel->nonce());
    if (signal_bytes > 0) {
      response.set_signal_name(channel->signal_name());
      response.set_signal_bytes(channel->signal_bytes());
    }
    if (!writer->Write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client left before the channel opened");
    }
  }
  // Each request takes its own ticket, so that a drain waits for a batch in flight but not
  // for an idle channel; the loop notices the drain, or the client leaving, within a tick.
  const uint64_t max_update_bytes =
      std::min(engine_->config().max_append_bytes, channel->capacity() / 2);
  const transport::StepChannel::Handler handler = [&](const v1::StepBatchRequest& batch,
                                                      v1::StepBatchResponse* response) {
    const CallGate::Ticket call = gate_.Enter();
    if (!call.admitted()) return ToGrpc(DrainingError());
    return RunStepBatch(/*context=*/nullptr, batch, max_update_bytes, response, channel.get());
  };
  // Each answer is counted as StepBatch's over gRPC are (the interceptor), before its
  // client sees it.
  transport::StepChannel::Recorder record;
  if (rpc_telemetry_ != nullptr) {
    record = [telemetry = rpc_telemetry_](const transport::StepChannel::Exchange& e) {
      telemetry->RecordChannelAnswer(e.batch, e.code, e.seconds, e.bytes_in, e.bytes_out);
    };
  }
  while (!context->IsCancelled()) {
    // A drain ends the channel, but not in the middle of an answer sent in chunks: the
    // batch ran, and its client gets the rest (or the drain's deadline cancels the call).
    if (gate_.closed() && !channel->chunks_pending()) return ToGrpc(DrainingError());
    const transport::StepChannel::Served served =
        channel->ServeOne(absl::Milliseconds(50), handler, record);
    if (served == transport::StepChannel::Served::kBroken) {
      return ToGrpc(absl::FailedPreconditionError(
          "step channel: its segment was shrunk by the client; the request read from it was "
          "not applied; open a new channel"));
    }
    if (served == transport::StepChannel::Served::kBrokenAfterRun) {
      return ToGrpc(absl::FailedPreconditionError(
          "step channel: its segment was shrunk by the client while the answer was written; "
          "the batch may have applied: repeat it with the same request_id to get its answer"));
    }
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the client closed the step channel");
}

grpc::Status KvCacheService::Compress(grpc::ServerContext* context,
                                      const v1::CompressRequest* request,
                                      v1::CompressResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(
      context, "Compress", id, *request, response, held, &update, [&]() -> absl::Status {
        SignalStorage storage;
        absl::StatusOr<engine::CompressInput> input = CompressInputView(*request, &storage);
        if (!input.ok()) return input.status();
        absl::StatusOr<engine::CompressResult> result = engine_->Compress(id, *input, held);
        if (!result.ok()) return result.status();
        ToProto(*result, response);
        update = std::move(result->table);
        return absl::OkStatus();
      });
}

grpc::Status KvCacheService::GetBlockTable(grpc::ServerContext*,
                                           const v1::GetBlockTableRequest* request,
                                           v1::GetBlockTableResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  absl::StatusOr<engine::BlockTable> table =
      engine_->GetBlockTable(request->sequence_id(), request->positions());
  if (!table.ok()) return ToGrpc(table.status(), request->sequence_id());
  ToProto(*table, table->layout.block_bytes(), response->mutable_table());
  return grpc::Status::OK;
}

grpc::Status KvCacheService::ReadKv(grpc::ServerContext* context, const v1::ReadKvRequest* request,
                                    grpc::ServerWriter<v1::ReadKvResponse>* writer) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  // The engine reads epoch 0 as "the current one" and the range [0, 0) as "every layer";
  // neither is a value a request can send (both are rejected below).
  uint64_t epoch = 0;
  if (request->has_epoch()) {
    if (request->epoch() == 0) {
      return ToGrpc(absl::InvalidArgumentError(
                        "epoch: 0 is not an epoch (epochs start at 1); leave the field out to "
                        "read the current epoch"),
                    id);
    }
    epoch = request->epoch();
  }
  uint32_t layer_begin = 0, layer_end = 0;
  if (request->has_layers()) {
    layer_begin = request->layers().begin();
    layer_end = request->layers().end();
    if (layer_end <= layer_begin) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
                        "layers: [", layer_begin, ", ", layer_end,
                        ") is empty; end must exceed begin (leave the field out for every layer)")),
                    id);
    }
  }
  absl::Status status = engine_->ReadKV(
      id, epoch, layer_begin, layer_end,
      [&](engine::StreamKV&& kv) {
        if (context->IsCancelled()) return absl::CancelledError("ReadKv: the client cancelled");
        v1::ReadKvResponse chunk;
        chunk.set_layer(kv.layer);
        chunk.set_kv_head(kv.kv_head);
        chunk.set_epoch(kv.epoch);
        chunk.set_first_slot(kv.first_slot);
        chunk.mutable_positions()->Add(kv.positions.begin(), kv.positions.end());
        chunk.set_k(std::move(kv.k));
        chunk.set_v(std::move(kv.v));
        if (!writer->Write(chunk)) return absl::CancelledError("ReadKv: the stream was closed");
        return absl::OkStatus();
      },
      kReadPieceBytes);
  // The engine names the range by its own parameters; the request's field is `layers`.
  constexpr absl::string_view kEngineRange = "layer_begin/layer_end: ";
  if (absl::IsInvalidArgument(status) && absl::StartsWith(status.message(), kEngineRange)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("layers: ", status.message().substr(kEngineRange.size())));
  }
  return ToGrpc(status, id);
}

grpc::Status KvCacheService::Fork(grpc::ServerContext* context, const v1::ForkRequest* request,
                                  v1::ForkResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  return RunMutation(context, "Fork", id, *request, response, [&]() -> absl::Status {
    absl::StatusOr<absl::Duration> lease = LeaseFromProto(
        request->has_lease() ? &request->lease() : nullptr, "lease", engine_->config());
    if (!lease.ok()) return lease.status();
    absl::StatusOr<engine::CreateResult> child = engine_->Fork(id, *lease);
    if (!child.ok()) return child.status();
    response->set_sequence_id(child->sequence_id);
    response->set_epoch_slot(child->epoch_slot);
    response->set_epoch(child->epoch);
    response->set_table_version(child->version);
    ToProto(absl::Seconds(child->lease_seconds), response->mutable_lease());
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::Publish(grpc::ServerContext*, const v1::PublishRequest* request,
                                     v1::PublishResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  std::optional<uint64_t> up_to;
  if (request->has_up_to_tokens()) up_to = request->up_to_tokens();
  if (up_to && request->compressed_document()) {
    return ToGrpc(absl::InvalidArgumentError(
        "up_to_tokens: a compressed document is published whole; leave it unset"));
  }
  absl::StatusOr<uint64_t> published =
      request->compressed_document() ? engine_->PublishDocument(id) : engine_->Publish(id, up_to);
  if (!published.ok()) return ToGrpc(published.status(), id);
  response->set_published_tokens(*published);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Lookup(grpc::ServerContext*, const v1::LookupRequest* request,
                                    v1::LookupResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  if (!request->has_layout()) return ToGrpc(absl::InvalidArgumentError("layout: required"));
  absl::StatusOr<engine::Layout> layout =
      FromProto(request->layout(), engine_->config().default_block_tokens);
  if (!layout.ok()) return ToGrpc(layout.status());
  engine::PromptPrefix prompt;
  prompt.model = request->model();
  prompt.salt = request->cache_salt();
  prompt.token_ids = absl::MakeConstSpan(request->token_ids().data(), request->token_ids().size());
  prompt.document_tokens = request->document_tokens();
  absl::StatusOr<std::string> policy_name = PolicyNameFromProto(request->policy());
  if (!policy_name.ok()) return ToGrpc(policy_name.status());
  policy::ParamOverrides params(request->policy().params().begin(),
                                request->policy().params().end());
  absl::StatusOr<engine::QuantConfig> quant = QuantFromProto(request->policy());
  if (!quant.ok()) return ToGrpc(quant.status());
  absl::StatusOr<uint64_t> matched = engine_->Lookup(*layout, prompt, *policy_name, params, *quant);
  if (!matched.ok()) return ToGrpc(matched.status());
  response->set_matched_tokens(*matched);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Release(grpc::ServerContext* context,
                                     const v1::ReleaseRequest* request,
                                     v1::ReleaseResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  const uint64_t id = request->sequence_id();
  return RunMutation(context, "Release", id, *request, response, [&]() -> absl::Status {
    absl::StatusOr<uint64_t> freed = engine_->Release(id);
    if (!freed.ok()) return freed.status();
    response->set_freed_blocks(*freed);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest* request,
                                       v1::KeepAliveResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  if (request->sequence_ids().empty()) {
    return ToGrpc(absl::InvalidArgumentError("sequence_ids: at least one id is required"));
  }
  // No more ids than sequences can exist: the answer holds a result per id.
  const uint32_t most = engine_->config().max_sequences;
  if (static_cast<uint64_t>(request->sequence_ids_size()) > most) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("sequence_ids: ", request->sequence_ids_size(), " ids; at most ", most,
                     " (the daemon's max_sequences) per call")));
  }
  const std::vector<absl::Status> results = engine_->KeepAlive(
      absl::MakeConstSpan(request->sequence_ids().data(), request->sequence_ids().size()));
  uint32_t renewed = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    v1::KeepAliveResult* out = response->add_results();
    out->set_sequence_id(request->sequence_ids(static_cast<int>(i)));
    out->mutable_status()->set_code(static_cast<int32_t>(results[i].code()));
    out->mutable_status()->set_message(std::string(results[i].message()));
    renewed += results[i].ok();
  }
  response->set_renewed(renewed);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Stats(grpc::ServerContext*, const v1::StatsRequest* request,
                                   v1::StatsResponse* response) {
  const CallGate::Ticket call = gate_.Enter();
  if (!call.admitted()) return ToGrpc(DrainingError());
  StatsPage page;
  if (absl::Status s = ReadStatsPage(*request, &page); !s.ok()) return ToGrpc(s);
  FillStatsPage(engine_->Stats(request->include_sequences()), page, response);
  return grpc::Status::OK;
}

}  // namespace kvmem::service
