// Identity from the channel: kvmemd with a token file (--auth-tokens). A call without a
// known token is refused whatever it asks; a tenant sees only its own sequences (another
// tenant's id answers as an unknown one), its own prefixes and its own request ids; its
// quota holds whatever salt it sends; the step channel serves the tenant that opened it.
#include "server/service/auth.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "kvmem/attach.h"
#include "kvmem/client.h"
#include "kvmem/v1/attach.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "kvmem/v1/step_channel.h"
#include "server/service/server.h"
#include "tests/testing/payload.h"
#include "tests/testing/tls_certificates.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kL = 2, kH = 2, kD = 64;
constexpr char kAlice[] = "alice-token-0123456789";
constexpr char kBob[] = "bob-token-0123456789ab";
constexpr char kAdmin[] = "admin-token-0123456789";

client::Layout TestLayout() { return client::Layout{kL, kH, kD, client::DType::kF16, 16, 49152}; }

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Per process: ctest runs the cases of this file side by side.
    tokens_ = absl::StrCat(::testing::TempDir(), "/kvmem_auth_test_tokens.", getpid());
    WriteTokens(absl::StrCat("# tenants\nalice ", kAlice, "\nbob ", kBob, "  # bob's\nops ", kAdmin,
                             " admin\n", extra_tokens_));
    service::ServerConfig config;
    config.listen = unix_path_.empty() ? "127.0.0.1:0" : "unix:" + unix_path_;
    config.engine.pool_bytes = 16ull << 20;
    config.engine.max_sequences = 64;
    config.engine.tenant_quota_bytes = 64 * 1024;
    config.reaper_period = absl::Hours(1);
    config.auth_tokens = tokens_;
    config.limits.tenant_max_calls = tenant_max_calls_;
    if (parse_memory_bytes_ != 0) {
      config.parse_memory_bytes = parse_memory_bytes_;
      config.engine.max_append_bytes = 8ull << 20;  // so that two Appends fit the budget
    }
    auto server = service::Server::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = Connect(kAlice);
    bob_ = Connect(kBob);
    admin_ = Connect(kAdmin);
  }
  void TearDown() override { std::remove(tokens_.c_str()); }

  void WriteTokens(const std::string& text) { std::ofstream(tokens_) << text; }

  std::unique_ptr<client::Client> Connect(const std::string& token) {
    client::ClientOptions options;
    options.deadline = absl::Seconds(20);
    options.max_attempts = 1;
    options.auth_token = token;
    return *client::Client::Connect(
        unix_path_.empty() ? "127.0.0.1:" + std::to_string(server_->port()) : "unix:" + unix_path_,
        options);
  }

  // A sequence of `who` with n tokens appended (positions 0..n-1).
  uint64_t Filled(client::Client& who, uint32_t n, const std::string& salt = "") {
    client::Prompt prompt;
    prompt.cache_salt = salt;
    auto seq = who.CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
    EXPECT_TRUE(seq.ok()) << seq.status();
    if (!seq.ok()) return 0;
    const absl::Status appended = Append(who, seq->id, 0, n).status();
    EXPECT_TRUE(appended.ok()) << appended;
    return seq->id;
  }
  absl::StatusOr<client::AppendResult> Append(client::Client& who, uint64_t id, int64_t first,
                                              uint32_t n) {
    positions_ = testing::Range(first, n);
    k_ = testing::Payload16(kL * kH, first, n, kD, 0);
    v_ = testing::Payload16(kL * kH, first, n, kD, 1);
    return who.Append(id, {positions_, {}, k_, v_, {}, {}});
  }
  // Everything a reader of `id` can see, read as its owner.
  std::string Content(client::Client& owner, uint64_t id) {
    auto streams = owner.ReadKv(id);
    EXPECT_TRUE(streams.ok()) << streams.status();
    std::string all;
    if (!streams.ok()) return all;
    for (const client::StreamKv& kv : *streams) {
      absl::StrAppend(&all, kv.layer, "/", kv.kv_head, ":", kv.positions.size(), ":", kv.k, kv.v);
    }
    return all;
  }

  uint32_t tenant_max_calls_ = 0;
  uint64_t parse_memory_bytes_ = 0;  // kvmemd --parse-memory-bytes (0: the default)
  std::string unix_path_;            // listen there instead of on loopback
  std::string extra_tokens_;         // lines added to the token file
  std::string tokens_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<client::Client> alice_, bob_, admin_;
  std::vector<int64_t> positions_;
  std::string k_, v_;
};

