#pragma once
// KvCacheService: the gRPC handlers of kvmem.v1.KvCache. Each handler validates what only
// the request can tell, translates to engine types, calls the engine and translates back.
// No cache logic lives here. Every handler first takes a CallGate ticket, so that a drain
// refuses new calls (UNAVAILABLE, nothing applied) and lets admitted ones finish.
// Requests arrive through Parsed<T> (parsed.h): what parsing one allocates is counted and
// reserved before it is parsed; the handlers see the plain messages.
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/metrics/rpc_telemetry.h"
#include "server/service/admission.h"
#include "server/service/auth.h"
#include "server/service/cluster_index.h"
#include "server/service/convert.h"
#include "server/service/error_details.h"
#include "server/service/parsed.h"
#include "server/service/prefix_pull.h"
#include "server/service/request_cache.h"
#include "server/service/sequence_move.h"
#include "server/transport/attach_socket.h"
#include "server/transport/parse_cost.h"
#include "server/transport/remote_payload.h"
#include "server/transport/step_channel.h"

namespace kvmem::transport {
class UcxPlane;
}  // namespace kvmem::transport

namespace kvmem::service {

class KvCacheService final : public grpc::Service {
 public:
  // `rpc_telemetry` (may be null) counts the StepBatch calls that step channels answer;
  // the server's interceptor counts the gRPC calls.
  // `auth` (may be null: every call is the anonymous admin of a daemon without tokens)
  // tells who each call comes from.
  KvCacheService(engine::Engine* engine, std::string version, const ServiceLimits& limits,
                 const engine::Clock* clock, metrics::RpcTelemetry* rpc_telemetry = nullptr,
                 const Authenticator* auth = nullptr, transport::AttachSocket* attach = nullptr)
      : engine_(engine),
        attach_(attach),
        rpc_telemetry_(rpc_telemetry),
        auth_(auth != nullptr ? auth : &anonymous_),
        version_(std::move(version)),
        streams_(limits.max_stream_buffer_bytes, limits.max_append_streams),
        reads_(0, limits.max_read_streams, "ReadKv", "--max-read-streams",
               "retry later or read fewer layers at a time"),
        requests_(limits.request_id_entries, limits.request_id_bytes, limits.request_id_ttl, clock),
        channels_(limits.max_step_channels, limits.step_channel_bytes),
        tenant_calls_(limits.tenant_max_calls),
        ucx_max_payload_bytes_(limits.ucx_max_payload_bytes),
        ucx_budget_(limits.ucx_payload_memory_bytes),
        ucx_payload_timeout_(limits.ucx_payload_timeout) {
    RegisterMethods();
  }
  // The full names of the methods registered ("/kvmem.v1.KvCache/GetInfo", ...).
  const std::deque<std::string>& method_names() const { return method_names_; }

  // A call let in: its CallGate ticket and its place among its tenant's calls, held for
  // the handler, and who it comes from.
  struct Admitted {
    CallGate::Ticket ticket;
    TenantCalls::Ticket tenant_ticket;
    Principal who;
  };
  // Every handler's door: UNAVAILABLE while draining, then UNAUTHENTICATED for a call
  // without a known token (Authenticator), then RESOURCE_EXHAUSTED for a tenant with its
  // --tenant-max-calls in flight; nothing of a refused call runs.
  absl::StatusOr<Admitted> Admit(const grpc::ServerContext* context);
  // OK when `who` may name sequence `id` (its own, or any for an admin); else the
  // NOT_FOUND of an unknown id. A mutation checks it inside its cached call (RunMutation),
  // so that a retry of one that applied gets its first answer even once the sequence is
  // gone.
  absl::Status Owns(const Principal& who, uint64_t id) const;
  // The prefix namespace of a request's cache salt: the tenant's, which the salt may
  // subdivide and never leave (the salt as sent on a daemon without tokens).
  // A caller without a tenant may not use a salt that begins as tenants' do.
  static absl::StatusOr<std::string> ScopedSalt(const Principal& who, const std::string& salt);
  // The caller's `authorization` value, for calls this daemon makes to another node on its
  // behalf (PullPrefix, MoveSequence: the other node scopes them to the same tenant);
  // FAILED_PRECONDITION when tokens are required and the call came without one.
  absl::StatusOr<std::string> ForwardedBearer(const grpc::ServerContext* context,
                                              absl::string_view method) const;

  // kvmemd's UCX worker, offered in GetInfo to callers that may read the pool (null: none).
  // Set before serving.
  void set_ucx(transport::UcxPlane* ucx) { ucx_ = ucx; }
  // The fleet's shared prefix index, asked by Lookup's `fleet` (null: none). Set before
  // serving.
  void set_cluster_index(ClusterIndex* index) { cluster_index_ = index; }
  // What PullPrefix pulls with (null: refused). Set before serving.
  void set_prefix_puller(PrefixPuller* puller) { puller_ = puller; }
  // What MoveSequence moves with (null: refused). Set before serving.
  void set_sequence_mover(SequenceMover* mover) { mover_ = mover; }

