// A step channel's daemon side (StepChannel::ServeOne, with the signal area's reader) on
// what a hostile same-host client writes between its calls: the request's kind, claimed
// length and bytes, any bytes in the signal area, and attention offsets into it. (Writes
// racing the daemon's copy, and a segment shrunk under it, are step_channel_test's.) The handler
// reads each entry's rows from the area as the service does (SignalsFromArea) and answers with
// table updates sized by the entry, so that answers also pass the area's capacity and come
// back in chunks. Checked on every input: the answer is whole and well-formed — a failed
// call's code and google.rpc.Status, or, over all of its chunks, a StepBatchResponse with
// one result per entry carrying the status its entry got, within MaxAnswerBytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "google/protobuf/stubs/logging.h"
#include "google/rpc/status.pb.h"
#include "kvmem/v1/kvmem.pb.h"
#include "kvmem/v1/step_channel.h"
#include "server/service/convert.h"
#include "server/service/error_details.h"
#include "server/transport/segment_guard.h"
#include "server/transport/step_channel.h"

namespace kvmem::fuzz {
namespace {

namespace layout = v1::step_channel;
constexpr uint64_t kCapacity = transport::StepChannel::kMinCapacity;
constexpr uint64_t kSignalBytes = 64 << 10;

// The client's side: the channel's two segments, mapped writable as a client maps the
// descriptors it receives.
struct Client {
  std::unique_ptr<transport::StepChannel> channel;
  uint8_t* segment = nullptr;
  uint8_t* signals = nullptr;
  layout::Header* header() const { return reinterpret_cast<layout::Header*>(segment); }
  uint32_t seq = 0;
};
Client* client = nullptr;

uint8_t* MapWritable(const transport::SharedSegment& segment) {
  void* p = mmap(nullptr, segment.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, segment.fd(), 0);
  FUZZ_CHECK(p != MAP_FAILED, "mmap %s", segment.label().c_str());
  return static_cast<uint8_t*>(p);
}

// What the handler answered for the request it saw (statuses per entry), for the check.
std::vector<int> answered_codes;
bool handler_ran = false;

grpc::Status Handle(const v1::StepBatchRequest& request, v1::StepBatchResponse* response) {
  handler_ran = true;
  uint64_t budget = kSignalBytes;
  for (const v1::StepBatchEntry& entry : request.entries()) {
    v1::StepBatchResult* result = response->add_results();
    absl::Status status = absl::OkStatus();
    if (entry.step().has_attention_offset()) {
      service::SignalStorage storage;
      service::AreaValues values;
      absl::StatusOr<std::vector<engine::StreamSignal>> rows = service::SignalsFromArea(
          [](uint64_t offset, uint64_t bytes, void* out) {
            return client->channel->CopySignals(offset, bytes, out, "attention_offset");
          },
          entry.step().attention_offset(), "attention_offset", &budget, &storage, &values);
      if (rows.ok()) {
        absl::Status read = client->channel->ReadSignalValues(
            values.offset, values.count, values.f16, values.out, "attention_offset");
        if (!read.ok()) rows = read;
      }
      if (rows.ok()) {
        for (const engine::StreamSignal& row : *rows) {
          // Every value the views name was copied out of the area: reading it is safe.
          volatile float sum = 0;
          for (float w : row.values) sum = sum + w;
        }
      }
      status = rows.status();
    }
    *result->mutable_status() = service::ToRpcStatus(status, entry.sequence_id());
    answered_codes.push_back(static_cast<int>(status.code()));
    v1::StreamTable* table = result->mutable_table_update()->mutable_table()->add_streams();
    for (uint32_t b = 0; b < entry.plan_tokens() % 50000; ++b) table->add_block_ids(b * 7919u);
  }
  return grpc::Status::OK;
}

// Posts the request now in the area (kind, claimed bytes) and serves it.
transport::StepChannel::Served Post(uint32_t kind, uint32_t bytes) {
  layout::Header* h = client->header();
  h->request_kind.store(kind, std::memory_order_relaxed);
  h->request_bytes.store(bytes, std::memory_order_relaxed);
  h->request_seq.store(++client->seq, std::memory_order_release);
  return client->channel->ServeOne(absl::ZeroDuration(), Handle);
}

}  // namespace
}  // namespace kvmem::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace kvmem;
  transport::SegmentGuard::Install();
  // Requests with invalid UTF-8 in a string field fail to parse, which is the point; not a log line
  // each.
  google::protobuf::SetLogHandler(nullptr);
  auto* c = new fuzz::Client();
  auto channel = transport::StepChannel::Create(
      fuzz::kCapacity, [](const absl::Status& s) { return service::ToGrpc(s); },
      fuzz::kSignalBytes);
  FUZZ_CHECK(channel.ok(), "%s", channel.status().ToString().c_str());
  c->channel = *std::move(channel);
  c->segment = fuzz::MapWritable(*c->channel->segment().lock());
  c->signals = fuzz::MapWritable(*c->channel->signal_segment().lock());
  fuzz::client = c;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvmem;
  namespace layout = v1::step_channel;
  fuzz::FuzzInput in(data, size);
  fuzz::Client& c = *fuzz::client;
  layout::Header* h = c.header();
  // The signal area: a few writes of the input's bytes at the input's offsets.
  const uint8_t writes = in.Take<uint8_t>() % 8;
  for (uint8_t w = 0; w < writes; ++w) {
    const uint32_t offset = in.Take<uint32_t>() % fuzz::kSignalBytes;
    const std::string bytes =
        in.Bytes(std::min<size_t>(in.Take<uint16_t>(), fuzz::kSignalBytes - offset));
    std::memcpy(c.signals + offset, bytes.data(), bytes.size());
  }
  // The request: kBatch or the input's kind, its true length or the input's claim.
  const uint8_t flags = in.Take<uint8_t>();
  const uint32_t kind = flags & 1 ? in.Take<uint32_t>() % 4 : layout::kBatch;
  const uint32_t claim = in.Take<uint32_t>();
  const std::string request = in.Rest();
  const uint32_t written =
      static_cast<uint32_t>(std::min<uint64_t>(request.size(), fuzz::kCapacity));
  std::memcpy(c.segment + h->request_offset, request.data(), written);
  const uint32_t bytes = flags & 2 ? claim : written;
  fuzz::answered_codes.clear();
  fuzz::handler_ran = false;
  const transport::StepChannel::Served served = fuzz::Post(kind, bytes);
  FUZZ_CHECK(served == transport::StepChannel::Served::kServed,
             "a request posted was not served (%d)", static_cast<int>(served));
  FUZZ_CHECK(h->response_seq.load(std::memory_order_acquire) == c.seq, "no answer to request %u",
             c.seq);
  const uint32_t code = h->response_code.load();
  const uint32_t first = h->response_bytes.load();
  const uint64_t total = h->response_total.load();
  FUZZ_CHECK(first <= fuzz::kCapacity, "an answer of %u bytes in an area of %llu", first,
             static_cast<unsigned long long>(fuzz::kCapacity));
  std::string answer(reinterpret_cast<const char*>(c.segment + h->response_offset), first);
  if (code != 0) {
    google::rpc::Status status;
    FUZZ_CHECK(status.ParseFromString(answer) && status.code() == static_cast<int>(code),
               "a failed call's area does not hold its google.rpc.Status (code %u)", code);
    FUZZ_CHECK(!fuzz::handler_ran || kind == layout::kMore, "the handler ran on a failed call");
    return 0;
  }
  FUZZ_CHECK(fuzz::handler_ran || kind == layout::kMore, "answered OK without running the batch");
  FUZZ_CHECK(total >= first && total <= transport::StepChannel::MaxAnswerBytes(fuzz::kCapacity),
             "an answer of %llu bytes", static_cast<unsigned long long>(total));
  // The rest in chunks (kMore), each at most the area.
  while (answer.size() < total) {
    FUZZ_CHECK(fuzz::Post(layout::kMore, 0) == transport::StepChannel::Served::kServed,
               "a chunk asked for was not served");
    FUZZ_CHECK(h->response_code.load() == 0 && h->response_total.load() == total,
               "a chunk changed the answer's code or size");
    const uint32_t chunk = h->response_bytes.load();
    FUZZ_CHECK(chunk > 0 && chunk <= fuzz::kCapacity && answer.size() + chunk <= total,
               "a chunk of %u bytes", chunk);
    answer.append(reinterpret_cast<const char*>(c.segment + h->response_offset), chunk);
  }
  FUZZ_CHECK(fuzz::handler_ran, "an OK answer without a batch run (kind %u)", kind);
  v1::StepBatchResponse response;
  FUZZ_CHECK(response.ParseFromString(answer), "the answer's %zu bytes do not parse",
             answer.size());
  FUZZ_CHECK(response.results_size() == static_cast<int>(fuzz::answered_codes.size()),
             "%d results for %zu entries", response.results_size(), fuzz::answered_codes.size());
  for (int i = 0; i < response.results_size(); ++i) {
    FUZZ_CHECK(response.results(i).status().code() == fuzz::answered_codes[i],
               "result %d: code %d, answered %d", i, response.results(i).status().code(),
               fuzz::answered_codes[i]);
  }
  return 0;
}
