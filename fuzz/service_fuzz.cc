// Every unary handler of kvmem.v1.KvCache, in process, on arbitrary calls. An input is a
// series of calls, each a method byte, a length and that many bytes parsed as the method's
// request (an input that does not parse is skipped), against an engine and service of its
// own (created for the input, so that a finding replays alone: ids, epochs and request ids
// start afresh). Sequence ids in a request are mapped onto the sequences this input
// created (an id of k > 0 names the ((k - 1) mod (n + 1))-th of n, the last value keeping
// the id as sent), so that the fuzzer reaches past "unknown sequence". Checked on every
// input:
//   - what kvmemd counts before parsing a request (transport::ParseCost) refuses only what
//     protobuf refuses and is at least what the parsed request holds;
//   - no call and no StepBatch entry answers INTERNAL or UNKNOWN (kvmemd's own bugs);
//   - a failed Append, Step or Compress leaves its sequence exactly as it was (the state
//     fingerprint: per-slot metadata, scores, block list and K/V; a sequence poisoned by
//     it counts as changed: on the CPU backend no backend call fails);
//   - once every sequence is released and the prefix cache reclaimed, the pool holds no
//     block and no page, no reference went wrong, and no host metadata is left counted.
// AppendStream runs on chunks from the input (a chunk that does not parse is refused as the
// gRPC reader refuses it; a failed stream leaves its sequence unchanged), ReadKv into a
// writer that checks each piece's shape; OpenStepChannel lives as long as its client and has
// a harness of its own (step_channel_fuzz).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_input.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "server/engine/engine.h"
#include "server/service/kv_cache_service.h"
#include "server/store/backend_factory.h"
#include "server/transport/parse_cost.h"

namespace kvmem::fuzz {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using service::KvCacheService;

struct Kvmemd {
  engine::FakeClock clock;  // leases and retried request ids never lapse within an input
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<KvCacheService> service;
};
Kvmemd* kvmemd = nullptr;  // the input's
// KVMEM_FUZZ_VERBOSE=1: each call's method and answer on stderr (to read a finding).
const bool verbose = std::getenv("KVMEM_FUZZ_VERBOSE") != nullptr;

uint64_t MapId(uint64_t sent, const std::vector<uint64_t>& ids) {
  if (sent == 0) return 0;
  const uint64_t k = (sent - 1) % (ids.size() + 1);
  return k < ids.size() ? ids[k] : sent;
}

// Every uint64 field called sequence_id or sequence_ids, at any depth.
void MapIds(Message* m, const std::vector<uint64_t>& ids) {
  const Reflection* r = m->GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(*m, &fields);
  for (const FieldDescriptor* f : fields) {
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*m, f); ++i)
          MapIds(r->MutableRepeatedMessage(m, f, i), ids);
      } else {
        MapIds(r->MutableMessage(m, f), ids);
      }
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64 &&
               (f->name() == "sequence_id" || f->name() == "sequence_ids")) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*m, f); ++i) {
          r->SetRepeatedUInt64(m, f, i, MapId(r->GetRepeatedUInt64(*m, f, i), ids));
        }
      } else {
        r->SetUInt64(m, f, MapId(r->GetUInt64(*m, f), ids));
      }
    }
  }
}

std::string FingerprintOf(uint64_t id) {
  absl::StatusOr<std::string> f = kvmemd->engine->Fingerprint(id);
  FUZZ_CHECK(f.ok() || absl::IsNotFound(f.status()) || absl::IsDataLoss(f.status()),
             "the fingerprint of sequence %llu: %s", static_cast<unsigned long long>(id),
             f.status().ToString().c_str());
  return f.ok() ? *f : absl::StrCat("(", f.status().ToString(), ")");
}

void CheckCode(int code, const char* what, const std::string& message) {
  FUZZ_CHECK(code != grpc::StatusCode::INTERNAL && code != grpc::StatusCode::UNKNOWN,
             "%s answered %d: %s", what, code, message.c_str());
}