  // Remote appends' payloads: announcement to landed.
  engine::Histogram::Snapshot ucx_payload_seconds() const { return ucx_payload_seconds_.Read(); }
  // Closed by the server's drain.
  CallGate& gate() { return gate_; }
  // Watched by the server for idle streams.
  AppendStreamBudget& append_streams() { return streams_; }
  // ReadKv's streams, watched the same way (a client that stops reading).
  AppendStreamBudget& read_streams() { return reads_; }
  const AppendStreamBudget& read_streams() const { return reads_; }

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*, v1::GetInfoResponse*);
  grpc::Status CreateSequence(grpc::ServerContext*, const v1::CreateSequenceRequest*,
                              v1::CreateSequenceResponse*);
  grpc::Status Append(grpc::ServerContext*, const v1::AppendRequest*, v1::AppendResponse*);
  grpc::Status AppendStream(grpc::ServerContext*, MessageReader<v1::AppendStreamRequest>*,
                            v1::AppendStreamResponse*);
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*, v1::StepResponse*);
  grpc::Status StepBatch(grpc::ServerContext*, const v1::StepBatchRequest*, v1::StepBatchResponse*);
  grpc::Status OpenStepChannel(grpc::ServerContext*, const v1::OpenStepChannelRequest*,
                               grpc::ServerWriter<v1::OpenStepChannelResponse>*);
  // Step channels open now.
  uint32_t step_channels_open() const { return channels_.open(); }
  // Most entries one StepBatch may carry.
  static constexpr int kMaxBatchEntries = 4096;
  // A ReadKv response's K+V and positions bytes at most (one slot's, if that is more): a
  // read holds one piece of a stream at a time, whatever the stream's length, and a piece
  // passes any gRPC client's default receive limit (4 MiB).
  static constexpr uint64_t kReadPieceBytes = 2 << 20;
  grpc::Status Compress(grpc::ServerContext*, const v1::CompressRequest*, v1::CompressResponse*);
  grpc::Status GetBlockTable(grpc::ServerContext*, const v1::GetBlockTableRequest*,
                             v1::GetBlockTableResponse*);
  grpc::Status ReadKv(grpc::ServerContext*, const v1::ReadKvRequest*,
                      grpc::ServerWriterInterface<v1::ReadKvResponse>*);
  grpc::Status Fork(grpc::ServerContext*, const v1::ForkRequest*, v1::ForkResponse*);
  grpc::Status Publish(grpc::ServerContext*, const v1::PublishRequest*, v1::PublishResponse*);
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*);
  grpc::Status PullPrefix(grpc::ServerContext*, const v1::PullPrefixRequest*,
                          v1::PullPrefixResponse*);
  // Daemon to daemon (sequence_move.cc).
  grpc::Status MoveSequence(grpc::ServerContext*, const v1::MoveSequenceRequest*,
                            v1::MoveSequenceResponse*);
  grpc::Status ExportSequence(grpc::ServerContext*, const v1::ExportSequenceRequest*,
                              grpc::ServerWriterInterface<v1::ExportSequenceResponse>*);
  grpc::Status FinishExport(grpc::ServerContext*, const v1::FinishExportRequest*,
                            v1::FinishExportResponse*);
  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest*, v1::ReleaseResponse*);
  grpc::Status KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest*, v1::KeepAliveResponse*);
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::StatsResponse*);

 private:
  // Registers every method of kvmem.v1.KvCache with Parsed<T> requests.
  void RegisterMethods();
  // "/kvmem.v1.KvCache/<name>", kept in method_names_ (gRPC keeps the pointer).
  const char* MethodName(absl::string_view name);
  // Parses a unary or server-streaming call's request (ParsedBase::Parse) once the call
  // authenticates, holding a place among its tenant's calls in flight meanwhile: a caller
  // without a known token or peer gets UNAUTHENTICATED and costs no parse, a tenant at its
  // limit RESOURCE_EXHAUSTED. The handler then admits the call as usual (Admit).
  grpc::Status ParseFor(const grpc::ServerContext* context, const ParsedBase& request);
  template <typename Request, typename Response>
  void AddUnary(const char* name,
                grpc::Status (KvCacheService::*handler)(grpc::ServerContext*, const Request*,
                                                        Response*));
  // `Writer`: grpc::ServerWriter, or the interface it implements.
  template <typename Request, typename Response, template <class> class Writer>
  void AddServerStreaming(const char* name,
                          grpc::Status (KvCacheService::*handler)(grpc::ServerContext*,
                                                                  const Request*,
                                                                  Writer<Response>*));
  // StepBatch's work, for gRPC and for step channels: table updates go in up to
  // `max_update_bytes` in all.
  // `context`: null for a step channel's batch.
  // `channel`: the step channel the batch came through (null over gRPC), whose signal area
  // entries may name rows in.
  grpc::Status RunStepBatch(grpc::ServerContext* context, const Principal& who,
                            const v1::StepBatchRequest& request, uint64_t max_update_bytes,
                            v1::StepBatchResponse* response,
                            const transport::StepChannel* channel = nullptr);
  // A mutating call's frame, shared by the handlers: a call whose deadline passed is refused
  // before it runs (nothing applied); a request_id makes a retry get
  // the first answer (RequestCache); errors map to gRPC statuses naming sequence `scope`
  // (0: none). The caller holds its CallGate ticket.
  // Request ids are the caller's tenant's: another tenant's repeat of an id is a new call.
  template <typename Request, typename Response, typename Call>
  grpc::Status RunMutation(grpc::ServerContext* context, const Principal& who,
                           absl::string_view method, uint64_t scope, const Request& request,
                           Response* response, Call&& call) {
    if (absl::Status s = StillWanted(context, method); !s.ok()) return ToGrpc(s, Scope(scope));
    const absl::Status status =
        requests_.Run(method, who.tenant, scope, request, request.request_id(), response, call);
    return ToGrpc(status, Scope(scope));
  }
  // The same for a call that may carry the client's held table: the engine computes its
  // update under the mutation's lock (`*update`, set by `call`); it goes into the response
  // after the answer is kept for retries, so a replayed retry gets a fresh one.
  template <typename Request, typename Response, typename Call>
  grpc::Status RunMutation(grpc::ServerContext* context, const Principal& who,
                           absl::string_view method, uint64_t scope, const Request& request,
                           Response* response, const std::optional<engine::HeldTable>& held,
                           std::optional<engine::TableUpdate>* update, Call&& call) {
    bool ran = false;  // else replayed
    grpc::Status status =
        RunMutation(context, who, method, scope, request, response, [&]() -> absl::Status {
          ran = true;
          return call();
        });
    if (status.ok() && held) AnswerHeldTable(ran, scope, *held, *update, response);
    return status;
  }
  // The update of the client's held table in a mutation's response: the one the call made
  // under its lock (`ran`), or a fresh one for a replayed retry.
  template <typename Response>
  void AnswerHeldTable(bool ran, uint64_t id, const engine::HeldTable& held,
                       const std::optional<engine::TableUpdate>& update, Response* response) {
    if (!ran) {
      FillTableUpdate(id, held, ReplayedVersionBefore(response->table_version()),
                      response->mutable_table_update());
    } else if (update) {
      ToProto(*update, response->mutable_table_update());
    }
  }
  static absl::Status StillWanted(grpc::ServerContext* context, absl::string_view method);
  // The K/V of an Append whose `ucx_payload` announces it, landed (UcxPlane::Receive) in
  // memory reserved from the announced payloads' budget: refused without a UCX worker, with
  // k or v set, or with a size that is not the positions' K+V or passes the limits.
  absl::StatusOr<std::shared_ptr<const transport::RemotePayload>> ReceiveUcxPayload(
      grpc::ServerContext* context, uint64_t sequence_id, const v1::AppendRequest& request);
  // The request's announced payload will not be taken: its message is dropped at once.
  // For a call that fails before it waits for its payload.
  void RefuseUcxPayload(const v1::AppendRequest& request);
  static std::optional<uint64_t> Scope(uint64_t scope) {
    return scope == 0 ? std::nullopt : std::optional<uint64_t>(scope);
  }
  // The table version before a call whose answer was replayed (a retry under its
  // request_id): the first run's is gone, and a client that repeats a call never got its
  // answer, so it cannot hold the version the call made (`made`, the replayed answer's
  // table_version) or a later one. A call that changed nothing then sends the whole table:
  // retries are rare.
  static uint64_t ReplayedVersionBefore(uint64_t made) { return made > 0 ? made - 1 : 0; }
  // The update of the table `held` names, after a replayed mutation of sequence `id`: the
  // whole table when `held` is past `version_before` (a guess), else the delta from it.
  void FillTableUpdate(uint64_t id, const engine::HeldTable& held, uint64_t version_before,
                       v1::TableUpdate* out);

  engine::Engine* const engine_;
  // Hands out tickets for the shared-memory segments' descriptors; null: no same-host attach.
  transport::AttachSocket* const attach_;
  metrics::RpcTelemetry* const rpc_telemetry_;
  const Authenticator anonymous_;  // auth_ when the daemon has no tokens
  const Authenticator* const auth_;
  const std::string version_;
  CallGate gate_;
  AppendStreamBudget streams_;
  AppendStreamBudget reads_;
  RequestCache requests_;  // retries of mutating calls (request_id)
  transport::StepChannelBudget channels_;
  TenantCalls tenant_calls_;
  // GetInfoResponse.instance_id: random, never 0, another at each start.
  const uint64_t instance_id_ = absl::Uniform<uint64_t>(absl::BitGen(), 1, UINT64_MAX);
  const uint64_t ucx_max_payload_bytes_;
  transport::ParseBudget ucx_budget_;  // announced payloads' buffers
  const absl::Duration ucx_payload_timeout_;
  engine::Histogram ucx_payload_seconds_{engine::LatencyBounds()};
  // A deque: gRPC keeps pointers to the names, which appending must not move.
  std::deque<std::string> method_names_;
  transport::UcxPlane* ucx_ = nullptr;
  ClusterIndex* cluster_index_ = nullptr;
  PrefixPuller* puller_ = nullptr;
  SequenceMover* mover_ = nullptr;
};

}  // namespace kvmem::service
