// The step channel without a real daemon: the client against a fake one (answers in
// chunks or trimmed, a channel that closes and is opened again, rows moved into the message
// when the batch goes by gRPC, a foreign segment), and the daemon's side of the channel
// alone (kinds, rewritten and shrunk requests).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/half_arrays.h"
#include "kvmem/client.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "kvmem/v1/step_channel.h"
#include "server/service/error_details.h"
#include "server/transport/attach_socket.h"
#include "server/transport/parse_cost.h"
#include "server/transport/step_channel.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;
namespace layout = v1::step_channel;
using StepChannelHandlerForTest = transport::StepChannel::Handler;

// The daemon's mapping of the channel's own errors.
grpc::Status ToGrpcStatus(const absl::Status& status) { return service::ToGrpc(status); }

// A KvCache with only OpenStepChannel and StepBatch, both serving the test's handler (the
// channel a real StepChannel; when asked, announcing a nonce other than the segment's, or
// ending the first channel after some batches).
class FakeChannelService final : public v1::KvCache::Service {
 public:
  explicit FakeChannelService(StepChannelHandlerForTest handler) : handler_(std::move(handler)) {}
  bool wrong_nonce = false;
  // The first channel ends (as a restarting daemon's would) after serving this many batches.
  int end_first_channel_after = -1;
  std::atomic<bool> end_channels{false};  // set: every open channel ends
  std::atomic<int> channels_opened{0};
  // Hands the channels' descriptors to the client, as kvmemd's own does.
  std::unique_ptr<transport::AttachSocket> attach = *transport::AttachSocket::Start({});
  std::atomic<int> grpc_batches{0};
  grpc::Status StepBatch(grpc::ServerContext*, const v1::StepBatchRequest* q,
                         v1::StepBatchResponse* r) override {
    ++grpc_batches;
    return handler_(*q, r);
  }
  grpc::Status OpenStepChannel(grpc::ServerContext* context, const v1::OpenStepChannelRequest* q,
                               grpc::ServerWriter<v1::OpenStepChannelResponse>* writer) override {
    const bool first = channels_opened.fetch_add(1) == 0;
    auto channel =
        transport::StepChannel::Create(q->capacity_bytes(), ToGrpcStatus, q->signal_bytes());
    if (!channel.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "create");
    v1::OpenStepChannelResponse r;
    std::vector<transport::AttachSocket::Grant> grants = {
        {v1::attach::kChannel, (*channel)->segment(), true}};
    if ((*channel)->signal_bytes() > 0) {
      r.set_signal_bytes((*channel)->signal_bytes());
      grants.push_back({v1::attach::kSignalArea, (*channel)->signal_segment(), true});
    }
    r.mutable_attach()->set_socket(attach->address());
    r.mutable_attach()->set_ticket(attach->Issue(std::move(grants), ""));
    r.set_segment_bytes((*channel)->segment_bytes());
    r.set_capacity_bytes((*channel)->capacity());
    r.set_layout_version(layout::kLayoutVersion);
    std::string nonce = (*channel)->nonce();
    if (wrong_nonce) nonce[0] = static_cast<char>(nonce[0] ^ 1);
    r.set_nonce(nonce);
    writer->Write(r);
    int served = 0;
    while (!context->IsCancelled()) {
      if (first && served == end_first_channel_after) return grpc::Status::OK;
      if (end_channels) return grpc::Status::OK;
      if ((*channel)->ServeOne(absl::Milliseconds(20), handler_) ==
          transport::StepChannel::Served::kServed) {
        ++served;
      }
    }
    return grpc::Status::OK;
  }

 private:
  StepChannelHandlerForTest handler_;
};

