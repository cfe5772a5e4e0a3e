#include "server/service/kv_cache_service.h"

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/method_handler.h"
#include "kvmem/v1/step_channel.h"
#include "server/common/client_text.h"
#include "server/service/convert.h"
#include "server/service/daemon_info.h"
#include "server/transport/parse_cost.h"
#if KVMEM_WITH_UCX
#include "server/transport/ucx_plane.h"
#endif

namespace kvmem::service {

namespace {

// The engine names a layer range by its own parameters; a request's field is `layers`.
absl::Status LayersField(absl::Status status) {
  constexpr absl::string_view kEngineRange = "layer_begin/layer_end: ";
  if (!absl::StartsWith(status.message(), kEngineRange)) return status;
  return absl::Status(status.code(),
                      absl::StrCat("layers: ", status.message().substr(kEngineRange.size())));
}

}  // namespace

absl::Status KvCacheService::StillWanted(grpc::ServerContext* context, absl::string_view method) {
  // The deadline only: IsCancelled() polls the call's completion queue on the sync server,
  // work on every decode step; a cancelled call's answer is dropped by gRPC anyway.
  if (context != nullptr && context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        absl::StrCat(method, ": the call's deadline passed before it ran; nothing was applied"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvCacheService::Admitted> KvCacheService::Admit(const grpc::ServerContext* context) {
  CallGate::Ticket ticket = gate_.Enter();
  if (!ticket.admitted()) return DrainingError();
  absl::StatusOr<Principal> who = auth_->Authenticate(context);
  if (!who.ok()) return who.status();
  absl::StatusOr<TenantCalls::Ticket> place = tenant_calls_.Enter(who->tenant);
  if (!place.ok()) return place.status();
  return Admitted{std::move(ticket), *std::move(place), *std::move(who)};
}

absl::Status KvCacheService::Owns(const Principal& who, uint64_t id) const {
  return who.admin ? absl::OkStatus() : engine_->CheckOwner(id, who.tenant);
}

absl::StatusOr<std::string> KvCacheService::ForwardedBearer(const grpc::ServerContext* context,
                                                            absl::string_view method) const {
  // The caller's token goes to the holder, which scopes the calls to the same tenant.
  std::string bearer;
  if (auto it = context->client_metadata().find("authorization");
      it != context->client_metadata().end()) {
    bearer.assign(it->second.data(), it->second.size());
  }
  if (auth_->enabled() && bearer.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(method,
                     ": it acts on another node with the caller's bearer token, and this call came "
                     "without one (a TLS certificate or a unix peer cannot be forwarded)"));
  }
  return bearer;
}

absl::StatusOr<std::string> KvCacheService::ScopedSalt(const Principal& who,
                                                       const std::string& salt) {
  // A tenant name holds no '/' (Authenticator): "name/" begins no other tenant's salts.
  if (!who.tenant.empty()) return absl::StrCat("tenant:", who.tenant, "/", salt);
  // The anonymous principal (a daemon without tokens) could otherwise name a tenant's
  // chains on a daemon with them, through a fleet's shared index.
  if (absl::StartsWith(salt, "tenant:")) {
    return absl::InvalidArgumentError(
        "cache_salt: \"tenant:\" begins the salts kvmemd gives authenticated tenants; "
        "choose a salt that does not begin so");
  }
  return salt;
}

grpc::Status KvCacheService::GetInfo(grpc::ServerContext* context, const v1::GetInfoRequest*,
                                     v1::GetInfoResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  // Mapping the pool reads every tenant's K/V: its ticket goes to admins only, and to peers
  // (another kvmemd on this host moving a sequence to itself) read-only. A tenant with an
  // arena (--tenant-arena) maps its arena, which holds its blocks and no one else's, and the
  // epoch board (epoch words, no ids), not the table area (every sequence's table: ids,
  // offsets, lengths); with arenas an admin or a peer maps the shared part.
  const uint32_t arena = call->who.peer ? 0 : engine_->ArenaOf(call->who.tenant);
  DescribeDaemon(*engine_, version_, response,
                 call->who.reads_pool() || arena > 0 ? attach_ : nullptr, call->who.tenant,
                 /*read_only=*/!call->who.admin && arena == 0, arena,
                 /*tables=*/call->who.reads_pool());
  response->set_instance_id(instance_id_);
  // So does the pool's remote key, to admins and peers (another kvmemd's moves and pulls),
  // with the epoch board's shape its reads need; the worker's address (remote appends) goes
  // to every caller.
  if (ucx_ != nullptr) {
    DescribeUcx(*ucx_, call->who.reads_pool(), ucx_max_payload_bytes_, response->mutable_ucx());
    if (call->who.reads_pool() && !response->has_epoch_board()) {
      response->mutable_epoch_board()->set_stride(engine::EpochBoard::kStride);
      response->mutable_epoch_board()->set_slots(engine_->epoch_board().slots());
    }
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::CreateSequence(grpc::ServerContext* context,
                                            const v1::CreateSequenceRequest* request,
                                            v1::CreateSequenceResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  return RunMutation(
      context, call->who, "CreateSequence", 0, *request, response, [&]() -> absl::Status {
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
        absl::StatusOr<std::string> salt = ScopedSalt(call->who, request->cache_salt());
        if (!salt.ok()) return salt.status();
        prompt.salt = *std::move(salt);
        prompt.owner = call->who.tenant;
        prompt.token_ids = absl::MakeConstSpan(request->prompt_token_ids().data(),
                                               request->prompt_token_ids().size());
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

grpc::Status KvCacheService::Append(grpc::ServerContext* context, const v1::AppendRequest* request,
                                    v1::AppendResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(context, call->who, "Append", id, *request, response, held, &update,
                     [&]() -> absl::Status {
                       if (absl::Status s = Owns(call->who, id); !s.ok()) {
                         RefuseUcxPayload(*request);
                         return s;
                       }
                       engine::AppendChunk chunk = ChunkView(*request);
                       std::shared_ptr<const transport::RemotePayload> payload;
                       if (request->has_ucx_payload()) {
                         absl::StatusOr<std::shared_ptr<const transport::RemotePayload>> landed =
                             ReceiveUcxPayload(context, id, *request);
                         if (!landed.ok()) return landed.status();
                         payload = *std::move(landed);
                         const absl::string_view kv = payload->bytes();
                         chunk.k = kv.substr(0, kv.size() / 2);
                         chunk.v = kv.substr(kv.size() / 2);
                       }
                       absl::StatusOr<engine::AppendResult> result =
                           engine_->Append(id, absl::MakeConstSpan(&chunk, 1), held);
                       if (!result.ok()) return result.status();
                       FillAppendResponse(id, *result, response);
                       update = std::move(result->table);
                       return absl::OkStatus();
                     });
}

absl::StatusOr<std::shared_ptr<const transport::RemotePayload>> KvCacheService::ReceiveUcxPayload(
    grpc::ServerContext* context, uint64_t sequence_id, const v1::AppendRequest& request) {
#if KVMEM_WITH_UCX
  const v1::UcxPayload& p = request.ucx_payload();
  if (ucx_ == nullptr) {
    return absl::FailedPreconditionError(
        "ucx_payload: this kvmemd runs no UCX worker (kvmemd --ucx); send k and v instead");
  }
  const transport::UcxPlane::TransferId id{p.transfer_hi(), p.transfer_lo()};
  // Checked before anything is reserved or waited for; a refused call's message is dropped
  // at once (its sender learns it).
  absl::Status checked = [&]() -> absl::Status {
    if (!request.k().empty() || !request.v().empty()) {
      return absl::InvalidArgumentError(
          "ucx_payload: set with k or v bytes (the message carries both; leave them empty)");
    }
    if ((id.hi | id.lo) == 0) {
      return absl::InvalidArgumentError("ucx_payload.transfer_hi/lo: 0 (draw a random id)");
    }
    absl::StatusOr<engine::Layout> layout = engine_->LayoutOf(sequence_id);
    if (!layout.ok()) return layout.status();
    const uint64_t expected =
        2 * uint64_t{layout->num_streams()} * request.positions_size() * layout->row_bytes();
    if (p.bytes() != expected || expected == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ucx_payload.bytes: ", p.bytes(), " is not the K+V of ", request.positions_size(),
          " positions in this sequence's layout (", expected, " bytes)"));
    }
    if (p.bytes() > ucx_max_payload_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("ucx_payload.bytes: ", p.bytes(),
                                                     " is past --ucx-max-payload-bytes (",
                                                     ucx_max_payload_bytes_, ")"));
    }
    return absl::OkStatus();
  }();
  if (!checked.ok()) {
    ucx_->Refuse(id);
    return checked;
  }
  // Announced payloads wait in a budget of their own: calls that announce and never send
  // hold up other remote appends at worst, not every request's parse.
  absl::StatusOr<transport::ParseBudget::Reservation> reserved =
      ucx_budget_.Reserve(p.bytes(), "Append's ucx_payload (--ucx-payload-memory-bytes)");
  if (!reserved.ok()) {
    ucx_->Refuse(id);
    return reserved.status();
  }
  const absl::Time deadline =
      std::min(absl::FromChrono(context->deadline()), absl::Now() + ucx_payload_timeout_);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const transport::RemotePayload>> landed;
  try {
    landed = ucx_->Receive(id, p.bytes(), *std::move(reserved), deadline,
                           [context] { return context->IsCancelled(); });
  } catch (const std::bad_alloc&) {
    ucx_->Refuse(id);
    return absl::ResourceExhaustedError(
        absl::StrCat("ucx_payload.bytes: kvmemd could not allocate ", p.bytes(), " bytes"));
  }
  if (landed.ok()) ucx_payload_seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return landed;
#else
  (void)context;
  (void)sequence_id;
  (void)request;
  return absl::FailedPreconditionError("ucx_payload: this kvmemd was built without UCX");
#endif
}

void KvCacheService::RefuseUcxPayload(const v1::AppendRequest& request) {
#if KVMEM_WITH_UCX
  if (ucx_ != nullptr && request.has_ucx_payload()) {
    ucx_->Refuse({request.ucx_payload().transfer_hi(), request.ucx_payload().transfer_lo()});
  }
#else
  (void)request;
#endif
}

const char* KvCacheService::MethodName(absl::string_view name) {
  method_names_.push_back(absl::StrCat("/", v1::KvCache::service_full_name(), "/", name));
  return method_names_.back().c_str();
}

template <typename Request, typename Response>
void KvCacheService::AddUnary(const char* name,
                              grpc::Status (KvCacheService::*handler)(grpc::ServerContext*,
                                                                      const Request*, Response*)) {
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodName(name), grpc::internal::RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<KvCacheService, Parsed<Request>, Response,
                                           Parsed<Request>, google::protobuf::MessageLite>(
          [handler](KvCacheService* service, grpc::ServerContext* context,
                    const Parsed<Request>* request, Response* response) {
            if (grpc::Status s = service->ParseFor(context, *request); !s.ok()) return s;
            return (service->*handler)(context, &request->message, response);
          },
          this)));
}

template <typename Request, typename Response, template <class> class Writer>
void KvCacheService::AddServerStreaming(
    const char* name, grpc::Status (KvCacheService::*handler)(grpc::ServerContext*, const Request*,
                                                              Writer<Response>*)) {
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodName(name), grpc::internal::RpcMethod::SERVER_STREAMING,
      new grpc::internal::ServerStreamingHandler<KvCacheService, Parsed<Request>, Response>(
          [handler](KvCacheService* service, grpc::ServerContext* context,
                    const Parsed<Request>* request, grpc::ServerWriter<Response>* writer) {
            if (grpc::Status s = service->ParseFor(context, *request); !s.ok()) return s;
            return (service->*handler)(context, &request->message, writer);
          },
          this)));
}

grpc::Status KvCacheService::ParseFor(const grpc::ServerContext* context,
                                      const ParsedBase& request) {
  absl::StatusOr<Principal> who = auth_->Authenticate(context);
  if (!who.ok()) return ToGrpc(who.status());
  // The parse holds one of the tenant's calls in flight (--tenant-max-calls), so that one
  // tenant's concurrent requests cannot all be parsing at once; the handler's Admit takes
  // its own place after it.
  absl::StatusOr<TenantCalls::Ticket> place = tenant_calls_.Enter(who->tenant);
  if (!place.ok()) return ToGrpc(place.status());
  // gRPC hands the request it made (and owns) as const; its bytes are parsed in place.
  const absl::Status parsed = const_cast<ParsedBase&>(request).Parse();
  return parsed.ok() ? grpc::Status::OK : ToGrpc(parsed);
}

void KvCacheService::RegisterMethods() {
  AddUnary("GetInfo", &KvCacheService::GetInfo);
  AddUnary("CreateSequence", &KvCacheService::CreateSequence);
  AddUnary("Append", &KvCacheService::Append);
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodName("AppendStream"), grpc::internal::RpcMethod::CLIENT_STREAMING,
      new grpc::internal::ClientStreamingHandler<KvCacheService, Parsed<v1::AppendStreamRequest>,
                                                 v1::AppendStreamResponse>(
          [](KvCacheService* service, grpc::ServerContext* context,
             grpc::ServerReader<Parsed<v1::AppendStreamRequest>>* reader,
             v1::AppendStreamResponse* response) {
            ParsedReader<v1::AppendStreamRequest> parsed(reader);
            return service->AppendStream(context, &parsed, response);
          },
          this)));
  AddUnary("Step", &KvCacheService::Step);
  AddUnary("StepBatch", &KvCacheService::StepBatch);
  AddServerStreaming("OpenStepChannel", &KvCacheService::OpenStepChannel);
  AddUnary("Compress", &KvCacheService::Compress);
  AddUnary("GetBlockTable", &KvCacheService::GetBlockTable);
  AddServerStreaming("ReadKv", &KvCacheService::ReadKv);
  AddUnary("Fork", &KvCacheService::Fork);
  AddUnary("Publish", &KvCacheService::Publish);
  AddUnary("Lookup", &KvCacheService::Lookup);
  AddUnary("PullPrefix", &KvCacheService::PullPrefix);
  AddUnary("MoveSequence", &KvCacheService::MoveSequence);
  AddServerStreaming("ExportSequence", &KvCacheService::ExportSequence);
  AddUnary("FinishExport", &KvCacheService::FinishExport);
  AddUnary("Release", &KvCacheService::Release);
  AddUnary("KeepAlive", &KvCacheService::KeepAlive);
  AddUnary("Stats", &KvCacheService::Stats);
}