TEST_F(AuthTest, ACallWithoutAKnownTokenIsRefusedAndChangesNothing) {
  const uint64_t id = Filled(*alice_, 16);
  for (const std::string& token : {std::string(), std::string("not-a-token-at-all-000"),
                                   absl::StrCat(kAlice, "x"), std::string(kAlice).substr(1)}) {
    SCOPED_TRACE(token);
    std::unique_ptr<client::Client> stranger = Connect(token);
    std::vector<absl::Status> answers = {
        stranger->GetInfo().status(),
        stranger->CreateSequence(TestLayout(), {"full", {}}).status(),
        Append(*stranger, id, 16, 1).status(),
        stranger->ReadKv(id).status(),
        stranger->GetBlockTable(id).status(),
        stranger->Fork(id).status(),
        stranger->Publish(id).status(),
        stranger->KeepAlive({id}).status(),
        stranger->GetStats(true).status(),
        stranger->Release(id).status(),
        stranger->OpenStepChannel(),
    };
    for (size_t i = 0; i < answers.size(); ++i) {
      EXPECT_TRUE(absl::IsUnauthenticated(answers[i])) << i << ": " << answers[i];
      EXPECT_THAT(std::string(answers[i].message()), HasSubstr("bearer token")) << i;
    }
  }
  auto stats = admin_->GetStats(true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences_created, 1u);
  ASSERT_EQ(stats->sequences.size(), 1u);
  EXPECT_EQ(stats->sequences[0].appended_tokens, 16u);
}

TEST_F(AuthTest, AnotherTenantsSequenceAnswersAsAnUnknownOne) {
  const uint64_t id = Filled(*alice_, 40);
  const std::string before = Content(*alice_, id);
  const uint64_t unknown = id + 1000;
  // Bob's every call naming Alice's sequence, and the same call naming an id never created:
  // the answers must be the same but for the id.
  auto calls = [&](uint64_t target) {
    std::vector<absl::Status> out;
    out.push_back(Append(*bob_, target, 40, 1).status());
    std::vector<int64_t> positions = testing::Range(40, 2);
    std::string k = testing::Payload16(kL * kH, 40, 2, kD, 0);
    std::string v = testing::Payload16(kL * kH, 40, 2, kD, 1);
    client::AppendArgs chunk{positions, {}, k, v, {}, {}};
    out.push_back(bob_->AppendStream(target, absl::MakeConstSpan(&chunk, 1)).status());
    out.push_back(bob_->Step(target, client::StepArgs{}).status());
    out.push_back(bob_->Compress(target, client::CompressArgs{}).status());
    out.push_back(bob_->ReadKv(target).status());
    out.push_back(bob_->GetBlockTable(target).status());
    out.push_back(bob_->Fork(target).status());
    out.push_back(bob_->Publish(target).status());
    auto kept = bob_->KeepAlive({target});
    out.push_back(kept.ok() ? (*kept)[0] : kept.status());
    client::BatchEntry entry;
    entry.sequence_id = target;
    entry.step = client::StepArgs{};
    auto batch = bob_->StepBatch(absl::MakeConstSpan(&entry, 1));
    out.push_back(batch.ok() ? (*batch)[0].status : batch.status());
    out.push_back(bob_->Release(target).status());
    return out;
  };
  const std::vector<absl::Status> foreign = calls(id), never = calls(unknown);
  ASSERT_EQ(foreign.size(), never.size());
  for (size_t i = 0; i < foreign.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(absl::IsNotFound(foreign[i])) << foreign[i];
    EXPECT_EQ(foreign[i].code(), never[i].code());
    EXPECT_EQ(absl::StrReplaceAll(foreign[i].message(), {{std::to_string(id), "N"}}),
              absl::StrReplaceAll(never[i].message(), {{std::to_string(unknown), "N"}}));
  }
  // Nothing of Alice's changed, and Bob's Stats do not list it; the admin's do.
  EXPECT_EQ(Content(*alice_, id), before);
  auto bobs = bob_->GetStats(true);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->sequences.empty());
  auto all = admin_->GetStats(true);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->sequences.size(), 1u);
  EXPECT_EQ(all->sequences[0].sequence_id, id);
  // The admin may name it.
  EXPECT_TRUE(admin_->GetBlockTable(id).ok());
}