struct FakeDaemon {
  explicit FakeDaemon(StepChannelHandlerForTest handler) : service(std::move(handler)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~FakeDaemon() { server->Shutdown(); }
  FakeChannelService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// An answer larger than the area travels in chunks through the channel and arrives whole.
TEST(StepChannelUnitTest, AnAnswerLargerThanTheAreaArrivesInChunks) {
  int calls = 0;
  FakeDaemon fake([&](const v1::StepBatchRequest& request, v1::StepBatchResponse* response) {
    ++calls;
    EXPECT_FALSE(request.request_id().empty());
    for (int i = 0; i < request.entries_size(); ++i) {
      v1::StepBatchResult* r = response->add_results();
      r->mutable_status()->set_code(5);
      // 1.75 MiB in all: two chunks of a 1 MiB area.
      r->mutable_status()->set_message(std::string(1835008 / request.entries_size(), 'a' + i));
    }
    return grpc::Status::OK;
  });
  auto client = client::Client::Connect("127.0.0.1:" + std::to_string(fake.port));
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->OpenStepChannel(1ull << 20).ok());
  std::vector<client::BatchEntry> batch(2);
  batch[0].sequence_id = 1;
  batch[1].sequence_id = 2;
  for (int round = 0; round < 2; ++round) {
    auto r = (*client)->StepBatch(batch);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->size(), 2u);
    EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*r)[0].status.message(), std::string(917504, 'a'));
    EXPECT_EQ((*r)[1].status.message(), std::string(917504, 'b'));
  }
  EXPECT_EQ(calls, 2) << "each batch ran once; the chunks are not batches";
  EXPECT_EQ((*client)->step_channel_batches(), 2u);
}

// An answer longer than twice the area is trimmed to it (what the channel holds while the
// chunks are pending is bounded): here the statuses' messages are cut.
TEST(StepChannelUnitTest, AnAnswerPastTwiceTheAreaIsTrimmedToIt) {
  FakeDaemon fake([&](const v1::StepBatchRequest& request, v1::StepBatchResponse* response) {
    for (int i = 0; i < request.entries_size(); ++i) {
      v1::StepBatchResult* r = response->add_results();
      r->mutable_status()->set_code(5);
      r->mutable_status()->set_message(std::string(1u << 20, 'a' + i));  // 3 MiB in all
    }
    return grpc::Status::OK;
  });
  auto client = client::Client::Connect("127.0.0.1:" + std::to_string(fake.port));
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->OpenStepChannel(1ull << 20).ok());
  std::vector<client::BatchEntry> batch(3);
  for (int i = 0; i < 3; ++i) batch[i].sequence_id = i + 1;
  auto r = (*client)->StepBatch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].status.message(), std::string(1u << 20, 'a')) << "trimmed from the back";
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ((*r)[i].status.code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(absl::StartsWith((*r)[i].status.message(), std::string(200, 'a' + i)));
    EXPECT_THAT((*r)[i].status.message(), HasSubstr("message cut, 1048576 bytes"));
  }
  EXPECT_EQ((*client)->step_channel_batches(), 1u);
}

// Sets every singular integer and floating field of `m` to the value that takes the most
// bytes on the wire (fields added later included).
void SetScalarsWidest(google::protobuf::Message* m) {
  const google::protobuf::Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  using F = google::protobuf::FieldDescriptor;
  for (int i = 0; i < d->field_count(); ++i) {
    const F* f = d->field(i);
    if (f->is_repeated()) continue;
    switch (f->cpp_type()) {
      case F::CPPTYPE_UINT64:
        r->SetUInt64(m, f, ~0ull);
        break;
      case F::CPPTYPE_UINT32:
        r->SetUInt32(m, f, ~0u);
        break;
      case F::CPPTYPE_INT64:
        r->SetInt64(m, f, -1);
        break;
      case F::CPPTYPE_INT32:
        r->SetInt32(m, f, -1);
        break;
      case F::CPPTYPE_DOUBLE:
        r->SetDouble(m, f, 0.5);
        break;
      case F::CPPTYPE_FLOAT:
        r->SetFloat(m, f, 0.5f);
        break;
      default:
        break;
    }
  }
}

