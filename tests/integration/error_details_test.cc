// Errors carry google.rpc details (a google.rpc.Status in the gRPC status details) that a
// program reads instead of parsing the message: the field of an INVALID_ARGUMENT, the
// current epoch of a stale-epoch error, the limit of a RESOURCE_EXHAUSTED. The C++ client
// keeps the message unchanged and surfaces the details as absl::Status payloads.
#include "server/service/error_details.h"

#include <functional>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/engine/engine.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

// The google.rpc.Status a gRPC status carries; its code and message are the status's own.
google::rpc::Status RichStatus(const grpc::Status& status) {
  google::rpc::Status rich;
  EXPECT_FALSE(status.error_details().empty()) << "no details: " << status.error_message();
  EXPECT_TRUE(rich.ParseFromString(status.error_details()));
  EXPECT_EQ(rich.code(), static_cast<int32_t>(status.error_code()));
  EXPECT_EQ(rich.message(), status.error_message());
  return rich;
}

// The first detail of type `Detail`, if any.
template <typename Detail>
std::optional<Detail> FindDetail(const google::rpc::Status& rich) {
  for (const google::protobuf::Any& any : rich.details()) {
    Detail detail;
    if (any.UnpackTo(&detail)) return detail;
  }
  return std::nullopt;
}

std::string Payload(const absl::Status& status, absl::string_view key) {
  const auto payload = status.GetPayload(key);
  return payload ? std::string(*payload) : "(none)";
}

class ErrorDetailsTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    stub_ = v1::KvCache::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                                     grpc::InsecureChannelCredentials()));
  }

  v1::CreateSequenceRequest GoodCreate() {
    v1::CreateSequenceRequest q;
    q.mutable_layout()->set_num_layers(kL);
    q.mutable_layout()->set_num_kv_heads(kH);
    q.mutable_layout()->set_head_dim(kD);
    q.mutable_layout()->set_dtype(v1::DTYPE_F16);
    q.mutable_layout()->set_vocab_size(100);
    return q;
  }

  std::unique_ptr<v1::KvCache::Stub> stub_;
};

TEST_F(ErrorDetailsTest, InvalidArgumentNamesTheFieldInABadRequest) {
  v1::CreateSequenceRequest q = GoodCreate();
  q.mutable_layout()->set_block_tokens(0);
  v1::CreateSequenceResponse r;
  grpc::ClientContext context;
  const grpc::Status status = stub_->CreateSequence(&context, q, &r);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const std::optional<google::rpc::BadRequest> bad =
      FindDetail<google::rpc::BadRequest>(RichStatus(status));
  ASSERT_TRUE(bad.has_value());
  ASSERT_EQ(bad->field_violations_size(), 1);
  EXPECT_EQ(bad->field_violations(0).field(), "layout.block_tokens");
  EXPECT_THAT(bad->field_violations(0).description(), HasSubstr("at least 1 token"));

  // A field the engine names, inside a streamed chunk: the path without the chunk's index.
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 8).ok());
  v1::AppendStreamRequest chunk;
  chunk.set_sequence_id(id);
  chunk.add_positions(8);
  chunk.set_k(testing::Payload16(kL * kH, 8, 1, kD, 0));
  chunk.set_v(testing::Payload16(kL * kH, 8, 1, kD, 1));
  v1::AppendStreamRequest back = chunk;
  back.set_positions(0, 3);
  v1::AppendStreamResponse appended;
  grpc::ClientContext stream_context;
  auto writer = stub_->AppendStream(&stream_context, &appended);
  writer->Write(chunk);
  writer->Write(back);
  writer->WritesDone();
  const grpc::Status stream_status = writer->Finish();
  ASSERT_EQ(stream_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(stream_status.error_message(), HasSubstr("chunk 1: positions[0]"));
  const std::optional<google::rpc::BadRequest> stream_bad =
      FindDetail<google::rpc::BadRequest>(RichStatus(stream_status));
  ASSERT_TRUE(stream_bad.has_value());
  EXPECT_EQ(stream_bad->field_violations(0).field(), "positions[0]");

  // Through the client: the same message, the field as a payload, the detail by type URL.
  client::Layout layout = TestLayout();
  layout.block_tokens = 0;
  const absl::Status via_client = client_->CreateSequence(layout, {}).status();
  EXPECT_EQ(via_client.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(via_client.message(), status.error_message());
  EXPECT_EQ(Payload(via_client, client::kFieldPayload), "layout.block_tokens");
  const auto typed = via_client.GetPayload("type.googleapis.com/google.rpc.BadRequest");
  ASSERT_TRUE(typed.has_value());
  google::rpc::BadRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(std::string(*typed)));
  EXPECT_EQ(parsed.field_violations(0).field(), "layout.block_tokens");
}