TEST_F(AuthTest, ARetryOfAReleaseThatAppliedGetsItsFirstAnswer) {
  // Before, the ownership check ran ahead of the retry cache: the repeat found the sequence
  // gone and answered NOT_FOUND for a call that had succeeded.
  const uint64_t id = Filled(*alice_, 16);
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  v1::ReleaseRequest q;
  q.set_sequence_id(id);
  q.set_request_id("release-once");
  std::vector<v1::ReleaseResponse> answers(2);
  for (v1::ReleaseResponse& r : answers) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice));
    const grpc::Status status = stub->Release(&context, q, &r);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(answers[1].freed_blocks(), answers[0].freed_blocks());
  EXPECT_GT(answers[0].freed_blocks(), 0u);
  // Bob's call with the same id is his own, and the sequence is not his.
  grpc::ClientContext bobs;
  bobs.AddMetadata("authorization", absl::StrCat("Bearer ", kBob));
  v1::ReleaseResponse r;
  EXPECT_EQ(stub->Release(&bobs, q, &r).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(AuthTest, OnlyAnAdminIsToldTheSharedMemoryNames) {
  // Mapping the pool reads every tenant's K/V.
  auto alices = alice_->GetInfo();
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_EQ(alices->shm_bytes, 0u);
  EXPECT_EQ(alices->epoch_slots, 0u);
  EXPECT_TRUE(alices->attach.ticket.empty());
  auto admins = admin_->GetInfo();
  ASSERT_TRUE(admins.ok()) << admins.status();
  EXPECT_NE(admins->shm_bytes, 0u);
  EXPECT_NE(admins->epoch_slots, 0u);
  EXPECT_FALSE(admins->attach.ticket.empty());
}

// A second tenant cannot obtain the first's attach descriptors: a step channel's ticket goes
// to its opener alone and maps that channel only; the pool's goes to an admin; a call without
// a known token gets no ticket; a ticket that is not one gets nothing.
TEST_F(AuthTest, ASecondTenantCannotObtainTheFirstsAttachDescriptors) {
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  struct Opened {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::OpenStepChannelResponse>> reader;
    v1::OpenStepChannelResponse response;
    bool ok = false;
  };
  auto open = [&](const std::string& token, Opened* o) {
    if (!token.empty()) o->context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::OpenStepChannelRequest q;
    q.set_capacity_bytes(1ull << 20);
    o->reader = stub->OpenStepChannel(&o->context, q);
    o->ok = o->reader->Read(&o->response);
  };
  // The nonce in the channel segment a ticket maps.
  auto nonce_of = [](const v1::AttachTicket& t, uint64_t bytes) -> std::string {
    auto mapped =
        client::MapSegment({t.socket(), t.ticket()}, v1::attach::kChannel, bytes, true, "channel");
    if (!mapped.ok()) return mapped.status().ToString();
    const auto* header = reinterpret_cast<const v1::step_channel::Header*>(*mapped);
    std::string nonce(reinterpret_cast<const char*>(header->nonce), v1::step_channel::kNonceBytes);
    munmap(*mapped, bytes);
    return nonce;
  };
  Opened alices, bobs, strangers;
  open(kAlice, &alices);
  open(kBob, &bobs);
  open("", &strangers);
  ASSERT_TRUE(alices.ok && bobs.ok);
  EXPECT_FALSE(strangers.ok);
  EXPECT_EQ(strangers.reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(nonce_of(alices.response.attach(), alices.response.segment_bytes()),
            alices.response.nonce());
  EXPECT_EQ(nonce_of(bobs.response.attach(), bobs.response.segment_bytes()), bobs.response.nonce());
  EXPECT_NE(alices.response.nonce(), bobs.response.nonce());
  // Bob learns no pool ticket; a ticket of his own bytes, or Alice's with a bit flipped, is
  // refused.
  auto bobs_info = bob_->GetInfo();
  ASSERT_TRUE(bobs_info.ok());
  EXPECT_TRUE(bobs_info->attach.ticket.empty());
  std::string forged = alices.response.attach().ticket();
  forged.back() = static_cast<char>(forged.back() ^ 1);
  EXPECT_EQ(client::ReceiveSegments({alices.response.attach().socket(), forged}, "forged")
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(
      client::ReceiveSegments({alices.response.attach().socket(), std::string(32, '\0')}, "zeros")
          .status()
          .code(),
      absl::StatusCode::kUnauthenticated);
  alices.context.TryCancel();
  bobs.context.TryCancel();
  alices.reader->Finish();
  bobs.reader->Finish();
}

TEST_F(AuthTest, TheStepChannelServesTheTenantThatOpenedIt) {
  const uint64_t alices = Filled(*alice_, 16);
  const uint64_t bobs = Filled(*bob_, 16);
  ASSERT_TRUE(bob_->OpenStepChannel().ok());
  std::vector<client::BatchEntry> entries(2);
  entries[0].sequence_id = bobs;
  entries[0].step = client::StepArgs{};
  entries[1].sequence_id = alices;
  entries[1].step = client::StepArgs{};
  auto results = bob_->StepBatch(entries);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_GT(bob_->step_channel_batches(), 0u);
  EXPECT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_TRUE(absl::IsNotFound((*results)[1].status)) << (*results)[1].status;
}

class ParseAfterAuthTest : public AuthTest {
 protected:
  void SetUp() override {
    parse_memory_bytes_ = 32ull << 20;  // two 12 MiB messages and a little
    tenant_max_calls_ = 2;
    AuthTest::SetUp();
  }
  // A call of `method` with `bytes` as its request, whatever they hold, with `token` (none
  // when empty).
  grpc::Status Raw(const std::string& method, grpc::internal::RpcMethod::RpcType type,
                   const std::string& bytes, const std::string& token) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                             grpc::InsecureChannelCredentials(), args);
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    const grpc::internal::RpcMethod rpc(method.c_str(), type);
    if (type == grpc::internal::RpcMethod::NORMAL_RPC) {
      return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
          channel.get(), rpc, &context, request, &response);
    }
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), rpc, &context,
                                                                      request));
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  }
};