// FitAnswer drops table updates from the back first, then details and long messages; the
// most a trimmed result can take is kMaxTrimmedResultBytes.
TEST(StepChannelUnitTest, FitAnswerDropsUpdatesFromTheBackThenCutsStatuses) {
  v1::StepBatchResponse response;
  for (int i = 0; i < 8; ++i) {
    v1::StepBatchResult* r = response.add_results();
    r->mutable_step()->set_table_version(i + 1);
    for (int b = 0; b < 50000; ++b) r->mutable_table_update()->mutable_delta()->add_block_ids(b);
  }
  const size_t one = response.results(0).ByteSizeLong();
  const uint64_t limit = 3 * one + one / 2;
  transport::StepChannel::FitAnswer(&response, limit);
  EXPECT_LE(response.ByteSizeLong(), limit);
  ASSERT_EQ(response.results_size(), 8);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(response.results(i).has_table_update(), i < 3) << i;
    EXPECT_EQ(response.results(i).step().table_version(), i + 1u) << "the rest stays";
  }

  // The largest result trimming leaves: the longest message, details, every field at its
  // widest.
  v1::StepBatchResponse worst;
  for (int i = 0; i < 4; ++i) {
    v1::StepBatchResult* r = worst.add_results();
    r->mutable_status()->set_code(9);
    std::string message;
    for (int c = 0; c < 683; ++c) message += "\u20ac";  // 2,049 bytes of 3-byte characters
    r->mutable_status()->set_message(message);
    google::rpc::PreconditionFailure failure;
    failure.add_violations()->set_description(std::string(256, 'd'));
    r->mutable_status()->add_details()->PackFrom(failure);
    SetScalarsWidest(r->mutable_append());
    SetScalarsWidest(r->mutable_step());
  }
  transport::StepChannel::FitAnswer(&worst, 0);
  for (const v1::StepBatchResult& r : worst.results()) {
    EXPECT_EQ(r.status().details_size(), 0);
    EXPECT_LE(r.ByteSizeLong() + 3, transport::StepChannel::kMaxTrimmedResultBytes);
    EXPECT_EQ(r.status().code(), 9);
    EXPECT_TRUE(absl::StartsWith(r.status().message(), "\u20ac\u20ac"));
    EXPECT_THAT(r.status().message(), HasSubstr("(message cut, 2049 bytes)"));
  }
}

// A channel that closes (its daemon restarted) is dropped: batches go by gRPC, and after
// ClientOptions::step_channel_reopen a batch opens a new channel and goes through it. After
// CloseStepChannel no channel is opened again.
TEST(StepChannelUnitTest, AClosedChannelIsOpenedAgainAfterItsWait) {
  std::atomic<int> calls{0};
  FakeDaemon fake([&](const v1::StepBatchRequest& request, v1::StepBatchResponse* response) {
    ++calls;
    for (int i = 0; i < request.entries_size(); ++i) {
      response->add_results()->mutable_status()->set_code(5);
    }
    return grpc::Status::OK;
  });
  fake.service.end_first_channel_after = 1;
  client::ClientOptions options;
  options.step_channel_reopen = absl::Seconds(1);
  auto client = client::Client::Connect("127.0.0.1:" + std::to_string(fake.port), options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->OpenStepChannel(1ull << 20).ok());
  std::vector<client::BatchEntry> batch(1);
  batch[0].sequence_id = 1;
  auto step = [&] {
    auto r = (*client)->StepBatch(batch);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->size(), 1u);
    EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kNotFound);
  };
  step();  // through the channel, which then ends
  EXPECT_EQ((*client)->step_channel_batches(), 1u);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((*client)->step_channel_open() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_FALSE((*client)->step_channel_open());
  step();  // by gRPC: the channel is gone
  step();  // by gRPC: its wait has not passed
  EXPECT_EQ((*client)->step_channel_batches(), 1u);
  EXPECT_EQ(fake.service.channels_opened.load(), 1);
  absl::SleepFor(absl::Milliseconds(1200));
  step();  // opens a channel again and goes through it
  EXPECT_EQ(fake.service.channels_opened.load(), 2);
  EXPECT_EQ((*client)->step_channel_batches(), 2u);
  EXPECT_TRUE((*client)->step_channel_open());
  EXPECT_EQ(calls.load(), 4) << "each batch ran once";

  (*client)->CloseStepChannel();
  step();  // by gRPC, and no channel again (a reopened channel leaves no wait behind)
  EXPECT_EQ(fake.service.channels_opened.load(), 2);
  EXPECT_FALSE((*client)->step_channel_open());
  EXPECT_EQ(calls.load(), 5);
}