grpc::Status KvCacheService::AppendStream(grpc::ServerContext* context,
                                          MessageReader<v1::AppendStreamRequest>* reader,
                                          v1::AppendStreamResponse* response) {
  // Before the call is authenticated: a reload after it is seen at the commit.
  const uint64_t opened_generation = auth_->generation();
  // The ticket is held through the stream (a drain waits).
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  absl::StatusOr<AppendStreamBudget::Lease> held = streams_.Open(context);
  if (!held.ok()) return ToGrpc(held.status());
  v1::AppendStreamRequest request;
  if (!reader->Read(&request)) {
    if (!reader->refused().ok()) return ToGrpc(reader->refused());
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
    if (absl::Status s = Owns(call->who, id); !s.ok()) return s;
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
    // A chunk refused (it does not parse, or its parse is past the budget) ends Read() too:
    // the stream applies nothing.
    if (!reader->refused().ok()) {
      return absl::Status(reader->refused().code(),
                          absl::StrCat("chunk ", index, ": ", reader->refused().message(),
                                       "; nothing of the stream was appended"));
    }
    // Read() also ends when the client cancels or its connection breaks: only a stream that
    // the client closed is applied.
    if (context->IsCancelled()) {
      return absl::CancelledError(
          "AppendStream: the stream was cancelled or broken before its end; nothing was "
          "appended");
    }
    // A reload that revoked the token meanwhile: the stream applies nothing.
    uint64_t seen = opened_generation;
    if (absl::Status s = auth_->StillValid(context, call->who, &seen); !s.ok()) return s;
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
    if (!reader->refused().ok()) return reader->refused();
    if (context->IsCancelled()) {
      return absl::CancelledError("AppendStream: the repeated stream was cancelled or broken");
    }
    return whole;
  };
  const absl::Status status = requests_.RunStream("AppendStream", call->who.tenant, id, request,
                                                  request.request_id(), response, run, rest);
  if (status.ok() && table) AnswerHeldTable(ran, id, *table, update, response);
  return ToGrpc(status, id);
}

