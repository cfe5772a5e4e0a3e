#include "server/service/sequence_move.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <memory>
#include <new>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kvmem/shared_pool.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#if KVMEM_WITH_UCX
#include "kvmem/ucx_pool.h"
#endif
#include "server/common/client_text.h"
#include "server/service/convert.h"
#include "server/service/kv_cache_service.h"
#include "server/transport/parse_cost.h"

namespace kvmem::service {
namespace {

// How long FinishExport may take, and how often it is tried when the holder's answer is lost.
constexpr absl::Duration kFinishDeadline = absl::Seconds(5);
constexpr int kFinishTries = 3;
// The hold asked of the holder: the move's own deadline, at most this.
constexpr absl::Duration kMaxHold = absl::Minutes(10);
// The longest a move may take: its hold, twice that and 10 s, within kMaxHold.
constexpr absl::Duration kMaxMove = absl::Minutes(4);
constexpr absl::Duration kDefaultHold = absl::Seconds(60);

// A holder's failure, as this node's: its code (a sequence the holder does not know is
// NOT_FOUND here too), naming the holder and the call, with the holder's message bounded.
absl::Status FromHolder(const grpc::Status& s, absl::string_view node, absl::string_view call) {
  const auto code =
      s.ok() ? absl::StatusCode::kUnknown : static_cast<absl::StatusCode>(s.error_code());
  return absl::Status(code, absl::StrCat("MoveSequence: the holder ", node, " answered ", call,
                                         ": ", CutMessage(s.error_message(), kMaxDetailTextBytes)));
}

// The holder's answer refused (untrusted input that is not a sequence, or one this node's
// settings refuse): neither the caller's request's fault (INVALID_ARGUMENT would tell it to
// fix its request) nor a passing one (UNAVAILABLE: clients retry it, and a retry would
// move it all again to be refused again): FAILED_PRECONDITION naming the holder. Other
// codes (this node's pool full) stay what they are.
absl::Status RefusedAnswer(absl::Status s, absl::string_view node) {
  if (!absl::IsInvalidArgument(s)) return s;
  return absl::FailedPreconditionError(
      absl::StrCat("MoveSequence: the holder ", node,
                   "'s answer is refused: ", absl::StripPrefix(s.message(), "MoveSequence: ")));
}

// Whether a holder's scoped salt lies in the caller's namespace (KvCacheService::ScopedSalt).
bool SaltIsTheCallers(const Principal& who, const std::string& salt) {
  if (!who.tenant.empty()) return absl::StartsWith(salt, absl::StrCat("tenant:", who.tenant, "/"));
  return !absl::StartsWith(salt, "tenant:");
}

// Reads of the holder's pool by offsets: copied out of its mapping, or UCX gets.
using ReadPoolFn = absl::FunctionRef<absl::Status(absl::Span<const client::PoolRead>)>;

// The bytes of pieces by offsets reserved before their gets are posted together (blocks side
// by side in both pools are one get: several pieces' blocks make large gets), and the most
// blocks (the reads' host memory, whatever the blocks' size; passed by one piece's at most).
constexpr uint64_t kLandBytes = 64ull << 20;
constexpr size_t kLandBlocks = 16384;

// Checks a piece's offsets as untrusted input: one per block.
absl::Status CheckOffsets(const engine::MovedPiece& piece) {
  if (piece.offsets.size() != piece.blocks.size() || !piece.data.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("MoveSequence: the holder's piece names ",
                                                   piece.offsets.size(), " offsets for ",
                                                   piece.blocks.size(), " blocks"));
  }
  return absl::OkStatus();
}

// A piece by offsets where the import lands pieces in place: checked and taken by the import,
// its blocks' gets added to `reads` (posted later; the offsets inside the pool: UcxPool).
absl::Status ReservePiece(engine::SequenceImport& import, const engine::MovedPiece& piece,
                          std::vector<client::PoolRead>* reads, uint64_t* bytes) {
  if (absl::Status s = CheckOffsets(piece); !s.ok()) return s;
  try {
    reads->reserve(reads->size() + piece.blocks.size());
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("MoveSequence: out of host memory");
  }
  absl::StatusOr<std::vector<uint8_t*>> at = import.Reserve(piece);
  if (!at.ok()) return at.status();
  for (size_t i = 0; i < piece.blocks.size(); ++i) {
    const uint64_t n = import.format().block_bytes(piece.blocks[i].precision);
    reads->push_back({piece.offsets[i], (*at)[i], n});  // reserved: cannot throw
    *bytes += n;
  }
  return absl::OkStatus();
}

// A piece by offsets where the pool is not host memory: its blocks' bytes got into its data
// (no more than the header has left, checked before any is allocated), then added. A failed
// get leaves the piece as it came: it may be got again.
absl::Status GetPiece(ReadPoolFn read_pool, engine::SequenceImport& import,
                      engine::MovedPiece* piece) {
  if (absl::Status s = CheckOffsets(*piece); !s.ok()) return s;
  const engine::BlockFormat& format = import.format();
  uint64_t bytes = 0;
  for (const engine::MovedBlock& b : piece->blocks) bytes += format.block_bytes(b.precision);
  const uint64_t left = import.header().block_bytes - import.bytes();
  if (bytes > left) {
    return absl::InvalidArgumentError(absl::StrCat("MoveSequence: the holder's piece names ", bytes,
                                                   " block bytes where its header has ", left,
                                                   " left"));
  }
  piece->data.resize(bytes);
  std::vector<client::PoolRead> reads;
  reads.reserve(piece->blocks.size());
  uint64_t at = 0;
  for (size_t i = 0; i < piece->blocks.size(); ++i) {
    const uint64_t n = format.block_bytes(piece->blocks[i].precision);
    reads.push_back({piece->offsets[i], piece->data.data() + at, n});
    at += n;
  }
  if (absl::Status s = read_pool(reads); !s.ok()) {
    if (absl::IsAborted(s)) {
      // A get may still write into the piece's buffer: never freed, never reused.
      client::internal::KeepForever(std::move(piece->data));
    }
    piece->data.clear();
    return s;
  }
  piece->offsets.clear();
  return import.Add(*piece);
}

}  // namespace