// kvmemd parses a request only once its caller authenticates: before, gRPC's parse ran first,
// so a caller without a token could make kvmemd parse anything the message limit lets through
// and take the whole parse budget from the tenants (a batch of tiny records came back
// RESOURCE_EXHAUSTED, garbage INVALID_ARGUMENT, where both are UNAUTHENTICATED now).
TEST_F(ParseAfterAuthTest, ACallerWithoutATokenCostsNoParse) {
  v1::StepBatchRequest batch;  // 4 MiB on the wire, about 100 times that once parsed
  for (int i = 0; i < (2 << 20); ++i) batch.add_entries();
  const std::string tiny = batch.SerializeAsString();
  const std::string garbage("\xff\xff\xff", 3);
  using Type = grpc::internal::RpcMethod::RpcType;
  for (const std::string& token : {std::string(), std::string("not-a-token-at-all-000")}) {
    SCOPED_TRACE(token);
    for (const grpc::Status& status :
         {Raw("/kvmem.v1.KvCache/StepBatch", Type::NORMAL_RPC, tiny, token),
          Raw("/kvmem.v1.KvCache/Append", Type::NORMAL_RPC, garbage, token),
          Raw("/kvmem.v1.KvCache/ReadKv", Type::SERVER_STREAMING, garbage, token),
          Raw("/kvmem.v1.KvCache/OpenStepChannel", Type::SERVER_STREAMING, tiny, token)}) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
    }
  }
  // A tenant's requests are counted and parsed as before.
  const grpc::Status counted = Raw("/kvmem.v1.KvCache/StepBatch", Type::NORMAL_RPC, tiny, kAlice);
  EXPECT_EQ(counted.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << counted.error_message();
  EXPECT_THAT(counted.error_message(), HasSubstr("--parse-memory-bytes"));
  const grpc::Status garbled =
      Raw("/kvmem.v1.KvCache/ReadKv", Type::SERVER_STREAMING, garbage, kBob);
  EXPECT_EQ(garbled.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << garbled.error_message();
  EXPECT_THAT(garbled.error_message(), HasSubstr("does not parse as a kvmem.v1.ReadKvRequest"));
  EXPECT_TRUE(alice_->GetInfo().ok());
}

// A tenant at its limit of calls in flight has no request parsed either: the parse holds a
// place among its calls (before, its requests were parsed first, however many it had open).
TEST_F(ParseAfterAuthTest, ATenantAtItsCallLimitCostsNoParse) {
  std::unique_ptr<client::Client> alice2 = Connect(kAlice);
  ASSERT_TRUE(alice_->OpenStepChannel().ok());
  ASSERT_TRUE(alice2->OpenStepChannel().ok());  // both of her places, for the channels' life
  v1::StepBatchRequest batch;
  for (int i = 0; i < (2 << 20); ++i) batch.add_entries();
  const grpc::Status refused =
      Raw("/kvmem.v1.KvCache/StepBatch", grpc::internal::RpcMethod::NORMAL_RPC,
          batch.SerializeAsString(), kAlice);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("--tenant-max-calls"));
  EXPECT_TRUE(bob_->GetInfo().ok());
}

class TenantCallsTest : public AuthTest {
 protected:
  void SetUp() override {
    tenant_max_calls_ = 2;
    AuthTest::SetUp();
  }
};

// An open step channel holds its call for its life: two of alice's fill her limit, and her
// next call is refused, naming her and the flag, while bob's go on; closing one lets her in.
TEST_F(TenantCallsTest, ATenantsCallsInFlightAreBoundedAndOthersGoOn) {
  std::unique_ptr<client::Client> alice2 = Connect(kAlice);
  ASSERT_TRUE(alice_->OpenStepChannel().ok());
  EXPECT_TRUE(alice2->GetInfo().ok());  // two in flight for the call's length
  ASSERT_TRUE(alice2->OpenStepChannel().ok());
  const absl::Status refused = Connect(kAlice)->GetInfo().status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("tenant 'alice' has 2 calls in flight"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--tenant-max-calls"));
  EXPECT_TRUE(bob_->GetInfo().ok());
  EXPECT_TRUE(admin_->GetInfo().ok());
  alice2->CloseStepChannel();
  absl::Status again = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !again.ok(); ++i) {  // the channel's call ends after its client
    again = Connect(kAlice)->GetInfo().status();
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(again.ok()) << again;
}

// A tenant's Stats are its own: its sequences and their totals; nothing summed over other
// tenants or kept since the start (before, every tenant saw the daemon's totals).
TEST_F(AuthTest, StatsShowATenantOnlyItsOwn) {
  Filled(*alice_, 16);
  Filled(*alice_, 32);
  Filled(*bob_, 48);
  auto alices = alice_->GetStats(true);
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_EQ(alices->sequences.size(), 2u);
  EXPECT_EQ(alices->sequences_active, 2u);
  EXPECT_EQ(alices->tokens_appended, 48u);
  EXPECT_EQ(alices->full_cache_bytes, 48u * 2 * kL * kH * kD * 2);
  uint64_t held = 0, blocks = 0;
  for (const client::SequenceStats& seq : alices->sequences) {
    held += seq.pool_bytes_held;
    blocks += seq.blocks;
  }
  EXPECT_GT(held, 0u);
  EXPECT_EQ(alices->pool_used_bytes, held);  // hers alone: bob's 48 tokens are not in it
  EXPECT_EQ(alices->blocks_used, blocks);
  EXPECT_GT(alices->pool_bytes, alices->pool_used_bytes);
  EXPECT_EQ(alices->sequences_created, 0u);
  EXPECT_EQ(alices->pages_used, 0u);
  EXPECT_EQ(alices->host_metadata_bytes, 0u);
  EXPECT_EQ(alices->prefix_queries, 0u);
  auto all = admin_->GetStats(true);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->sequences_active, 3u);
  EXPECT_EQ(all->tokens_appended, 96u);
  EXPECT_EQ(all->sequences_created, 3u);
}