// Lookup refuses what CreateSequence refuses (an unknown policy or parameter), and names
// its own fields (token_ids, not CreateSequence's prompt_token_ids); an unknown parameter
// whose name cannot sit in a field path still names a field: the map's.
TEST_F(ErrorDetailsTest, LookupNamesItsOwnFieldsAndRefusesAnUnknownPolicy) {
  auto field_of = [](const grpc::Status& status) {
    const std::optional<google::rpc::BadRequest> bad =
        FindDetail<google::rpc::BadRequest>(RichStatus(status));
    return bad && bad->field_violations_size() == 1 ? bad->field_violations(0).field()
                                                    : std::string("(none)");
  };
  auto lookup = [&](const std::function<void(v1::LookupRequest&)>& edit) {
    v1::LookupRequest q;
    *q.mutable_layout() = GoodCreate().layout();
    for (int32_t t : {1, 2, 3}) q.add_token_ids(t);
    edit(q);
    v1::LookupResponse r;
    grpc::ClientContext context;
    return stub_->Lookup(&context, q, &r);
  };
  EXPECT_TRUE(lookup([](v1::LookupRequest&) {}).ok());
  const grpc::Status token = lookup([](v1::LookupRequest& q) { q.set_token_ids(1, 100); });
  EXPECT_EQ(token.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(field_of(token), "token_ids[1]");
  const grpc::Status policy =
      lookup([](v1::LookupRequest& q) { q.mutable_policy()->set_name("no_such_policy"); });
  EXPECT_EQ(policy.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << policy.error_message();
  const grpc::Status param = lookup([](v1::LookupRequest& q) {
    q.mutable_policy()->set_name("window");
    (*q.mutable_policy()->mutable_params())["no_such_param"] = 1;
  });
  EXPECT_EQ(param.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(field_of(param), "policy.params[no_such_param]");
  const grpc::Status long_name = lookup([](v1::LookupRequest& q) {
    q.mutable_policy()->set_name("window");
    (*q.mutable_policy()->mutable_params())[std::string(100, 'x')] = 1;
  });
  EXPECT_EQ(long_name.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(field_of(long_name), "policy.params");
  EXPECT_THAT(long_name.error_message(), HasSubstr("(100 bytes)"));
  const grpc::Status odd_name = lookup([](v1::LookupRequest& q) {
    q.mutable_policy()->set_name("window");
    (*q.mutable_policy()->mutable_params())["a-b"] = 1;
  });
  EXPECT_EQ(field_of(odd_name), "policy.params");
}

TEST_F(ErrorDetailsTest, AStaleEpochCarriesTheCurrentEpoch) {
  const uint64_t id = Create("window", {{"window", 32}});
  ASSERT_TRUE(AppendRange(id, 0, 40).ok());
  const uint64_t epoch = client_->GetBlockTable(id)->epoch;

  // A Step whose rows were computed on an epoch the table is not at.
  v1::StepRequest step;
  step.set_sequence_id(id);
  step.set_epoch(epoch + 7);
  v1::AttentionRow* row = step.add_attention();
  row->set_layer(0);
  row->set_kv_head(0);
  for (int i = 0; i < 40; ++i) row->add_weights(0.025f);
  v1::StepResponse r;
  grpc::ClientContext context;
  const grpc::Status status = stub_->Step(&context, step, &r);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const google::rpc::Status rich = RichStatus(status);
  const std::optional<google::rpc::PreconditionFailure> failure =
      FindDetail<google::rpc::PreconditionFailure>(rich);
  ASSERT_TRUE(failure.has_value());
  ASSERT_GE(failure->violations_size(), 1);
  EXPECT_EQ(failure->violations(0).type(), "EPOCH");
  EXPECT_EQ(failure->violations(0).subject(), "sequence/" + std::to_string(id));
  EXPECT_THAT(failure->violations(0).description(), HasSubstr(std::to_string(epoch)));
  const std::optional<google::rpc::ErrorInfo> info = FindDetail<google::rpc::ErrorInfo>(rich);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason(), "STALE_EPOCH");
  EXPECT_EQ(info->metadata().at("current_epoch"), std::to_string(epoch));
  EXPECT_EQ(info->metadata().count("current_version"), 1u) << "the engine attaches it to a Step";

  // The table moves on (the window evicts); a read of the old epoch names the new one.
  ASSERT_TRUE(client_->Step(id, {}).ok());
  const uint64_t moved = client_->GetBlockTable(id)->epoch;
  ASSERT_NE(moved, epoch);
  v1::ReadKvRequest read;
  read.set_sequence_id(id);
  read.set_epoch(epoch);
  grpc::ClientContext read_context;
  auto reader = stub_->ReadKv(&read_context, read);
  v1::ReadKvResponse chunk;
  while (reader->Read(&chunk)) {
  }
  const grpc::Status read_status = reader->Finish();
  ASSERT_EQ(read_status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const std::optional<google::rpc::ErrorInfo> read_info =
      FindDetail<google::rpc::ErrorInfo>(RichStatus(read_status));
  ASSERT_TRUE(read_info.has_value());
  EXPECT_EQ(read_info->metadata().at("current_epoch"), std::to_string(moved));

  // Through the client: the message unchanged, the current epoch readable.
  const absl::Status via_client = client_->ReadKv(id, epoch).status();
  EXPECT_EQ(via_client.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(via_client.message(), read_status.error_message());
  EXPECT_EQ(client::CurrentEpoch(via_client), moved);
  EXPECT_TRUE(via_client.GetPayload("type.googleapis.com/google.rpc.PreconditionFailure"));
  EXPECT_EQ(client::CurrentEpoch(absl::NotFoundError("sequence_id: 9")), std::nullopt);
}

TEST_F(ErrorDetailsTest, ResourceExhaustedNamesTheLimitInAQuotaFailure) {
  // 64 sequences (--max-sequences of the fixture) fill every slot.
  absl::Status refused;
  for (int i = 0; i < 65 && refused.ok(); ++i) {
    refused = client_->CreateSequence(TestLayout(), {}).status();
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(Payload(refused, client::kLimitPayload), "--max-sequences");
  const auto typed = refused.GetPayload("type.googleapis.com/google.rpc.QuotaFailure");
  ASSERT_TRUE(typed.has_value());
  google::rpc::QuotaFailure quota;
  ASSERT_TRUE(quota.ParseFromString(std::string(*typed)));
  EXPECT_EQ(quota.violations(0).subject(), "--max-sequences");

  // A full pool names the flag that sizes it.
  StartDaemon(1 << 20);
  const uint64_t id = Create();
  const absl::Status full = AppendRange(id, 0, 16 * 40).status();
  ASSERT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(Payload(full, client::kLimitPayload), "--pool-bytes");
}

// ToGrpc on statuses the daemon cannot easily be made to return.
TEST(ToGrpcDetailsTest, PayloadsOfTheEngineComeFirst) {
  absl::Status stale = absl::FailedPreconditionError("epoch: the table moved to epoch 99");
  stale.SetPayload(engine::kCurrentEpochPayload, absl::Cord("42"));
  stale.SetPayload(engine::kCurrentVersionPayload, absl::Cord("7"));
  const google::rpc::Status rich = RichStatus(service::ToGrpc(stale, 5));
  const std::optional<google::rpc::ErrorInfo> info = FindDetail<google::rpc::ErrorInfo>(rich);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->metadata().at("current_epoch"), "42");
  EXPECT_EQ(info->metadata().at("current_version"), "7");
  const std::optional<google::rpc::PreconditionFailure> failure =
      FindDetail<google::rpc::PreconditionFailure>(rich);
  ASSERT_TRUE(failure.has_value());
  ASSERT_EQ(failure->violations_size(), 2);
  EXPECT_EQ(failure->violations(0).subject(), "sequence/5");
  EXPECT_EQ(failure->violations(1).type(), "VERSION");

  // An ABORTED read whose table changed meanwhile.
  const google::rpc::Status aborted = RichStatus(service::ToGrpc(
      absl::AbortedError("epoch: the block table changed from epoch 9 to 12 during the read; "
                         "read again"),
      3));
  EXPECT_EQ(FindDetail<google::rpc::ErrorInfo>(aborted)->metadata().at("current_epoch"), "12");

  // A precondition that is not about an epoch, and a code without details of its own.
  EXPECT_FALSE(FindDetail<google::rpc::PreconditionFailure>(
                   RichStatus(service::ToGrpc(
                       absl::FailedPreconditionError("sequence_id: an AppendStream is open"), 1)))
                   .has_value());
  EXPECT_EQ(RichStatus(service::ToGrpc(absl::NotFoundError("sequence_id: 7"))).details_size(), 0);
  // A NOT_FOUND for a named sequence says which, in a ResourceInfo.
  const std::optional<google::rpc::ResourceInfo> gone = FindDetail<google::rpc::ResourceInfo>(
      RichStatus(service::ToGrpc(absl::NotFoundError("sequence_id: 7 is not a sequence"), 7)));
  ASSERT_TRUE(gone.has_value());
  EXPECT_EQ(gone->resource_type(), "kvmem.v1.Sequence");
  EXPECT_EQ(gone->resource_name(), "sequence/7");
  EXPECT_TRUE(service::ToGrpc(absl::OkStatus()).error_details().empty());
}

TEST(ToGrpcDetailsTest, FieldPathsAndLimitsComeFromTheMessage) {
  EXPECT_EQ(service::FieldPathOf("layout.block_tokens: 0 tokens"), "layout.block_tokens");
  EXPECT_EQ(service::FieldPathOf("chunk 3: token_ids[2]: 70000 is outside"), "token_ids[2]");
  EXPECT_EQ(service::FieldPathOf("policy.params[window]: -1 is below 1"), "policy.params[window]");
  EXPECT_EQ(service::FieldPathOf("no field here"), "");
  EXPECT_EQ(service::FieldPathOf("two words: then a colon"), "");
  EXPECT_EQ(service::QuotaSubjectOf("AppendStream: --max-append-streams=2 streams are open"),
            "--max-append-streams");
  EXPECT_EQ(service::QuotaSubjectOf("sequences: all 4 slots are in use (--max-sequences)"),
            "--max-sequences");
  EXPECT_EQ(service::QuotaSubjectOf("pool: asked for 32 blocks"), "--pool-bytes");
  EXPECT_EQ(service::QuotaSubjectOf("Append: out of host memory"), "Append");

  // A long message is cut once, the same in grpc-message and in the details.
  const grpc::Status long_status =
      service::ToGrpc(absl::InvalidArgumentError("k: " + std::string(10000, 'x')));
  const google::rpc::Status rich = RichStatus(long_status);
  EXPECT_LE(long_status.error_message().size(), service::kMaxStatusMessageBytes + 64);
  EXPECT_EQ(FindDetail<google::rpc::BadRequest>(rich)->field_violations(0).field(), "k");
  EXPECT_LE(long_status.error_details().size(),
            service::kMaxStatusMessageBytes + 2 * kvmem::kMaxDetailTextBytes + 256);
}

}  // namespace
}  // namespace kvmem