v1::SequenceHeader ToProto(const engine::MovedHeader& h) {
  v1::SequenceHeader out;
  out.set_export_id(h.export_id);
  ToProto(h.layout, out.mutable_layout());
  v1::PolicySpec* policy = out.mutable_policy();
  policy->set_name(h.policy);
  for (const auto& [name, value] : h.params) (*policy->mutable_params())[name] = value;
  if (h.quant.type) policy->set_quantization(ToProto(engine::ToPrecision(*h.quant.type)));
  policy->set_quantization_recent_tokens(h.quant.recent_tokens);
  out.mutable_token_ids()->Add(h.token_ids.begin(), h.token_ids.end());
  out.set_last_position(h.last_position);
  out.set_appended(h.appended);
  out.set_steps(h.steps);
  out.set_policy_mark(h.policy_mark);
  out.set_cache_salt(h.salt);
  out.set_model(h.model);
  out.set_auto_publish(h.auto_publish);
  out.set_compressed_document(h.compressed_document);
  out.set_compressions(h.compressions);
  out.set_mapped_prefix(h.mapped_prefix);
  out.mutable_stream_slots()->Add(h.stream_slots.begin(), h.stream_slots.end());
  out.mutable_stream_blocks()->Add(h.stream_blocks.begin(), h.stream_blocks.end());
  out.set_block_bytes(h.block_bytes);
  out.set_history_rows(h.history_rows);
  out.set_token_signals(h.token_signals);
  out.set_arrival_steps(h.arrival_steps);
  out.set_scores(h.scores);
  return out;
}

