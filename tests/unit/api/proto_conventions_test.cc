// The conventions of the public API (proto/kvmem/v1/kvmem.proto), checked on the descriptor
// set protoc writes at build time (with comments: --include_source_info), so that they stay
// true as the API grows:
// - every RPC has its own XxxRequest / XxxResponse, named after it;
// - "Kv" is a word: no "KV" in a service, RPC, message or enum name;
// - durations are google.protobuf.Duration: no field named *_seconds / *_ms, every lease is one;
// - a field with a default has presence, and no field comment calls 0 a default ("0 =",
//   "0 means"): absent is the default, an explicit 0 is a value;
// - the pool export is a oneof; Stats pages its sequences.
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"

#ifndef KVMEM_API_DESCRIPTOR_SET
#error "KVMEM_API_DESCRIPTOR_SET must name the descriptor set of kvmem.proto"
#endif

namespace kvmem {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using google::protobuf::ServiceDescriptor;

constexpr char kApiFile[] = "kvmem/v1/kvmem.proto";

class ProtoConventionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in(KVMEM_API_DESCRIPTOR_SET, std::ios::binary);
    ASSERT_TRUE(in) << "cannot open " << KVMEM_API_DESCRIPTOR_SET;
    std::stringstream bytes;
    bytes << in.rdbuf();
    google::protobuf::FileDescriptorSet set;
    ASSERT_TRUE(set.ParseFromString(bytes.str()));
    // --include_imports writes every file after the files it imports.
    for (const google::protobuf::FileDescriptorProto& proto : set.file()) {
      ASSERT_NE(pool_.BuildFile(proto), nullptr) << proto.name();
    }
    file_ = pool_.FindFileByName(kApiFile);
    ASSERT_NE(file_, nullptr);
  }

  // Every message of the API file, nested ones included.
  std::vector<const Descriptor*> Messages() const {
    std::vector<const Descriptor*> out;
    for (int i = 0; i < file_->message_type_count(); ++i) out.push_back(file_->message_type(i));
    for (size_t i = 0; i < out.size(); ++i) {
      for (int j = 0; j < out[i]->nested_type_count(); ++j) out.push_back(out[i]->nested_type(j));
    }
    return out;
  }

  std::vector<const FieldDescriptor*> Fields() const {
    std::vector<const FieldDescriptor*> out;
    for (const Descriptor* m : Messages()) {
      for (int i = 0; i < m->field_count(); ++i) out.push_back(m->field(i));
    }
    return out;
  }

  const FieldDescriptor* Field(const std::string& message, const std::string& field) const {
    const Descriptor* m = pool_.FindMessageTypeByName("kvmem.v1." + message);
    EXPECT_NE(m, nullptr) << message;
    const FieldDescriptor* f = m == nullptr ? nullptr : m->FindFieldByName(field);
    EXPECT_NE(f, nullptr) << message << "." << field;
    return f;
  }

  google::protobuf::DescriptorPool pool_;
  const FileDescriptor* file_ = nullptr;
};

TEST_F(ProtoConventionsTest, EveryRpcHasItsOwnRequestAndResponse) {
  ASSERT_EQ(file_->service_count(), 1);
  const ServiceDescriptor* service = file_->service(0);
  EXPECT_EQ(service->full_name(), "kvmem.v1.KvCache");
  ASSERT_GT(service->method_count(), 10);
  std::set<std::string> used;
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = service->method(i);
    EXPECT_EQ(m->input_type()->name(), m->name() + "Request") << m->name();
    EXPECT_EQ(m->output_type()->name(), m->name() + "Response") << m->name();
    EXPECT_TRUE(used.insert(m->input_type()->full_name()).second)
        << m->input_type()->full_name() << " is the request of two RPCs";
    EXPECT_TRUE(used.insert(m->output_type()->full_name()).second)
        << m->output_type()->full_name() << " is used by two RPCs";
  }
}

TEST_F(ProtoConventionsTest, KvIsAWordInEveryName) {
  std::vector<std::string> names;
  for (int i = 0; i < file_->service_count(); ++i) {
    names.push_back(file_->service(i)->name());
    for (int j = 0; j < file_->service(i)->method_count(); ++j) {
      names.push_back(file_->service(i)->method(j)->name());
    }
  }
  for (const Descriptor* m : Messages()) {
    names.push_back(m->name());
    for (int i = 0; i < m->enum_type_count(); ++i) names.push_back(m->enum_type(i)->name());
  }
  for (int i = 0; i < file_->enum_type_count(); ++i) names.push_back(file_->enum_type(i)->name());
  ASSERT_GT(names.size(), 40u);
  for (const std::string& name : names) EXPECT_FALSE(absl::StrContains(name, "KV")) << name;
}