// A reload that revokes a token ends what it opened: the step channel's next batch applies
// nothing (before, the channel kept serving the revoked tenant), and the client's repeat
// over gRPC is refused as well.
TEST_F(AuthTest, ARevokedTokenEndsTheStepChannelItOpened) {
  const uint64_t id = Filled(*alice_, 16);
  ASSERT_TRUE(alice_->OpenStepChannel().ok());
  auto append_one = [&](int64_t position) {
    positions_ = testing::Range(position, 1);
    k_ = testing::Payload16(kL * kH, position, 1, kD, 0);
    v_ = testing::Payload16(kL * kH, position, 1, kD, 1);
    std::vector<client::BatchEntry> entries(1);
    entries[0].sequence_id = id;
    entries[0].append = client::AppendArgs{positions_, {}, k_, v_, {}, {}};
    return alice_->StepBatch(entries);
  };
  auto served = append_one(16);
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_TRUE((*served)[0].status.ok()) << (*served)[0].status;
  EXPECT_EQ(alice_->step_channel_batches(), 1u);
  // A reload that keeps alice's token keeps her channel.
  WriteTokens(absl::StrCat("alice ", kAlice, "\nbob ", kBob, "\nops ", kAdmin, " admin\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  auto kept = append_one(17);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_TRUE((*kept)[0].status.ok()) << (*kept)[0].status;
  EXPECT_EQ(alice_->step_channel_batches(), 2u);
  WriteTokens(absl::StrCat("bob ", kBob, "\nops ", kAdmin, " admin\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  auto refused = append_one(18);
  EXPECT_TRUE(absl::IsUnauthenticated(refused.status())) << refused.status();
  auto stats = admin_->GetStats(true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->sequences.size(), 1u);
  EXPECT_EQ(stats->sequences[0].appended_tokens, 18u);  // 16, then the two the channel served
}

// The same for an AppendStream: a token revoked while the stream is open commits nothing.
TEST_F(AuthTest, ARevokedTokenCommitsNoAppendStream) {
  const uint64_t id = Filled(*alice_, 16);
  auto stub = v1::KvCache::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice));
  v1::AppendStreamResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
      stub->AppendStream(&context, &response);
  v1::AppendStreamRequest chunk;
  chunk.set_sequence_id(id);
  chunk.add_positions(16);
  chunk.set_k(testing::Payload16(kL * kH, 16, 1, kD, 0));
  chunk.set_v(testing::Payload16(kL * kH, 16, 1, kD, 1));
  ASSERT_TRUE(writer->Write(chunk));
  WriteTokens(absl::StrCat("bob ", kBob, "\nops ", kAdmin, " admin\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
  auto stats = admin_->GetStats(true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->sequences.size(), 1u);
  EXPECT_EQ(stats->sequences[0].appended_tokens, 16u);
}

TEST_F(AuthTest, PrefixesAreTheTenantsOwnWhateverTheSalt) {
  client::Prompt prompt;
  for (int32_t t = 0; t < 48; ++t) prompt.token_ids.push_back(1000 + t);
  prompt.cache_salt = "shared-salt";
  prompt.model = "m";
  prompt.auto_publish = true;
  auto alices = alice_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
  ASSERT_TRUE(alices.ok()) << alices.status();
  positions_ = testing::Range(0, 48);
  k_ = testing::Payload16(kL * kH, 0, 48, kD, 0);
  v_ = testing::Payload16(kL * kH, 0, 48, kD, 1);
  ASSERT_TRUE(alice_->Append(alices->id, {positions_, prompt.token_ids, k_, v_, {}, {}}).ok());
  auto alice_sees = alice_->Lookup(TestLayout(), prompt);
  ASSERT_TRUE(alice_sees.ok()) << alice_sees.status();
  EXPECT_EQ(*alice_sees, 47u / 16 * 16);  // whole blocks, the last token left to the worker
  auto bob_sees = bob_->Lookup(TestLayout(), prompt);
  ASSERT_TRUE(bob_sees.ok()) << bob_sees.status();
  EXPECT_EQ(*bob_sees, 0u);
  auto bobs = bob_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(bobs->reused_prefix_tokens, 0u);
}

TEST_F(AuthTest, ATenantsQuotaHoldsWhateverSaltItSends) {
  // 64 KiB: 64 tokens of this layout (2 x 2 streams of 64 f16 K and V rows: 1 KiB a token).
  uint64_t appended = 0;
  absl::Status refused;
  for (int i = 0; i < 8 && refused.ok(); ++i) {
    client::Prompt prompt;
    prompt.cache_salt = absl::StrCat("salt-", i);
    auto seq = alice_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
    ASSERT_TRUE(seq.ok()) << seq.status();
    refused = Append(*alice_, seq->id, 0, 32).status();
    if (refused.ok()) appended += 32;
  }
  EXPECT_EQ(appended, 64u);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("tenant 'alice'"));
  // Bob's quota is his own.
  EXPECT_NE(Filled(*bob_, 64), 0u);
}

TEST_F(AuthTest, SighupReadsTheTokensAgainAndABrokenFileKeepsThem) {
  WriteTokens(absl::StrCat("alice ", kAlice, "\ncarol carol-token-0123456789\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  EXPECT_TRUE(alice_->GetInfo().ok());
  EXPECT_TRUE(absl::IsUnauthenticated(bob_->GetInfo().status()));
  EXPECT_TRUE(Connect("carol-token-0123456789")->GetInfo().ok());
  WriteTokens("carol short\n");  // a token under 16 characters
  const absl::Status broken = server_->ReloadTokens();
  EXPECT_TRUE(absl::IsInvalidArgument(broken)) << broken;
  EXPECT_THAT(std::string(broken.message()), HasSubstr("line 1"));
  EXPECT_TRUE(alice_->GetInfo().ok());
  EXPECT_TRUE(Connect("carol-token-0123456789")->GetInfo().ok());
  // A role is admin or peer; another word names the roles there are.
  WriteTokens("carol carol-token-0123456789 root\n");
  const absl::Status role = server_->ReloadTokens();
  EXPECT_TRUE(absl::IsInvalidArgument(role)) << role;
  EXPECT_THAT(std::string(role.message()), HasSubstr("[admin|peer]"));
  WriteTokens("carol carol-token-0123456789 peer\n");
  EXPECT_TRUE(server_->ReloadTokens().ok());
  EXPECT_TRUE(Connect("carol-token-0123456789")->GetInfo().ok());
}

// On a unix socket the token file may name a tenant by its peers' uid (`<tenant> uid:<n>`):
// kvmemd accepts the connections itself and takes each peer's uid from the kernel
// (SO_PEERCRED). A mapped process needs no token and cannot claim another tenant with one;
// a reload that moves the uid takes the tenant away from the next call.
class UnixPeerAuthTest : public AuthTest {
 protected:
  void SetUp() override {
    unix_path_ = absl::StrCat(::testing::TempDir(), "/kvmem_auth_unix.", getpid());
    extra_tokens_ = absl::StrCat("alice uid:", getuid(), "\n");
    AuthTest::SetUp();
  }
};

TEST_F(UnixPeerAuthTest, AMappedUidIsItsTenantWithoutATokenAndCannotClaimAnother) {
  std::unique_ptr<client::Client> tokenless = Connect("");
  const uint64_t id = Filled(*tokenless, 16);
  ASSERT_NE(id, 0u);
  // The same tenant as alice's token: hers to read, in her Stats.
  const std::string content = Content(*alice_, id);
  EXPECT_FALSE(content.empty());
  auto stats = alice_->GetStats(true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences.size(), 1u);
  // The step channel (and its attach) serves the uid's tenant too.
  ASSERT_TRUE(tokenless->OpenStepChannel().ok());
  positions_ = testing::Range(16, 1);
  k_ = testing::Payload16(kL * kH, 16, 1, kD, 0);
  v_ = testing::Payload16(kL * kH, 16, 1, kD, 1);
  std::vector<client::BatchEntry> entries(1);
  entries[0].sequence_id = id;
  entries[0].append = client::AppendArgs{positions_, {}, k_, v_, {}, {}};
  auto stepped = tokenless->StepBatch(entries);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_TRUE((*stepped)[0].status.ok()) << (*stepped)[0].status;
  EXPECT_EQ(tokenless->step_channel_batches(), 1u);
  // Another tenant's token from this uid is refused, whatever it asks.
  for (client::Client* other : {bob_.get(), admin_.get()}) {
    const absl::Status refused = other->GetInfo().status();
    EXPECT_TRUE(absl::IsUnauthenticated(refused)) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("unix-socket peer's uid"));
    EXPECT_TRUE(absl::IsUnauthenticated(other->ReadKv(id).status()));
  }
  // The uid moves to another tenant's line: this process is nobody's without a token, and
  // bob's token now works here and sees alice's sequence as an unknown one.
  struct stat socket_file {};
  ASSERT_EQ(stat(unix_path_.c_str(), &socket_file), 0);
  EXPECT_NE(socket_file.st_mode & 0777, 0666u);  // kvmemd's own uid only: the umask's mode
  WriteTokens(absl::StrCat("alice ", kAlice, "\nbob ", kBob, "\ncarol uid:", getuid() + 1, "\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  // Another uid is mapped: its peers may connect now.
  ASSERT_EQ(stat(unix_path_.c_str(), &socket_file), 0);
  EXPECT_EQ(socket_file.st_mode & 0777, 0666u);
  const absl::Status nobody = tokenless->GetInfo().status();
  EXPECT_TRUE(absl::IsUnauthenticated(nobody)) << nobody;
  EXPECT_THAT(std::string(nobody.message()), HasSubstr("uid the token file maps"));
  ASSERT_TRUE(bob_->GetInfo().ok());
  EXPECT_TRUE(absl::IsNotFound(bob_->ReadKv(id).status()));
  EXPECT_GT(Content(*alice_, id).size(), content.size());  // the stepped token is hers
}

// uid lines only mean something where kvmemd tells its peers' uids (a unix --listen without
// TLS): elsewhere the file is refused at start and at a reload, the old tokens kept.
TEST_F(AuthTest, UidLinesAreRefusedWhereNoPeerHasAUid) {
  WriteTokens(absl::StrCat("alice ", kAlice, "\nbob uid:", getuid(), "\n"));
  const absl::Status reloaded = server_->ReloadTokens();
  EXPECT_TRUE(absl::IsInvalidArgument(reloaded)) << reloaded;
  EXPECT_THAT(std::string(reloaded.message()), HasSubstr("unix --listen"));
  EXPECT_TRUE(bob_->GetInfo().ok());  // the tokens as they were
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 4ull << 20;
  config.auth_tokens = tokens_;
  auto refused = service::Server::Start(config);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("maps uids"));
}

TEST(AuthStartTest, AnUnauthenticatedDaemonServesOnlyLoopbackOrAUnixSocket) {
  service::ServerConfig config;
  config.listen = "0.0.0.0:0";
  config.engine.pool_bytes = 4ull << 20;
  auto refused = service::Server::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status()));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--auth-tokens"));
  config.allow_unauthenticated_remote = true;
  auto allowed = service::Server::Start(config);
  EXPECT_TRUE(allowed.ok()) << allowed.status();
}

TEST(AuthUnitTest, TokenFilesAndListenAddresses) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/kvmem_auth_unit_tokens.", getpid());
  auto parse = [&](const std::string& text) {
    std::ofstream(path) << text;
    return service::Authenticator::Create(path, /*client_certificates=*/false);
  };
  for (const std::string& bad :
       {std::string("alice\n"), std::string("al/ice token-0123456789abc\n"),
        std::string("alice token-0123456789abc root\n"), std::string("alice short\n"),
        std::string("alice token-0123456789abc\nbob token-0123456789abc\n"),
        std::string("# nothing\n")}) {
    auto a = parse(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(a.status())) << bad << ": " << a.status();
  }
  EXPECT_TRUE(absl::IsNotFound(
      service::Authenticator::Create(path + "-missing", /*client_certificates=*/false).status()));
  auto a = parse(
      "alice token-0123456789abc # alice's\nops admin-0123456789abcd admin\n"
      "carol carols#token-0123456789\n");
  ASSERT_TRUE(a.ok()) << a.status();
  auto alice = (*a)->FromAuthorization("Bearer token-0123456789abc");
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->tenant, "alice");
  EXPECT_FALSE(alice->admin);
  EXPECT_TRUE((*a)->FromAuthorization("Bearer admin-0123456789abcd")->admin);
  // A '#' inside a token is the token's (before, the line was cut there).
  EXPECT_EQ((*a)->FromAuthorization("Bearer carols#token-0123456789")->tenant, "carol");
  EXPECT_FALSE((*a)->FromAuthorization("Bearer carols").ok());
  for (const char* bad : {"", "token-0123456789abc", "bearer token-0123456789abc",
                          "Bearer  token-0123456789abc", "Bearer token-0123456789ab"}) {
    EXPECT_TRUE(absl::IsUnauthenticated((*a)->FromAuthorization(bad).status())) << bad;
  }
  // uid lines: a unix-socket peer's uid names its tenant; a token must agree with it.
  for (const std::string& bad :
       {std::string("alice uid:\n"), std::string("alice uid:-1\n"), std::string("alice uid:12a\n"),
        std::string("alice uid:4294967295\n"), std::string("alice uid:99999999999\n"),
        std::string("alice uid:7\nbob uid:7\n"), std::string("alice uid:7 root\n"),
        std::string("alice uid:0123456789abcdef0\n"), std::string("alice uid:65534\n")}) {
    auto u = parse(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << bad << ": " << u.status();
  }
  auto u = parse("alice uid:1000\nops uid:0 admin\nbob token-0123456789abc\n");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->FromAuthorization("", "", 1000u)->tenant, "alice");
  EXPECT_TRUE((*u)->FromAuthorization("", "", 0u)->admin);
  EXPECT_TRUE(absl::IsUnauthenticated((*u)->FromAuthorization("", "", 1001u).status()));
  EXPECT_TRUE(absl::IsUnauthenticated((*u)->FromAuthorization("").status()));
  EXPECT_EQ((*u)->FromAuthorization("Bearer token-0123456789abc", "", 1001u)->tenant, "bob");
  EXPECT_TRUE(absl::IsUnauthenticated(
      (*u)->FromAuthorization("Bearer token-0123456789abc", "", 1000u).status()));
  EXPECT_TRUE(
      absl::IsUnauthenticated((*u)->FromAuthorization("Bearer wrong-0123456789abc", "", 1000u)
                                  .status()));  // a wrong token is not rescued by the uid
  std::remove(path.c_str());
  // Without a file, everyone is the anonymous admin.
  service::Authenticator none;
  EXPECT_TRUE(none.FromAuthorization("")->admin);

  for (const char* local : {"unix:/run/kvmem.sock", "unix-abstract:kvmem", "127.0.0.1:50551",
                            "127.1.2.3:0", "localhost:9", "[::1]:50551"}) {
    EXPECT_TRUE(service::IsLocalListen(local)) << local;
  }
  for (const char* remote :
       {"0.0.0.0:50551", "[::]:1", "10.0.0.7:50551", "kvmem:50551", "128.0.0.1:1",
        "127.0.0.1.example.com:1", "127.foo.example.com:1", "127.0.0.256:1"}) {
    EXPECT_FALSE(service::IsLocalListen(remote)) << remote;
  }
}

// TLS: certificates made by the openssl command for the suite (a CA, a server certificate
// for localhost and 127.0.0.1, clients "alice" and "bob", and "alice" from another CA).
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One folder per process: ctest runs each case as a process of its own, side by side.
    dir_ = absl::StrCat(::testing::TempDir(), "/kvmem_tls_test_", getpid());
    ok_ = testing::MakeTestCertificates(dir_);
  }
  static void TearDownTestSuite() { std::system(absl::StrCat("rm -rf ", dir_).c_str()); }
  void SetUp() override { ASSERT_TRUE(ok_) << "openssl could not make the test certificates"; }

  static std::string Pem(const std::string& name) { return testing::ReadTestPem(dir_, name); }

  void Start(const std::string& listen, const std::string& tokens = "") {
    service::ServerConfig config;
    config.listen = listen;
    config.engine.pool_bytes = 16ull << 20;
    config.reaper_period = absl::Hours(1);
    config.tls_cert = dir_ + "/server.pem";
    config.tls_key = dir_ + "/server.key";
    config.tls_client_ca = dir_ + "/ca.pem";
    config.auth_tokens = tokens;
    auto server = service::Server::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  std::unique_ptr<client::Client> Connect(const std::string& who, const std::string& token = "",
                                          const std::string& ca = "ca.pem") {
    client::ClientOptions options;
    options.deadline = absl::Seconds(10);
    options.max_attempts = 1;
    options.auth_token = token;
    options.tls_root_certs = Pem(ca);
    if (!who.empty()) {
      options.tls_cert_chain = Pem(who + ".pem");
      options.tls_private_key = Pem(who + ".key");
    }
    options.tls_server_name = "localhost";
    return *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()), options);
  }

  static std::string dir_;
  static bool ok_;
  std::unique_ptr<service::Server> server_;
};
std::string TlsTest::dir_;
bool TlsTest::ok_ = false;

