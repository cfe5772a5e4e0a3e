// What parsing a request allocates is counted and reserved before it is parsed
// (--parse-memory-bytes): a request of tiny records past it is refused without being parsed,
// and its reservation comes back; a request that does not parse is INVALID_ARGUMENT naming
// its type; an AppendStream whose chunk is refused applies nothing (before, a chunk that did
// not parse ended the stream like its end, and the chunks before it were committed).
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/service/kv_cache_service.h"
#include "server/transport/parse_cost.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

class ParseBudgetTest : public DaemonTest {
 protected:
  void SetUp() override {
    parse_memory_bytes_ = 32ull << 20;  // two 12 MiB messages (8 MiB appends) and a little
    DaemonTest::SetUp();
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                         grpc::InsecureChannelCredentials(), args);
    stub_ = v1::KvCache::NewStub(channel_);
  }
  // A unary call of `method` with `bytes` as its request, whatever they hold.
  grpc::Status RawUnary(const std::string& method, const std::string& bytes) {
    grpc::ClientContext context;
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(),
        grpc::internal::RpcMethod(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC), &context,
        request, &response);
  }
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

TEST_F(ParseBudgetTest, TinyRecordsPastTheBudgetAreRefusedBeforeTheyAreParsed) {
  // 4 MiB on the wire (under the 12 MiB message limit), about 100 times that once parsed.
  v1::StepBatchRequest batch;
  for (int i = 0; i < (2 << 20); ++i) batch.add_entries();
  ASSERT_EQ(batch.ByteSizeLong(), 4u << 20);
  grpc::ClientContext context;
  v1::StepBatchResponse response;
  const grpc::Status refused = stub_->StepBatch(&context, batch, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("--parse-memory-bytes=33554432"));
  EXPECT_THAT(refused.error_message(), HasSubstr("kvmem.v1.StepBatchRequest"));
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
  // A batch of a thousand entries is parsed and answered (each entry's own error).
  v1::StepBatchRequest small;
  for (int i = 0; i < 1000; ++i) small.add_entries()->set_sequence_id(999999 + i);
  grpc::ClientContext again;
  const grpc::Status answered = stub_->StepBatch(&again, small, &response);
  EXPECT_TRUE(answered.ok()) << answered.error_message();
  EXPECT_EQ(response.results_size(), 1000);
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
}

TEST_F(ParseBudgetTest, ARequestThatDoesNotParseIsInvalidArgumentNamingItsType) {
  const grpc::Status status = RawUnary("/kvmem.v1.KvCache/Append", std::string("\xff\xff\xff", 3));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("does not parse as a kvmem.v1.AppendRequest"));
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
  // Every method of the service is registered, each through the counted parse.
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::KvCache::service_full_name());
  ASSERT_NE(service, nullptr);
  std::vector<std::string> expected;
  for (int i = 0; i < service->method_count(); ++i) {
    expected.push_back(absl::StrCat("/", service->full_name(), "/", service->method(i)->name()));
  }
  EXPECT_THAT(server_->service().method_names(), ::testing::UnorderedElementsAreArray(expected));
}

TEST_F(ParseBudgetTest, AnAppendStreamWhoseChunkDoesNotParseAppendsNothing) {
  const uint64_t id = Create();
  grpc::ClientContext context;
  grpc::ByteBuffer response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel_.get(),
          grpc::internal::RpcMethod("/kvmem.v1.KvCache/AppendStream",
                                    grpc::internal::RpcMethod::CLIENT_STREAMING),
          &context, &response));
  v1::AppendStreamRequest first;
  first.set_sequence_id(id);
  for (int64_t p : testing::Range(0, 8)) first.add_positions(p);
  first.set_k(testing::Payload16(kL * kH, 0, 8, kD, 0));
  first.set_v(testing::Payload16(kL * kH, 0, 8, kD, 1));
  const std::string bytes = first.SerializeAsString();
  grpc::Slice good(bytes), bad(std::string("\xff\xff\xff", 3));
  ASSERT_TRUE(writer->Write(grpc::ByteBuffer(&good, 1)));
  writer->Write(grpc::ByteBuffer(&bad, 1));
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("chunk 1"));
  auto stats = client_->GetStats(true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tokens_appended, 0u);
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
}

}  // namespace
}  // namespace kvmem