void ToProto(engine::MovedPiece&& p, v1::SequencePiece* out) {
  out->set_stream(p.stream);
  for (const engine::MovedBlock& b : p.blocks) {
    v1::MovedBlock* m = out->add_blocks();
    m->set_start(b.start);
    m->set_count(b.count);
    m->set_precision(ToProto(b.precision));
  }
  out->mutable_positions()->Add(p.positions.begin(), p.positions.end());
  out->mutable_history()->Add(p.history.begin(), p.history.end());
  out->mutable_token_entropy()->Add(p.token_entropy.begin(), p.token_entropy.end());
  out->mutable_layer_distance()->Add(p.layer_distance.begin(), p.layer_distance.end());
  out->mutable_arrival_steps()->Add(p.arrival_steps.begin(), p.arrival_steps.end());
  out->mutable_scores()->Add(p.scores.begin(), p.scores.end());
  out->set_data(std::move(p.data));
  out->mutable_block_offsets()->Add(p.offsets.begin(), p.offsets.end());
}

absl::StatusOr<engine::MovedHeader> FromProto(const v1::SequenceHeader& h) {
  engine::MovedHeader out;
  out.export_id = h.export_id();
  if (!h.has_layout() || !h.layout().has_block_tokens()) {
    return absl::InvalidArgumentError("MoveSequence: the holder's header has no layout");
  }
  absl::StatusOr<engine::Layout> layout = FromProto(h.layout(), 0);
  if (!layout.ok()) return layout.status();
  out.layout = *layout;
  absl::StatusOr<std::string> name = PolicyNameFromProto(h.policy());
  if (!name.ok()) return name.status();
  out.policy = *std::move(name);
  out.params.insert(h.policy().params().begin(), h.policy().params().end());
  absl::StatusOr<engine::QuantConfig> quant = QuantFromProto(h.policy());
  if (!quant.ok()) return quant.status();
  out.quant = *quant;
  out.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
  out.last_position = h.last_position();
  out.appended = h.appended();
  out.steps = h.steps();
  out.policy_mark = h.policy_mark();
  out.salt = h.cache_salt();
  out.model = h.model();
  out.auto_publish = h.auto_publish();
  out.compressed_document = h.compressed_document();
  out.compressions = h.compressions();
  out.mapped_prefix = h.mapped_prefix();
  out.stream_slots.assign(h.stream_slots().begin(), h.stream_slots().end());
  out.stream_blocks.assign(h.stream_blocks().begin(), h.stream_blocks().end());
  out.block_bytes = h.block_bytes();
  out.history_rows = h.history_rows();
  out.token_signals = h.token_signals();
  out.arrival_steps = h.arrival_steps();
  out.scores = h.scores();
  return out;
}

absl::StatusOr<engine::MovedPiece> FromProto(v1::SequencePiece&& p) {
  engine::MovedPiece out;
  out.stream = p.stream();
  for (const v1::MovedBlock& b : p.blocks()) {
    if (b.precision() < v1::PRECISION_LAYOUT || b.precision() > v1::PRECISION_NF4) {
      return absl::InvalidArgumentError(
          "MoveSequence: the holder's piece names a block of no known precision");
    }
    out.blocks.push_back({b.start(), b.count(), FromProto(b.precision())});
  }
  out.positions.assign(p.positions().begin(), p.positions().end());
  out.history.assign(p.history().begin(), p.history().end());
  out.token_entropy.assign(p.token_entropy().begin(), p.token_entropy().end());
  out.layer_distance.assign(p.layer_distance().begin(), p.layer_distance().end());
  out.arrival_steps.assign(p.arrival_steps().begin(), p.arrival_steps().end());
  out.scores.assign(p.scores().begin(), p.scores().end());
  out.data = std::move(*p.mutable_data());
  out.offsets.assign(p.block_offsets().begin(), p.block_offsets().end());
  return out;
}