TEST_F(TlsTest, AClientCertificateIsItsTenant) {
  Start("127.0.0.1:0");
  std::unique_ptr<client::Client> alice = Connect("alice"), bob = Connect("bob");
  auto seq = alice->CreateSequence(TestLayout(), {"full", {}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_TRUE(alice->GetBlockTable(seq->id).ok());
  EXPECT_TRUE(absl::IsNotFound(bob->GetBlockTable(seq->id).status()));
  auto bobs = bob->GetStats(true);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->sequences.empty());
  // No certificate, one from another CA, no TLS at all: no call gets through.
  EXPECT_FALSE(Connect("")->GetInfo().ok());
  EXPECT_FALSE(Connect("mallory")->GetInfo().ok());
  client::ClientOptions plain;
  plain.deadline = absl::Seconds(5);
  plain.max_attempts = 1;
  EXPECT_FALSE((*client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()), plain))
                   ->GetInfo()
                   .ok());
}

TEST_F(TlsTest, ATokenMustNameTheCertificatesTenant) {
  const std::string tokens = dir_ + "/tokens";
  std::ofstream(tokens) << "alice " << kAlice << "\nbob " << kBob << "\nops " << kAdmin
                        << " admin\n";
  // Authenticated: kvmemd may listen beyond loopback without --allow-unauthenticated-remote.
  Start("0.0.0.0:0", tokens);
  EXPECT_TRUE(Connect("alice", kAlice)->GetInfo().ok());
  const absl::Status mixed = Connect("alice", kBob)->GetInfo().status();
  EXPECT_TRUE(absl::IsUnauthenticated(mixed)) << mixed;
  EXPECT_THAT(std::string(mixed.message()), HasSubstr("different tenants"));
  EXPECT_TRUE(
      absl::IsUnauthenticated(Connect("alice", "unknown-token-0123456789")->GetInfo().status()));
}

}  // namespace
}  // namespace kvmem