grpc::Status KvCacheService::Step(grpc::ServerContext* context, const v1::StepRequest* request,
                                  v1::StepResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(context, call->who, "Step", id, *request, response, held, &update,
                     [&]() -> absl::Status {
                       if (absl::Status s = Owns(call->who, id); !s.ok()) return s;
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

grpc::Status KvCacheService::Compress(grpc::ServerContext* context,
                                      const v1::CompressRequest* request,
                                      v1::CompressResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  const std::optional<engine::HeldTable> held = HeldFromProto(*request);
  std::optional<engine::TableUpdate> update;
  return RunMutation(
      context, call->who, "Compress", id, *request, response, held, &update, [&]() -> absl::Status {
        if (absl::Status s = Owns(call->who, id); !s.ok()) return s;
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

grpc::Status KvCacheService::GetBlockTable(grpc::ServerContext* context,
                                           const v1::GetBlockTableRequest* request,
                                           v1::GetBlockTableResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  if (absl::Status s = Owns(call->who, request->sequence_id()); !s.ok()) {
    return ToGrpc(s, request->sequence_id());
  }
  uint32_t layer_begin = 0, layer_end = 0;
  if (request->has_layers()) {
    layer_begin = request->layers().begin();
    layer_end = request->layers().end();
    if (layer_end == 0) {  // [0, 0) would mean every layer to the engine
      return ToGrpc(absl::InvalidArgumentError("layers: end 0 is not past begin"),
                    request->sequence_id());
    }
  }
  absl::StatusOr<engine::BlockTable> table =
      engine_->GetBlockTable(request->sequence_id(), request->positions(), layer_begin, layer_end,
                             engine_->config().max_append_bytes);
  if (!table.ok()) return ToGrpc(LayersField(table.status()), request->sequence_id());
  ToProto(*table, table->layout.block_bytes(), response->mutable_table());
  response->set_instance_id(instance_id_);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::ReadKv(grpc::ServerContext* context, const v1::ReadKvRequest* request,
                                    grpc::ServerWriterInterface<v1::ReadKvResponse>* writer) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  if (absl::Status s = Owns(call->who, id); !s.ok()) return ToGrpc(s, id);
  // Held while the stream is open: a client that stops taking pieces is cancelled after
  // --read-stream-idle-seconds (the server's reaper), which frees this thread.
  absl::StatusOr<AppendStreamBudget::Lease> open = reads_.Open(context);
  if (!open.ok()) return ToGrpc(open.status(), id);
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
        if (!writer->Write(chunk)) {
          return absl::CancelledError(
              "ReadKv: the stream was closed (the client left, or took no piece for "
              "--read-stream-idle-seconds)");
        }
        open->Touch();
        return absl::OkStatus();
      },
      kReadPieceBytes);
  return ToGrpc(LayersField(status), id);
}

grpc::Status KvCacheService::Fork(grpc::ServerContext* context, const v1::ForkRequest* request,
                                  v1::ForkResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  return RunMutation(context, call->who, "Fork", id, *request, response, [&]() -> absl::Status {
    if (absl::Status s = Owns(call->who, id); !s.ok()) return s;
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

grpc::Status KvCacheService::Publish(grpc::ServerContext* context,
                                     const v1::PublishRequest* request,
                                     v1::PublishResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  if (absl::Status s = Owns(call->who, id); !s.ok()) return ToGrpc(s, id);
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

grpc::Status KvCacheService::Lookup(grpc::ServerContext* context, const v1::LookupRequest* request,
                                    v1::LookupResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  if (!request->has_layout()) return ToGrpc(absl::InvalidArgumentError("layout: required"));
  absl::StatusOr<engine::Layout> layout =
      FromProto(request->layout(), engine_->config().default_block_tokens);
  if (!layout.ok()) return ToGrpc(layout.status());
  engine::PromptPrefix prompt;
  prompt.model = request->model();
  absl::StatusOr<std::string> salt = ScopedSalt(call->who, request->cache_salt());
  if (!salt.ok()) return ToGrpc(salt.status());
  prompt.salt = *std::move(salt);
  prompt.owner = call->who.tenant;
  prompt.token_ids = absl::MakeConstSpan(request->token_ids().data(), request->token_ids().size());
  prompt.document_tokens = request->document_tokens();
  prompt.token_ids_field = "token_ids";
  absl::StatusOr<std::string> policy_name = PolicyNameFromProto(request->policy());
  if (!policy_name.ok()) return ToGrpc(policy_name.status());
  policy::ParamOverrides params(request->policy().params().begin(),
                                request->policy().params().end());
  absl::StatusOr<engine::QuantConfig> quant = QuantFromProto(request->policy());
  if (!quant.ok()) return ToGrpc(quant.status());
  absl::StatusOr<uint64_t> matched = engine_->Lookup(*layout, prompt, *policy_name, params, *quant);
  if (!matched.ok()) return ToGrpc(matched.status());
  response->set_matched_tokens(*matched);
  if (!request->fleet()) return grpc::Status::OK;
  if (cluster_index_ == nullptr) {
    return ToGrpc(
        absl::FailedPreconditionError("fleet: this kvmemd has no cluster index (--cluster-index)"));
  }
  absl::StatusOr<engine::PrefixPublisher::Chain> chain =
      engine_->FleetChain(*layout, prompt, ClusterIndex::kMaxLookupBlocks);
  if (!chain.ok()) return ToGrpc(chain.status());
  FleetAnswer fleet;
  if (prompt.document_tokens > 0) {
    fleet.unavailable =
        "a prompt that starts with a document has no fleet answer (a "
        "compressed document is its node's own)";
  } else {
    fleet = cluster_index_->Lookup(chain->ns, chain->hashes);
  }
  v1::FleetAnswer* out = response->mutable_fleet();
  out->set_available(fleet.available);
  out->set_unavailable(fleet.unavailable);
  const uint64_t B = layout->block_tokens;  // FromProto gave it the default if unset
  for (const FleetHolder& h : fleet.holders) {
    v1::FleetHolder* holder = out->add_holders();
    holder->set_node(h.node);
    holder->set_matched_tokens(h.blocks * B);
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::PullPrefix(grpc::ServerContext* context,
                                        const v1::PullPrefixRequest* request,
                                        v1::PullPrefixResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  if (puller_ == nullptr) {
    return ToGrpc(absl::FailedPreconditionError(
        "PullPrefix: this kvmemd has no cluster index (--cluster-index)"));
  }
  if (!request->has_layout()) return ToGrpc(absl::InvalidArgumentError("layout: required"));
  absl::StatusOr<engine::Layout> layout =
      FromProto(request->layout(), engine_->config().default_block_tokens);
  if (!layout.ok()) return ToGrpc(layout.status());
  absl::StatusOr<std::string> bearer = ForwardedBearer(context, "PullPrefix");
  if (!bearer.ok()) return ToGrpc(bearer.status());
  absl::StatusOr<std::string> salt = ScopedSalt(call->who, request->cache_salt());
  if (!salt.ok()) return ToGrpc(salt.status());
  engine::PromptPrefix prompt;
  prompt.model = request->model();
  prompt.salt = *std::move(salt);
  prompt.owner = call->who.tenant;
  prompt.token_ids = absl::MakeConstSpan(request->token_ids().data(), request->token_ids().size());
  prompt.token_ids_field = "token_ids";
  v1::Layout layout_proto = request->layout();
  layout_proto.set_block_tokens(layout->block_tokens);
  const PullAsk ask{request->from_node(), request->transport(), request->min_tokens()};
  absl::StatusOr<PullResult> pulled = puller_->Pull(
      context, layout_proto, *layout, prompt, request->cache_salt(), ask, *bearer,
      std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Minutes(1)));
  if (!pulled.ok()) return ToGrpc(pulled.status());
  response->set_local_tokens(pulled->local_tokens);
  response->set_pulled_tokens(pulled->pulled_tokens);
  response->set_from_node(pulled->from_node);
  response->set_bytes(pulled->bytes);
  response->set_transport(pulled->transport);
  response->set_holder_tokens(pulled->holder_tokens);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::Release(grpc::ServerContext* context,
                                     const v1::ReleaseRequest* request,
                                     v1::ReleaseResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  return RunMutation(context, call->who, "Release", id, *request, response, [&]() -> absl::Status {
    if (absl::Status s = Owns(call->who, id); !s.ok()) return s;
    absl::StatusOr<uint64_t> freed = engine_->Release(id);
    if (!freed.ok()) return freed.status();
    response->set_freed_blocks(*freed);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::KeepAlive(grpc::ServerContext* context,
                                       const v1::KeepAliveRequest* request,
                                       v1::KeepAliveResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
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
      absl::MakeConstSpan(request->sequence_ids().data(), request->sequence_ids().size()),
      call->who.admin ? nullptr : &call->who.tenant);
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

grpc::Status KvCacheService::Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                   v1::StatsResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  StatsPage page;
  if (absl::Status s = ReadStatsPage(*request, &page); !s.ok()) return ToGrpc(s);
  // A tenant sees its own sequences and what they hold; an admin, the daemon's.
  const std::string* owner = call->who.admin ? nullptr : &call->who.tenant;
  engine::EngineStats stats = engine_->Stats(request->include_sequences(), owner);
  const uint64_t own_bytes = stats.pool.block_bytes_used;
  FillStatsPage(std::move(stats), page, response);
  if (owner != nullptr) response->set_pool_used_bytes(own_bytes);
  return grpc::Status::OK;
}

}  // namespace kvmem::service