metrics::MoveTotals SequenceMover::totals() const {
  metrics::MoveTotals t;
  t.moved = moved_.load(std::memory_order_relaxed);
  t.failed = failed_.load(std::memory_order_relaxed);
  t.unreleased = unreleased_.load(std::memory_order_relaxed);
  t.bytes = bytes_.Read();
  t.seconds = seconds_.Read();
  return t;
}

absl::StatusOr<MoveResult> SequenceMover::Move(grpc::ServerContext* context,
                                               const std::string& from_node, uint64_t sequence_id,
                                               const Principal& who, const std::string& bearer,
                                               absl::Duration lease, const std::string& transport,
                                               absl::Time deadline) {
  if (transport != "" && transport != "grpc" && transport != "ucx" && transport != "attach") {
    return absl::InvalidArgumentError(
        absl::StrCat("transport: \"", EchoClientText(transport),
                     "\" is none of \"attach\", \"ucx\", \"grpc\" or empty"));
  }
  if (!links_->IsPeer(from_node)) {
    return absl::FailedPreconditionError(
        absl::StrCat("from_node: \"", EchoClientText(from_node),
                     "\" is not one of this kvmemd's --cluster-peers"));
  }
  if (running_.fetch_add(1) >= max_moves_) {
    running_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "MoveSequence: ", max_moves_, " moves are running already (--cluster-pull-concurrency)"));
  }
  absl::Cleanup one_less = [this] { running_.fetch_sub(1); };
  const absl::Time start = absl::Now();
  absl::StatusOr<MoveResult> moved;
  try {
    bool unmappable = false;
    moved = MoveFrom(context, from_node, sequence_id, who, bearer, lease, transport, deadline,
                     &unmappable);
    if (unmappable && transport.empty() && !context->IsCancelled() && absl::Now() < deadline) {
      // The holder's mapping was of an instance since gone, and the exporting one cannot be
      // mapped (the export was abandoned: the sequence is there whole): by UCX or gRPC.
      moved = MoveFrom(context, from_node, sequence_id, who, bearer, lease, transport, deadline,
                       nullptr);
    }
  } catch (const std::bad_alloc&) {
    moved = absl::ResourceExhaustedError("MoveSequence: out of host memory");
  }
  seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  if (!moved.ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
  } else {
    moved_.fetch_add(1, std::memory_order_relaxed);
    bytes_.Add(moved->transport, moved->bytes);
    if (!moved->source_released) unreleased_.fetch_add(1, std::memory_order_relaxed);
  }
  return moved;
}