// Parses `bytes` into `message`, checking on the way that what kvmemd counts before it
// parses (transport::ParseCost) refuses only what protobuf refuses and bounds what the
// parse holds — measured on a message of its own: one parsed into again (an AppendStream's
// chunks) keeps the capacity of the chunk before, which that chunk's cost counted.
bool Parse(const std::string& bytes, Message* message) {
  const bool parsed = message->ParseFromString(bytes);
  const absl::StatusOr<uint64_t> cost = transport::ParseCost(message->GetDescriptor(), bytes);
  FUZZ_CHECK(cost.ok() || !parsed, "ParseCost refused a %s that parses: %s",
             message->GetDescriptor()->name().c_str(), cost.status().ToString().c_str());
  if (!parsed) return false;
  const std::unique_ptr<Message> fresh(message->New());
  FUZZ_CHECK(fresh->ParseFromString(bytes), "a %s parsed once, not twice",
             message->GetDescriptor()->name().c_str());
  FUZZ_CHECK(*cost >= fresh->SpaceUsedLong(), "ParseCost %llu below the %s's %llu bytes",
             static_cast<unsigned long long>(*cost), message->GetDescriptor()->name().c_str(),
             static_cast<unsigned long long>(fresh->SpaceUsedLong()));
  return true;
}

template <typename Request, typename Response>
void Call(grpc::Status (KvCacheService::*handler)(grpc::ServerContext*, const Request*, Response*),
          const std::string& bytes, std::vector<uint64_t>* ids, bool unchanged_on_error = false) {
  Request request;
  if (!Parse(bytes, &request)) return;
  MapIds(&request, *ids);
  uint64_t target = 0;
  std::string before;
  if constexpr (std::is_same_v<Request, v1::AppendRequest> ||
                std::is_same_v<Request, v1::StepRequest> ||
                std::is_same_v<Request, v1::CompressRequest>) {
    target = request.sequence_id();
    if (unchanged_on_error) before = FingerprintOf(target);
  }
  grpc::ServerContext context;
  Response response;
  const grpc::Status status = (kvmemd->service.get()->*handler)(&context, &request, &response);
  if (verbose) {
    std::fprintf(stderr, "%s -> %d %s\n", Request::descriptor()->name().c_str(),
                 status.error_code(), status.error_message().c_str());
  }
  CheckCode(status.error_code(), Request::descriptor()->name().c_str(), status.error_message());
  if constexpr (std::is_same_v<Response, v1::StepBatchResponse>) {
    for (const v1::StepBatchResult& result : response.results()) {
      CheckCode(result.status().code(), "a StepBatch entry", result.status().message());
    }
  }
  if (!status.ok() && unchanged_on_error) {
    FUZZ_CHECK(FingerprintOf(target) == before, "a failed %s (%d: %s) changed sequence %llu",
               Request::descriptor()->name().c_str(), status.error_code(),
               status.error_message().c_str(), static_cast<unsigned long long>(target));
  }
  if constexpr (std::is_same_v<Response, v1::CreateSequenceResponse> ||
                std::is_same_v<Response, v1::ForkResponse>) {
    if (status.ok()) ids->push_back(response.sequence_id());
  }
}

// An AppendStream's chunks from `bytes` (each a 16-bit length and that many bytes); a chunk
// that does not parse is refused as the gRPC reader refuses it. Its sequence (the first
// chunk's, mapped) is unchanged when the stream fails.
class ChunkReader final : public service::MessageReader<v1::AppendStreamRequest> {
 public:
  ChunkReader(const std::string& bytes, const std::vector<uint64_t>& ids)
      : in_(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), ids_(ids) {}
  bool Read(v1::AppendStreamRequest* message) override {
    if (in_.remaining() == 0 || chunks_ == 8) return false;
    ++chunks_;
    if (!Parse(in_.Bytes(in_.Take<uint16_t>()), message)) {
      refused_ = absl::InvalidArgumentError("the chunk does not parse");
      return false;
    }
    MapIds(message, ids_);
    return true;
  }
  const absl::Status& refused() const override { return refused_; }