TEST_F(ProtoConventionsTest, DurationsAreDurations) {
  for (const FieldDescriptor* f : Fields()) {
    EXPECT_FALSE(absl::EndsWith(f->name(), "_seconds")) << f->full_name();
    EXPECT_FALSE(absl::EndsWith(f->name(), "_ms")) << f->full_name();
    EXPECT_FALSE(absl::EndsWith(f->name(), "_millis")) << f->full_name();
    // A lease ("lease", "default_lease", "lease_remaining"; not the counter leases_expired).
    if (f->name() == "lease" || absl::EndsWith(f->name(), "_lease") ||
        absl::StartsWith(f->name(), "lease_")) {
      ASSERT_NE(f->message_type(), nullptr) << f->full_name();
      EXPECT_EQ(f->message_type()->full_name(), "google.protobuf.Duration") << f->full_name();
    }
  }
  for (const auto& [message, field] :
       std::vector<std::pair<std::string, std::string>>{{"CreateSequenceRequest", "lease"},
                                                        {"CreateSequenceResponse", "lease"},
                                                        {"ForkRequest", "lease"},
                                                        {"ForkResponse", "lease"},
                                                        {"GetInfoResponse", "default_lease"},
                                                        {"GetInfoResponse", "max_lease"},
                                                        {"SequenceStats", "lease_remaining"}}) {
    const FieldDescriptor* f = Field(message, field);
    ASSERT_NE(f, nullptr);
    ASSERT_NE(f->message_type(), nullptr) << f->full_name();
    EXPECT_EQ(f->message_type()->full_name(), "google.protobuf.Duration") << f->full_name();
  }
}

TEST_F(ProtoConventionsTest, DefaultsAreAbsenceNotZero) {
  int commented = 0;
  for (const FieldDescriptor* f : Fields()) {
    google::protobuf::SourceLocation where;
    if (!f->GetSourceLocation(&where)) continue;
    std::string text = where.leading_comments + " " + where.trailing_comments;
    for (const std::string& detached : where.leading_detached_comments) text += " " + detached;
    if (!absl::StripAsciiWhitespace(text).empty()) ++commented;
    const std::string lower = absl::AsciiStrToLower(text);
    EXPECT_FALSE(absl::StrContains(lower, "0 =")) << f->full_name() << ": " << text;
    EXPECT_FALSE(absl::StrContains(lower, "0 means")) << f->full_name() << ": " << text;
  }
  // The descriptor set carries the comments (else the check above sees nothing).
  EXPECT_GT(commented, 60);

  // Fields whose absence means a default track presence.
  for (const auto& [message, field] : std::vector<std::pair<std::string, std::string>>{
           {"Layout", "block_tokens"},
           {"PolicySpec", "name"},
           {"PolicySpec", "quantization_recent_tokens"},
           {"CreateSequenceRequest", "policy"},
           {"CreateSequenceRequest", "lease"},
           {"ForkRequest", "lease"},
           {"ReadKvRequest", "epoch"},
           {"ReadKvRequest", "layers"},
           {"CompressRequest", "target_tokens"},
           {"StepResponse", "budget_tokens"},
           {"StatsRequest", "page_size"},
           {"SequenceStats", "parent_id"}}) {
    const FieldDescriptor* f = Field(message, field);
    ASSERT_NE(f, nullptr);
    EXPECT_TRUE(f->has_presence()) << f->full_name();
  }
}

TEST_F(ProtoConventionsTest, PoolExportIsAOneofAndStatsPages) {
  const FieldDescriptor* shm = Field("GetInfoResponse", "shared_memory");
  const FieldDescriptor* ipc = Field("GetInfoResponse", "cuda_ipc");
  ASSERT_TRUE(shm != nullptr && ipc != nullptr);
  ASSERT_NE(shm->real_containing_oneof(), nullptr);
  EXPECT_EQ(shm->real_containing_oneof(), ipc->real_containing_oneof());
  EXPECT_EQ(shm->real_containing_oneof()->name(), "pool_export");

  const FieldDescriptor* token = Field("StatsRequest", "page_token");
  const FieldDescriptor* next = Field("StatsResponse", "next_page_token");
  ASSERT_TRUE(token != nullptr && next != nullptr);
  EXPECT_EQ(token->type(), FieldDescriptor::TYPE_STRING);
  EXPECT_EQ(next->type(), FieldDescriptor::TYPE_STRING);
}

TEST_F(ProtoConventionsTest, PerIdResultsAreGoogleRpcStatuses) {
  const FieldDescriptor* status = Field("KeepAliveResult", "status");
  ASSERT_NE(status, nullptr);
  ASSERT_NE(status->message_type(), nullptr);
  EXPECT_EQ(status->message_type()->full_name(), "google.rpc.Status");
}

}  // namespace
}  // namespace kvmem