absl::StatusOr<MoveResult> SequenceMover::MoveFrom(grpc::ServerContext* context,
                                                   const std::string& from_node,
                                                   uint64_t sequence_id, const Principal& who,
                                                   const std::string& bearer, absl::Duration lease,
                                                   const std::string& transport,
                                                   absl::Time deadline, bool* unmappable) {
  std::unique_ptr<v1::KvCache::Stub> stub = links_->Stub(from_node);
  // The holder's pool mapped (on this host), else by UCX, where this daemon may read it.
  std::optional<PeerLinks::MappedPeer> mapped;
  if ((transport == "attach" || transport.empty()) && unmappable != nullptr) {
    absl::StatusOr<PeerLinks::MappedPeer> m = links_->Mapped(*stub, from_node, deadline);
    if (m.ok()) {
      mapped = *std::move(m);
    } else if (transport == "attach") {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport: \"attach\": the holder's pool cannot be mapped: ", m.status().message()));
    }
  }
  const bool by_attach = mapped.has_value();
  std::shared_ptr<const client::UcxPool> ucx;
  if (!by_attach) {
    absl::StatusOr<std::shared_ptr<const client::UcxPool>> chosen =
        links_->Choose(*stub, from_node, transport, deadline);
    if (!chosen.ok()) return chosen.status();
    ucx = *std::move(chosen);
  }
  const bool by_ucx = ucx != nullptr;
  const bool by_offsets = by_attach || by_ucx;
  if (transport == "ucx" && !by_ucx) {
    return absl::FailedPreconditionError(
        "transport: \"ucx\": this kvmemd reads no peer's pool by UCX (built without UCX, or "
        "without --cluster-peer-token-file)");
  }
  const auto call = [&](absl::Time until) {
    std::unique_ptr<grpc::ClientContext> c = grpc::ClientContext::FromServerContext(
        *context, grpc::PropagationOptions().disable_deadline_propagation());
    c->set_deadline(absl::ToChronoTime(until));
    if (!bearer.empty()) c->AddMetadata("authorization", bearer);
    return c;
  };
  // Finishes the export there: on its own deadline (the call's may be what ended the move).
  const auto finish = [&](uint64_t export_id, bool moved) {
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + kFinishDeadline));
    if (!bearer.empty()) c.AddMetadata("authorization", bearer);
    v1::FinishExportRequest q;
    q.set_sequence_id(sequence_id);
    q.set_export_id(export_id);
    q.set_moved(moved);
    v1::FinishExportResponse a;
    return stub->FinishExport(&c, q, &a);
  };

  std::unique_ptr<grpc::ClientContext> c = call(deadline);
  v1::ExportSequenceRequest q;
  q.set_sequence_id(sequence_id);
  // Held past the move's deadline by as much again and 10 s: every get ends by the deadline
  // (UcxPool::Deadline), so every block is read before the hold can lapse.
  ToProto(std::clamp(2 * (deadline - absl::Now()) + absl::Seconds(10), absl::Seconds(1), kMaxHold),
          q.mutable_hold());
  q.set_block_offsets(by_offsets);
  std::unique_ptr<grpc::ClientReader<v1::ExportSequenceResponse>> reader =
      stub->ExportSequence(c.get(), q);
  v1::ExportSequenceResponse message;
  if (!reader->Read(&message)) return FromHolder(reader->Finish(), from_node, "ExportSequence");
  if (!message.has_header()) {
    c->TryCancel();
    reader->Finish().IgnoreError();
    return FromHolder(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no header first"),
                      from_node, "ExportSequence");
  }
  const uint64_t export_id = message.header().export_id();
  // From here the holder's sequence is frozen: a move that ends without a commit here
  // unfreezes it at once.
  bool committed = false;
  absl::Cleanup abandon = [&] {
    if (!committed) finish(export_id, false).IgnoreError();
  };
  if (by_attach && message.header().holder_instance_id() != mapped->instance_id) {
    // The pool mapped is not the exporting daemon's (it restarted since the mapping was
    // made, or it names no instance): mapped again, once; blocks are read only from the
    // export's own daemon.
    absl::StatusOr<PeerLinks::MappedPeer> again =
        links_->Mapped(*stub, from_node, deadline, mapped->instance_id);
    if (!again.ok() || again->instance_id != message.header().holder_instance_id()) {
      // The export given up here, so that a move made again (Move) finds the sequence
      // unfrozen, and only then (by_attach: `unmappable` is not null). Before the stream is
      // cancelled: a holder that saw the cancel first gives the export up itself, and this
      // call would then find none to confirm.
      std::move(abandon).Cancel();
      *unmappable = finish(export_id, false).ok();
      c->TryCancel();
      return absl::AbortedError(absl::StrCat(
          "MoveSequence: the holder ", from_node,
          "'s pool as mapped is not the exporting daemon's (it restarted during the move?)",
          again.ok() ? "" : absl::StrCat(": ", again.status().message())));
    }
    mapped = *std::move(again);
  }
  absl::StatusOr<engine::MovedHeader> header = FromProto(message.header());
  if (!header.ok()) {
    c->TryCancel();
    return RefusedAnswer(header.status(), from_node);
  }
  if (!SaltIsTheCallers(who, header->salt)) {
    c->TryCancel();
    return RefusedAnswer(
        absl::InvalidArgumentError("its sequence is not in the caller's namespace (its cache salt "
                                   "belongs to another tenant)"),
        from_node);
  }
  if (header->block_bytes > max_bytes_) {
    c->TryCancel();
    return absl::ResourceExhaustedError(
        absl::StrCat("MoveSequence: the sequence holds ", header->block_bytes,
                     " bytes of blocks, more than --cluster-pull-max-bytes (", max_bytes_, ")"));
  }
  absl::StatusOr<std::unique_ptr<engine::SequenceImport>> import =
      engine_->BeginImport(*std::move(header), who.tenant);
  if (!import.ok()) {
    c->TryCancel();
    return RefusedAnswer(import.status(), from_node);
  }
  const auto refuse = [&](const absl::Status& s) {
    c->TryCancel();
    reader->Finish().IgnoreError();
    return RefusedAnswer(s, from_node);
  };