 private:
  FuzzInput in_;
  const std::vector<uint64_t>& ids_;
  int chunks_ = 0;
  absl::Status refused_;
};

void AppendStream(const std::string& bytes, const std::vector<uint64_t>& ids) {
  // The first chunk's sequence, read ahead to fingerprint it before the stream.
  uint64_t target = 0;
  {
    ChunkReader peek(bytes, ids);
    v1::AppendStreamRequest first;
    if (peek.Read(&first)) target = first.sequence_id();
  }
  const std::string before = FingerprintOf(target);
  ChunkReader reader(bytes, ids);
  grpc::ServerContext context;
  v1::AppendStreamResponse response;
  const grpc::Status status = kvmemd->service->AppendStream(&context, &reader, &response);
  if (verbose) {
    std::fprintf(stderr, "AppendStream -> %d %s\n", status.error_code(),
                 status.error_message().c_str());
  }
  CheckCode(status.error_code(), "AppendStream", status.error_message());
  FUZZ_CHECK(reader.refused().ok() || !status.ok(),
             "an AppendStream whose chunk was refused answered OK");
  if (!status.ok()) {
    FUZZ_CHECK(FingerprintOf(target) == before,
               "a failed AppendStream (%d: %s) changed sequence %llu", status.error_code(),
               status.error_message().c_str(), static_cast<unsigned long long>(target));
  }
}

// ReadKv's pieces, kept for the check: each a stream's K and V for its positions.
class PieceWriter final : public grpc::ServerWriterInterface<v1::ReadKvResponse> {
 public:
  void SendInitialMetadata() override {}
  bool Write(const v1::ReadKvResponse& piece, grpc::WriteOptions /*options*/) override {
    const size_t n = static_cast<size_t>(piece.positions_size());
    // A stream without a slot comes as one piece without bytes (its epoch, nothing more).
    FUZZ_CHECK(piece.k().size() == piece.v().size() &&
                   (n > 0 ? piece.k().size() % n == 0 : piece.k().empty()),
               "a ReadKv piece of %zu K bytes, %zu V bytes for %zu positions", piece.k().size(),
               piece.v().size(), n);
    if (n == 0) return true;
    for (size_t i = 1; i < n; ++i) {
      FUZZ_CHECK(piece.positions(i) > piece.positions(i - 1),
                 "a ReadKv piece's positions do not increase at %zu", i);
    }
    // At most a piece's bytes, or one slot's when that is more.
    const size_t row = piece.k().size() / n;
    FUZZ_CHECK(2 * piece.k().size() + 8 * n <=
                   std::max<size_t>(KvCacheService::kReadPieceBytes, 2 * row + 8),
               "a ReadKv piece of %zu positions, %zu bytes a row", n, row);
    return true;
  }
};

void ReadKv(const std::string& bytes, const std::vector<uint64_t>& ids) {
  v1::ReadKvRequest request;
  if (!request.ParseFromString(bytes)) return;
  MapIds(&request, ids);
  grpc::ServerContext context;
  PieceWriter writer;
  const grpc::Status status = kvmemd->service->ReadKv(&context, &request, &writer);
  if (verbose) {
    std::fprintf(stderr, "ReadKv -> %d %s\n", status.error_code(), status.error_message().c_str());
  }
  CheckCode(status.error_code(), "ReadKv", status.error_message());
}

}  // namespace
}  // namespace kvmem::fuzz