// Rows a client put in its channel's signal area travel in the message when the batch goes
// by gRPC because that channel closed: the daemon gets the rows, not an offset it cannot
// read. Rows that cannot be read back leave the offset, which the daemon refuses by name.
TEST(StepChannelUnitTest, RowsInTheSignalAreaGoInTheMessageWhenTheBatchGoesByGrpc) {
  std::vector<v1::StepBatchRequest> seen;
  FakeDaemon fake([&](const v1::StepBatchRequest& request, v1::StepBatchResponse* response) {
    seen.push_back(request);
    for (int i = 0; i < request.entries_size(); ++i) response->add_results();
    return grpc::Status::OK;
  });
  auto client = client::Client::Connect("127.0.0.1:" + std::to_string(fake.port));
  ASSERT_TRUE(client.ok());
  const absl::Status opened = (*client)->OpenStepChannel(1ull << 20, 1ull << 16);
  ASSERT_TRUE(opened.ok()) << opened;
  const client::Client::SignalArea area = (*client)->signal_area();
  ASSERT_FALSE(area.bytes.empty());
  const std::vector<client::StreamSignal> rows = {{0, 0, {0.25f, 0.5f, 0.125f}},
                                                  {0, 1, {1.0f, 0.0f}}};
  absl::StatusOr<uint64_t> written = client::WriteAttentionRows(area.bytes, 64, rows, true);
  ASSERT_TRUE(written.ok()) << written.status();
  std::vector<client::BatchEntry> batch(2);
  batch[0].sequence_id = 1;
  batch[0].step = client::StepArgs{};
  batch[0].step->attention_offset = 64;
  batch[1].sequence_id = 2;
  batch[1].step = client::StepArgs{};
  batch[1].step->attention_offset = area.bytes.size() - 4;  // rows past the area's end
  // The channel ends (its daemon restarts) before the batch: it goes by gRPC.
  fake.service.end_channels = true;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((*client)->step_channel_open() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  auto r = (*client)->StepBatch(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(fake.service.grpc_batches.load(), 1);
  ASSERT_EQ(seen.size(), 1u);
  const v1::StepSignals& moved = seen[0].entries(0).step();
  EXPECT_FALSE(moved.has_attention_offset());
  ASSERT_EQ(moved.attention_size(), 2);
  EXPECT_EQ(moved.attention(1).kv_head(), 1u);
  ASSERT_EQ(moved.attention(0).weights_f16().size(), 6u);  // three halves
  float back[3];
  kernels::HalfToFloat(moved.attention(0).weights_f16().data(), 3, back);
  EXPECT_EQ(back[1], 0.5f);
  const v1::StepSignals& kept = seen[0].entries(1).step();
  EXPECT_TRUE(kept.has_attention_offset()) << "the daemon names what it cannot read";
  EXPECT_EQ(kept.attention_size(), 0);
}

// A segment of the same name with another nonce is another daemon's: never used.
TEST(StepChannelUnitTest, TheClientRefusesASegmentWhoseNonceDiffers) {
  FakeDaemon fake([](const v1::StepBatchRequest&, v1::StepBatchResponse*) {
    ADD_FAILURE() << "a batch reached a channel the client should have refused";
    return grpc::Status::OK;
  });
  fake.service.wrong_nonce = true;
  auto client = client::Client::Connect("127.0.0.1:" + std::to_string(fake.port));
  ASSERT_TRUE(client.ok());
  const absl::Status s = (*client)->OpenStepChannel(1ull << 20);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not the channel the daemon opened"));
  EXPECT_FALSE((*client)->step_channel_open());
}

// Requests a client rewrites while the daemon reads them, asks for chunks when none are
// pending, or names no kind the layout knows: nothing runs, or an error comes back.
TEST(StepChannelUnitTest, KindsAndRewrittenRequests) {
  auto channel = transport::StepChannel::Create(transport::StepChannel::kMinCapacity, ToGrpcStatus);
  ASSERT_TRUE(channel.ok()) << channel.status();
  uint8_t* data = (*channel)->segment().lock()->data();
  auto* header = reinterpret_cast<layout::Header*>(data);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(header->nonce), layout::kNonceBytes),
            (*channel)->nonce());
  int calls = 0;
  auto count = [&](const v1::StepBatchRequest&, v1::StepBatchResponse*) {
    ++calls;
    return grpc::Status::OK;
  };
  header->request_kind = layout::kMore;
  header->request_seq.store(1);
  EXPECT_EQ((*channel)->ServeOne(absl::Seconds(1), count), transport::StepChannel::Served::kServed);
  EXPECT_EQ(header->response_code.load(),
            static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  header->request_kind = 7;
  header->request_seq.store(2);
  EXPECT_EQ((*channel)->ServeOne(absl::Seconds(1), count), transport::StepChannel::Served::kServed);
  EXPECT_EQ(header->response_code.load(),
            static_cast<uint32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(calls, 0);
}

// A request of tiny records whose parse would take more than the process's parse budget
// beyond the channel's own arena is refused before it is parsed, and holds nothing after.
TEST(StepChannelUnitTest, TinyRecordsPastTheParseBudgetAreRefusedUnparsed) {
  auto channel = transport::StepChannel::Create(transport::StepChannel::kMinCapacity, ToGrpcStatus);
  ASSERT_TRUE(channel.ok()) << channel.status();
  uint8_t* data = (*channel)->segment().lock()->data();
  auto* header = reinterpret_cast<layout::Header*>(data);
  v1::StepBatchRequest batch;
  batch.set_request_id("tiny");
  for (int i = 0; i < 500000; ++i) batch.add_entries();  // 1 MB, about 100 MB once parsed
  const std::string bytes = batch.SerializeAsString();
  ASSERT_LE(bytes.size(), transport::StepChannel::kMinCapacity);
  std::memcpy(data + layout::kHeaderBytes, bytes.data(), bytes.size());
  header->request_bytes = static_cast<uint32_t>(bytes.size());
  header->request_kind = layout::kBatch;
  transport::ParseBudget& budget = transport::ParseBudget::Process();
  const uint64_t capacity = budget.capacity();
  budget.SetCapacity(16ull << 20);
  int calls = 0;
  auto count = [&](const v1::StepBatchRequest&, v1::StepBatchResponse*) {
    ++calls;
    return grpc::Status::OK;
  };
  header->request_seq.store(1);
  EXPECT_EQ((*channel)->ServeOne(absl::Seconds(1), count), transport::StepChannel::Served::kServed);
  EXPECT_EQ(header->response_code.load(),
            static_cast<uint32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(budget.reserved(), 0u);
  // Within the budget, the same request is parsed and served.
  budget.SetCapacity(1ull << 30);
  header->request_seq.store(2);
  EXPECT_EQ((*channel)->ServeOne(absl::Seconds(1), count), transport::StepChannel::Served::kServed);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(budget.reserved(), 0u);
  budget.SetCapacity(capacity);
}

// The segments' sizes are sealed: a client holding their descriptors cannot shrink them
// under the daemon's reads (nor grow them), so the channel serves on.
TEST(StepChannelUnitTest, NoHolderCanResizeTheSegments) {
  auto channel = transport::StepChannel::Create(transport::StepChannel::kMinCapacity, ToGrpcStatus,
                                                /*signal_bytes=*/4096);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (const auto& segment : {(*channel)->segment().lock(), (*channel)->signal_segment().lock()}) {
    const int fd = open(("/proc/self/fd/" + std::to_string(segment->fd())).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    EXPECT_NE(ftruncate(fd, 0), 0);
    EXPECT_EQ(errno, EPERM);
    EXPECT_NE(ftruncate(fd, segment->bytes() * 2), 0);
    close(fd);
  }
  auto* header = reinterpret_cast<layout::Header*>((*channel)->segment().lock()->data());
  header->request_kind = layout::kBatch;
  header->request_bytes = 0;
  header->request_seq.store(1);
  int calls = 0;
  auto count = [&](const v1::StepBatchRequest&, v1::StepBatchResponse*) {
    ++calls;
    return grpc::Status::OK;
  };
  EXPECT_EQ((*channel)->ServeOne(absl::Seconds(1), count), transport::StepChannel::Served::kServed);
}

}  // namespace
}  // namespace kvmem