#if KVMEM_WITH_UCX
  // The gets end by the move's deadline (cancelled, the move ends at its next piece: the
  // export's stream is the caller's).
  std::optional<client::UcxPool::Deadline> by_move;
  if (by_ucx) by_move.emplace(deadline);
  bool reconnected = false;
  // Gets by `run`; where the connection broke (kept from before the holder restarted, say),
  // connected again, once, and run again: the export holds its blocks.
  const auto get = [&](const auto& run) {
    absl::Status s = run(*ucx);
    if (!s.ok() && ucx->broken() && !reconnected && !absl::IsDeadlineExceeded(s) &&
        !absl::IsAborted(s)) {
      reconnected = true;
      absl::StatusOr<std::shared_ptr<const client::UcxPool>> again =
          links_->Pool(*stub, from_node, deadline);
      if (again.ok()) {
        ucx = *std::move(again);
        s = run(*ucx);
      }
    }
    return s;
  };
#endif
  const auto read_pool = [&](absl::Span<const client::PoolRead> reads) -> absl::Status {
    if (by_attach) {  // the export holds the blocks
      return CopyOutOfMapping(*mapped->pool, reads, "MoveSequence: the holder's piece");
    }
#if KVMEM_WITH_UCX
    return get([&](const client::UcxPool& pool) { return pool.ReadPool(reads); });
#else
    return absl::InternalError("MoveSequence: no reader of the holder's pool");
#endif
  };
  // Pieces landing in place, reserved as they come, their reads made together.
  std::vector<client::PoolRead> landing;
  uint64_t landing_bytes = 0, landing_pieces = 0;
  const auto land = [&] {
    if (landing.empty()) return absl::OkStatus();
    absl::Status s = read_pool(landing);
    // A get left in flight may still write into the blocks: read into them again or
    // handed to another sequence, they could change under their reader.
    if (absl::IsAborted(s)) {
      (*import)->Forsake();
      s = absl::AbortedError(absl::StrCat("MoveSequence: reading the holder's pool: ", s.message(),
                                          " (a get was left in flight)"));
    }
    if (s.ok()) (*import)->Landed(landing_pieces);
    landing.clear();
    landing_bytes = landing_pieces = 0;
    return s;
  };
  while (reader->Read(&message)) {
    absl::StatusOr<engine::MovedPiece> piece = FromProto(std::move(*message.mutable_piece()));
    absl::Status added = piece.status();
    if (added.ok() && !by_offsets && !piece->offsets.empty()) {
      added = absl::InvalidArgumentError(
          "MoveSequence: the holder's piece names offsets where its bytes were asked for");
    }
    if (added.ok() && by_offsets && (*import)->lands_in_place()) {
      added = ReservePiece(**import, *piece, &landing, &landing_bytes);
      ++landing_pieces;
      if (added.ok() && (landing_bytes >= kLandBytes || landing.size() >= kLandBlocks)) {
        added = land();
      }
    } else if (added.ok() && by_offsets) {
      added = GetPiece(read_pool, **import, &*piece);
    } else if (added.ok()) {
      added = (*import)->Add(*piece);
    }
    if (!added.ok()) return refuse(added);
  }
  if (absl::Status s = land(); !s.ok()) return refuse(s);
  if (grpc::Status s = reader->Finish(); !s.ok()) return FromHolder(s, from_node, "ExportSequence");
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        "MoveSequence: the move's deadline passed before its blocks were all here");
  }
  absl::StatusOr<engine::CreateResult> created = engine_->CommitImport(**import, lease);
  if (!created.ok()) return RefusedAnswer(created.status(), from_node);
  committed = true;
  MoveResult result;
  result.created = *created;
  for (uint32_t n : (*import)->header().stream_slots) result.slots += n;
  result.blocks = (*import)->blocks();
  result.bytes = (*import)->bytes();
  result.policy = (*import)->header().policy;
  result.layout = (*import)->header().layout;
  result.transport = by_attach ? "attach" : (by_ucx ? "ucx" : "grpc");
  // The holder releases its copy now. A definite refusal (its hold lapsed, the sequence was
  // released there) undoes this one; a lost answer leaves both.
  // A definite refusal (its hold lapsed, the sequence was released there) undoes the copy
  // here; a lost answer is asked again (a repeat of one that moved hears OK); answers lost
  // every time, or a refusal after a lost answer (the holder may have moved it and then
  // forgotten: restarted), leave both copies rather than risk none.
  const auto lost = [](const grpc::Status& s) {
    return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
           s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  };
  grpc::Status released;
  bool any_lost = false;
  for (int i = 0; i < kFinishTries; ++i) {
    released = finish(export_id, true);
    if (!lost(released)) break;
    any_lost = true;
  }
  if (released.ok()) {
    result.source_released = true;
  } else if (!lost(released) && !any_lost) {
    engine_->Release(created->sequence_id).IgnoreError();
    return absl::AbortedError(
        absl::StrCat("MoveSequence: the holder ", from_node, " kept its sequence (FinishExport: ",
                     CutMessage(released.error_message(), kMaxDetailTextBytes),
                     "); the copy here was released"));
  }
  return result;
}