namespace kvmem::fuzz {
namespace {

std::unique_ptr<Kvmemd> Start() {
  auto d = std::make_unique<Kvmemd>();
  engine::EngineConfig config;
  config.pool_bytes = 2ull << 20;  // small: full pools are paths to fuzz too
  config.max_sequences = 32;
  config.max_append_bytes = 1ull << 20;
  config.host_metadata_bytes = 32ull << 20;
  config.in_place_writes = true;
  config.table_area_bytes = 256ull << 10;
  config.parallel_batches = false;  // one input, one order
  // Reclaim gives back every cached prefix block (the end-of-input check needs them back).
  config.cache_high_watermark = config.cache_low_watermark = 1e-9;
  auto backend = store::MakeBackend("cpu", config.pool_bytes);
  FUZZ_CHECK(backend.ok(), "%s", backend.status().ToString().c_str());
  auto engine = engine::Engine::Create(config, *std::move(backend), &d->clock);
  FUZZ_CHECK(engine.ok(), "%s", engine.status().ToString().c_str());
  d->engine = *std::move(engine);
  d->service = std::make_unique<KvCacheService>(d->engine.get(), "fuzz", service::ServiceLimits{},
                                                &d->clock);
  return d;
}

}  // namespace
}  // namespace kvmem::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Requests with invalid UTF-8 in a string field fail to parse, which is the point; not a
  // log line each.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvmem;
  using S = service::KvCacheService;
  std::unique_ptr<fuzz::Kvmemd> d = fuzz::Start();
  fuzz::kvmemd = d.get();
  fuzz::FuzzInput in(data, size);
  std::vector<uint64_t> ids;
  for (int calls = 0; calls < 32 && in.remaining() > 0; ++calls) {
    const uint8_t method = in.Take<uint8_t>();
    const std::string bytes = in.Bytes(in.Take<uint16_t>());
    switch (method % 15) {
      case 0:
        fuzz::Call(&S::GetInfo, bytes, &ids);
        break;
      case 1:
        fuzz::Call(&S::CreateSequence, bytes, &ids);
        break;
      case 2:
        fuzz::Call(&S::Append, bytes, &ids, /*unchanged_on_error=*/true);
        break;
      case 3:
        fuzz::Call(&S::Step, bytes, &ids, /*unchanged_on_error=*/true);
        break;
      case 4:
        fuzz::Call(&S::StepBatch, bytes, &ids);
        break;
      case 5:
        fuzz::Call(&S::Compress, bytes, &ids, /*unchanged_on_error=*/true);
        break;
      case 6:
        fuzz::Call(&S::GetBlockTable, bytes, &ids);
        break;
      case 7:
        fuzz::Call(&S::Fork, bytes, &ids);
        break;
      case 8:
        fuzz::Call(&S::Publish, bytes, &ids);
        break;
      case 9:
        fuzz::Call(&S::Lookup, bytes, &ids);
        break;
      case 10:
        fuzz::Call(&S::Release, bytes, &ids);
        break;
      case 11:
        fuzz::Call(&S::KeepAlive, bytes, &ids);
        break;
      case 12:
        fuzz::Call(&S::Stats, bytes, &ids);
        break;
      case 13:
        fuzz::AppendStream(bytes, ids);
        break;
      case 14:
        fuzz::ReadKv(bytes, ids);
        break;
    }
  }
  // Back to empty: every sequence released, every cached block reclaimed.
  engine::Engine& engine = *d->engine;
  for (const engine::SequenceSummary& s : engine.Stats(/*include_sequences=*/true).sequences) {
    engine.Release(s.sequence_id).IgnoreError();
  }
  engine.ReclaimToWatermark();
  const engine::EngineStats stats = engine.Stats(/*include_sequences=*/false);
  FUZZ_CHECK(
      stats.pool.blocks_used == 0 && stats.pool.pages_used == 0 && stats.pool.bad_unrefs == 0,
      "after everything was released: %llu blocks, %llu pages in use, %llu bad unrefs",
      static_cast<unsigned long long>(stats.pool.blocks_used),
      static_cast<unsigned long long>(stats.pool.pages_used),
      static_cast<unsigned long long>(stats.pool.bad_unrefs));
  FUZZ_CHECK(stats.host_metadata_bytes == 0 && stats.sequences_active == 0,
             "after everything was released: %llu bytes of host metadata, %u sequences",
             static_cast<unsigned long long>(stats.host_metadata_bytes), stats.sequences_active);
  fuzz::kvmemd = nullptr;
  return 0;  // `d` goes, its shared-memory segments with it
}
