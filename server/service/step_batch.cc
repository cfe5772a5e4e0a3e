// The decode loop's handlers: StepBatch over gRPC and through same-host step channels
// (their signal areas included), one RunStepBatch for both.
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/step_channel.h"
#include "server/common/parallel.h"
#include "server/service/convert.h"
#include "server/service/daemon_info.h"
#include "server/service/kv_cache_service.h"

namespace kvmem::service {

grpc::Status KvCacheService::StepBatch(grpc::ServerContext* context,
                                       const v1::StepBatchRequest* request,
                                       v1::StepBatchResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  return RunStepBatch(context, call->who, *request, engine_->config().max_append_bytes, response);
}

namespace {

// An entry's attention rows from its channel's signal area (StepSignals.attention_offset).
absl::StatusOr<engine::StepInput> AttentionFromArea(const v1::StepSignals& step,
                                                    const transport::StepChannel* channel,
                                                    engine::StepInput input, uint64_t* budget,
                                                    SignalStorage* storage, AreaValues* values) {
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
      step.attention_offset(), "attention_offset", budget, storage, values);
  if (!rows.ok()) return rows.status();
  input.attention = *std::move(rows);
  return input;
}

}  // namespace

grpc::Status KvCacheService::RunStepBatch(grpc::ServerContext* context, const Principal& who,
                                          const v1::StepBatchRequest& request_message,
                                          uint64_t max_update_bytes,
                                          v1::StepBatchResponse* response,
                                          const transport::StepChannel* channel) {
  const v1::StepBatchRequest* const request = &request_message;
  std::vector<std::optional<engine::TableUpdate>> updates;  // per entry, kept out of the cache
  const grpc::Status status =
      RunMutation(context, who, "StepBatch", 0, *request, response, [&]() -> absl::Status {
        const int n = request->entries_size();
        if (n == 0 || n > kMaxBatchEntries) {
          return absl::InvalidArgumentError(
              absl::StrCat("entries: ", n, " entries; a batch has 1 to ", kMaxBatchEntries));
        }
        std::vector<engine::StepCall> calls(n);
        std::vector<SignalStorage> storage(n);
        std::vector<AreaValues> area_values(n);  // rows' values still to read from the area
        // The signal area's bytes the batch's entries may copy, in all (SignalsFromArea).
        uint64_t area_budget = channel != nullptr ? channel->signal_bytes() : 0;
        for (int i = 0; i < n; ++i) {
          const v1::StepBatchEntry& entry = request->entries(i);
          engine::StepCall& call = calls[i];
          call.sequence_id = entry.sequence_id();
          // Another tenant's sequence is an unknown one, entry by entry.
          if (absl::Status s = Owns(who, call.sequence_id); !s.ok()) call.rejected = s;
          if (entry.has_append()) {
            call.append = ChunkView(entry.append());
            call.plan_id = entry.append().plan_id();
          }
          call.plan_tokens = entry.plan_tokens();
          if (entry.has_step()) {
            absl::StatusOr<engine::StepInput> input = StepInputView(entry.step(), &storage[i]);
            if (input.ok() && entry.step().has_attention_offset()) {
              input = AttentionFromArea(entry.step(), channel, *std::move(input), &area_budget,
                                        &storage[i], &area_values[i]);
            }
            if (input.ok()) {
              call.step = *std::move(input);
            } else {
              call.rejected = absl::Status(input.status().code(),
                                           absl::StrCat("step.", input.status().message()));
            }
          }
          call.held = HeldFromProto(entry);
          if (call.held) call.held->from_area = entry.client_table().from_area();
        }
        // The rows' values (most of a batch's bytes), read and widened across cores.
        auto read_values = [&](size_t i) {
          const AreaValues& v = area_values[i];
          if (v.out == nullptr || !calls[i].rejected.ok()) return;
          absl::Status read =
              channel->ReadSignalValues(v.offset, v.count, v.f16, v.out, "attention_offset");
          if (!read.ok()) {
            calls[i].rejected = absl::Status(read.code(), absl::StrCat("step.", read.message()));
          }
        };
        const bool any = std::any_of(area_values.begin(), area_values.end(),
                                     [](const AreaValues& v) { return v.out != nullptr; });
        if (any) {  // an entry per core, or all on this thread (a grain of the whole batch)
          ParallelFor(calls.size(), engine_->config().parallel_batches ? 1 : calls.size(),
                      [&](size_t begin, size_t end) {
                        for (size_t i = begin; i < end; ++i) read_values(i);
                      });
        }
        // A fault in one read zeroes the area under the others, which may not fault
        // themselves: then nothing any of them read is used.
        if (any && channel->signals_broken()) {
          for (size_t i = 0; i < calls.size(); ++i) {
            if (area_values[i].out == nullptr || !calls[i].rejected.ok()) continue;
            calls[i].rejected = absl::FailedPreconditionError(
                "step.signal area: shrunk by the client; nothing read from it was used; open a "
                "new channel");
          }
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
    v1::StepBatchResult* result = response->mutable_results(i);
    // A version in the table area costs 8 bytes: named whatever the limit.
    if (i < static_cast<int>(updates.size()) && updates[i] && updates[i]->in_area) {
      result->set_table_in_area(updates[i]->version);
      continue;
    }
    // Past the limit nothing more is converted: a cleared message keeps its memory (the
    // channel's arena), so converting each update to drop it would hold them all.
    if (update_bytes > max_update_bytes) break;
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
  uint64_t auth_seen = auth_->generation();  // before the call is authenticated
  // The channel serves its opener: every batch through it runs as this call's principal,
  // and counts among the opener's calls in flight for the channel's life (a drain does not
  // wait for it: the gate's ticket goes when the channel is set up).
  Principal who;
  TenantCalls::Ticket place;
  {
    absl::StatusOr<Admitted> call = Admit(context);
    if (!call.ok()) return ToGrpc(call.status());
    who = call->who;
    place = std::move(call->tenant_ticket);
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
    response.set_segment_bytes(channel->segment_bytes());
    response.set_capacity_bytes(channel->capacity());
    response.set_layout_version(v1::step_channel::kLayoutVersion);
    response.set_nonce(channel->nonce());
    response.set_signal_bytes(channel->signal_bytes());
    if (attach_ != nullptr) {
      std::vector<transport::AttachSocket::Grant> grants = {
          {v1::attach::kChannel, channel->segment(), true}};
      if (signal_bytes > 0)
        grants.push_back({v1::attach::kSignalArea, channel->signal_segment(), true});
      FillAttachTicket(*attach_, std::move(grants), who.tenant, response.mutable_attach());
    }
    if (!writer->Write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client left before the channel opened");
    }
  }
  // Each request takes its own ticket, so that a drain waits for a batch in flight but not
  // for an idle channel; the loop notices the drain, or the client leaving, within a tick.
  const uint64_t max_update_bytes =
      std::min(engine_->config().max_append_bytes, channel->capacity() / 2);
  // A reload that revokes the opener's token ends the channel: its next batch runs nothing.
  absl::Status revoked = absl::OkStatus();
  const transport::StepChannel::Handler handler = [&](const v1::StepBatchRequest& batch,
                                                      v1::StepBatchResponse* response) {
    const CallGate::Ticket call = gate_.Enter();
    if (!call.admitted()) return ToGrpc(DrainingError());
    revoked = auth_->StillValid(context, who, &auth_seen);
    if (!revoked.ok()) return ToGrpc(revoked);
    return RunStepBatch(/*context=*/nullptr, who, batch, max_update_bytes, response, channel.get());
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
    // A reload that revoked the opener's token ends an idle channel too.
    if (revoked.ok() && auth_->generation() != auth_seen) {
      revoked = auth_->StillValid(context, who, &auth_seen);
    }
    if (!revoked.ok() && !channel->chunks_pending()) return ToGrpc(revoked);
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

}  // namespace kvmem::service