// ---- the handlers

grpc::Status KvCacheService::ExportSequence(
    grpc::ServerContext* context, const v1::ExportSequenceRequest* request,
    grpc::ServerWriterInterface<v1::ExportSequenceResponse>* writer) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  if (absl::Status s = Owns(call->who, id); !s.ok()) return ToGrpc(s, id);
  absl::Duration hold = kDefaultHold;
  if (request->has_hold()) {
    hold = absl::Seconds(request->hold().seconds()) + absl::Nanoseconds(request->hold().nanos());
    if (hold < absl::Seconds(1) || hold > kMaxHold) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat("hold: ", absl::FormatDuration(hold),
                                                            " is outside [1s, ",
                                                            absl::FormatDuration(kMaxHold), "]")));
    }
  }
  // Counted with ReadKv's streams: a receiver that stops reading is cut off.
  absl::StatusOr<AppendStreamBudget::Lease> open = reads_.Open(context);
  if (!open.ok()) return ToGrpc(open.status(), id);
  std::vector<std::vector<float>> scores;
  absl::StatusOr<engine::MovedHeader> header = engine_->BeginExport(id, hold, &scores);
  if (!header.ok()) return ToGrpc(header.status(), id);
  // A failure from here on leaves it frozen only until the receiver's FinishExport or the
  // hold; the scores copy is host memory held for the stream.
  uint64_t score_bytes = 0;
  for (const auto& s : scores) score_bytes += s.size() * sizeof(float);
  absl::StatusOr<transport::ParseBudget::Reservation> held =
      transport::ParseBudget::Process().Reserve(score_bytes, "ExportSequence");
  if (!held.ok()) {
    engine_->FinishExport(id, header->export_id, false).IgnoreError();
    return ToGrpc(held.status(), id);
  }
  v1::ExportSequenceResponse message;
  *message.mutable_header() = ToProto(*header);
  message.mutable_header()->set_holder_instance_id(instance_id_);
  if (!writer->Write(message)) {
    engine_->FinishExport(id, header->export_id, false).IgnoreError();
    return ToGrpc(absl::CancelledError("ExportSequence: the receiver left"), id);
  }
  engine::ExportCursor cursor;
  for (;;) {
    engine::MovedPiece piece;
    absl::StatusOr<bool> more = engine_->ExportPiece(id, header->export_id, scores,
                                                     request->block_offsets(), &cursor, &piece);
    if (!more.ok()) return ToGrpc(more.status(), id);
    if (!*more) break;
    message.Clear();
    ToProto(std::move(piece), message.mutable_piece());
    if (context->IsCancelled() || !writer->Write(message)) {
      engine_->FinishExport(id, header->export_id, false).IgnoreError();
      return ToGrpc(absl::CancelledError("ExportSequence: the receiver left"), id);
    }
    open->Touch();
  }
  return grpc::Status::OK;
}

grpc::Status KvCacheService::FinishExport(grpc::ServerContext* context,
                                          const v1::FinishExportRequest* request,
                                          v1::FinishExportResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  const uint64_t id = request->sequence_id();
  // A repeat of a FinishExport that moved the sequence (its answer was lost) hears so again.
  if (request->moved() && engine_->ExportMoved(id, request->export_id(),
                                               call->who.admin ? nullptr : &call->who.tenant)) {
    return grpc::Status::OK;
  }
  if (absl::Status s = Owns(call->who, id); !s.ok()) return ToGrpc(s, id);
  absl::StatusOr<uint64_t> freed =
      engine_->FinishExport(id, request->export_id(), request->moved());
  if (!freed.ok()) return ToGrpc(freed.status(), id);
  response->set_freed_blocks(*freed);
  return grpc::Status::OK;
}

grpc::Status KvCacheService::MoveSequence(grpc::ServerContext* context,
                                          const v1::MoveSequenceRequest* request,
                                          v1::MoveSequenceResponse* response) {
  absl::StatusOr<Admitted> call = Admit(context);
  if (!call.ok()) return ToGrpc(call.status());
  return RunMutation(
      context, call->who, "MoveSequence", 0, *request, response, [&]() -> absl::Status {
        if (mover_ == nullptr) {
          return absl::FailedPreconditionError(
              "MoveSequence: this kvmemd has no peers to move from (--cluster-peers)");
        }
        absl::StatusOr<absl::Duration> lease = LeaseFromProto(
            request->has_lease() ? &request->lease() : nullptr, "lease", engine_->config());
        if (!lease.ok()) return lease.status();
        absl::StatusOr<std::string> bearer = ForwardedBearer(context, "MoveSequence");
        if (!bearer.ok()) return bearer.status();
        absl::StatusOr<MoveResult> moved =
            mover_->Move(context, request->from_node(), request->sequence_id(), call->who, *bearer,
                         *lease, request->transport(),
                         std::min(absl::FromChrono(context->deadline()), absl::Now() + kMaxMove));
        if (!moved.ok()) return moved.status();
        response->set_sequence_id(moved->created.sequence_id);
        response->set_epoch_slot(moved->created.epoch_slot);
        response->set_epoch(moved->created.epoch);
        response->set_table_version(moved->created.version);
        ToProto(absl::Seconds(moved->created.lease_seconds), response->mutable_lease());
        response->set_slots(moved->slots);
        response->set_blocks(moved->blocks);
        response->set_bytes(moved->bytes);
        response->set_source_released(moved->source_released);
        response->set_policy(moved->policy);
        response->set_transport(moved->transport);
        ToProto(moved->layout, response->mutable_layout());
        return absl::OkStatus();
      });
}

}  // namespace kvmem::service
