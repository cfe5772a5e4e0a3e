// KvPath (kvmem/kv_path.h): the transport a client picks by itself — attach on the same
// host, UCX where kvmemd runs --ucx and the attach socket is not there (another host),
// gRPC otherwise — and one forced by name, refused with what is missing. Whichever it
// picks, a read gives ReadKv's bytes for every precision, a stale table is refused, and an
// append lands the bytes it was given.
#include "kvmem/kv_path.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "kvmem/shared_pool.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/scoped_env.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

class KvPathTest : public DaemonTest {
 protected:
  void TearDown() override {
    DaemonTest::TearDown();
    unsetenv("UCX_TLS");
  }
  // kvmemd with --ucx over TCP, as a remote client reaches it.
  bool StartWithUcx() {
#if KVMEM_WITH_UCX
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    ucx_ = true;
    StartDaemon(64ull << 20);
    return !HasFatalFailure();
#else
    return false;
#endif
  }
  client::Info Info() {
    auto info = client_->GetInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : client::Info{};
  }
  // The Info a client on another host sees: the attach socket is not there.
  client::Info RemoteInfo() {
    client::Info info = Info();
    info.attach.socket = absl::StrCat(::testing::TempDir(), "/no-kvmemd-here.sock");
    return info;
  }
  absl::StatusOr<std::unique_ptr<client::KvPath>> Open(const client::Info& info,
                                                       client::KvTransport transport) {
    return client::KvPath::Open(client_.get(), info, {transport});
  }
  // Reads every stream of `id` through `path` and expects ReadKv's bytes.
  void ExpectReadsAsReadKv(const client::KvPath& path, uint64_t id) {
    auto table = client_->GetBlockTable(id);
    ASSERT_TRUE(table.ok()) << table.status();
    auto read = path.Read(*table);
    ASSERT_TRUE(read.ok()) << read.status();
    auto want = client_->ReadKv(id);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(read->size(), want->size());
    for (size_t s = 0; s < read->size(); ++s) {
      EXPECT_EQ((*read)[s].layer, (*want)[s].layer);
      EXPECT_EQ((*read)[s].kv_head, (*want)[s].kv_head);
      EXPECT_EQ((*read)[s].positions, (*want)[s].positions);
      EXPECT_EQ((*read)[s].k, (*want)[s].k) << "stream " << s;
      EXPECT_EQ((*read)[s].v, (*want)[s].v) << "stream " << s;
    }
  }
  // A sequence of every kind of block: layout precision and `quantized` ones.
  uint64_t Mixed(client::Precision quantized) {
    auto seq = client_->CreateSequence(TestLayout(), {"window", {{"window", 70}}, quantized, 16});
    EXPECT_TRUE(seq.ok()) << seq.status();
    if (!seq.ok()) return 0;
    EXPECT_TRUE(AppendRange(seq->id, 0, 100).ok());
    EXPECT_TRUE(client_->Step(seq->id, {}).ok());
    return seq->id;
  }
};

TEST_F(KvPathTest, NamesAreParsedAndRefused) {
  EXPECT_EQ(*client::ParseKvTransport("auto"), client::KvTransport::kAuto);
  EXPECT_EQ(*client::ParseKvTransport("shm"), client::KvTransport::kAttach);
  EXPECT_EQ(*client::ParseKvTransport("attach"), client::KvTransport::kAttach);
  EXPECT_EQ(*client::ParseKvTransport("ucx"), client::KvTransport::kUcx);
  EXPECT_EQ(*client::ParseKvTransport("grpc"), client::KvTransport::kGrpc);
  absl::StatusOr<client::KvTransport> bad = client::ParseKvTransport("rdma");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("auto, attach (shm), ucx, grpc"));
}

// The same host, no --ucx: attach, appends in the request; from another host, gRPC.
TEST_F(KvPathTest, AutoAttachesOnTheSameHostAndFallsBackToGrpc) {
  const uint64_t id = Mixed(client::Precision::kInt8);
  auto here = Open(Info(), client::KvTransport::kAuto);
  ASSERT_TRUE(here.ok()) << here.status();
  EXPECT_EQ((*here)->reads(), client::KvTransport::kAttach) << (*here)->reason();
  EXPECT_EQ((*here)->appends(), client::KvTransport::kGrpc);
  EXPECT_NE((*here)->attached(), nullptr);
  EXPECT_THAT((*here)->reason(), HasSubstr("same host"));
  ExpectReadsAsReadKv(**here, id);

  auto remote = Open(RemoteInfo(), client::KvTransport::kAuto);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ((*remote)->reads(), client::KvTransport::kGrpc) << (*remote)->reason();
  EXPECT_EQ((*remote)->appends(), client::KvTransport::kGrpc);
  EXPECT_EQ((*remote)->attached(), nullptr);
  EXPECT_THAT((*remote)->reason(), HasSubstr("another host"));
#if KVMEM_WITH_UCX
  EXPECT_THAT((*remote)->reason(), HasSubstr("kvmemd --ucx"));
#endif
  ExpectReadsAsReadKv(**remote, id);
}

// A transport asked by name that cannot be had: an error naming what is missing.
TEST_F(KvPathTest, AForcedTransportThatCannotBeHadIsRefused) {
  auto attach = Open(RemoteInfo(), client::KvTransport::kAttach);
  EXPECT_TRUE(absl::IsFailedPrecondition(attach.status())) << attach.status();
  EXPECT_THAT(std::string(attach.status().message()), HasSubstr("transport attach"));
  auto ucx = Open(Info(), client::KvTransport::kUcx);
  EXPECT_TRUE(absl::IsFailedPrecondition(ucx.status())) << ucx.status();
#if KVMEM_WITH_UCX
  EXPECT_THAT(std::string(ucx.status().message()), HasSubstr("kvmemd --ucx"));
#else
  EXPECT_THAT(std::string(ucx.status().message()), HasSubstr("without UCX"));
#endif
  auto grpc = Open(Info(), client::KvTransport::kGrpc);
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ((*grpc)->reads(), client::KvTransport::kGrpc);
  EXPECT_EQ((*grpc)->appends(), client::KvTransport::kGrpc);
}

// Every path refuses a table that went stale, and gives the fresh one's bytes.
TEST_F(KvPathTest, EveryPathRefusesAStaleTable) {
  std::vector<std::pair<client::Info, client::KvTransport>> paths = {
      {Info(), client::KvTransport::kAttach}, {Info(), client::KvTransport::kGrpc}};
  if (StartWithUcx()) {
    paths = {{Info(), client::KvTransport::kAttach},
             {Info(), client::KvTransport::kGrpc},
             {RemoteInfo(), client::KvTransport::kAuto}};
  }
  for (const auto& [info, transport] : paths) {
    auto path = Open(info, transport);
    ASSERT_TRUE(path.ok()) << path.status();
    SCOPED_TRACE((*path)->reason());
    const uint64_t id = Create("window", {{"window", 10}});
    ASSERT_TRUE(AppendRange(id, 0, 30).ok());
    auto table = *client_->GetBlockTable(id);
    ASSERT_TRUE(client_->Step(id, {}).ok());  // evicts: a new epoch
    auto stale = (*path)->Read(table);
    EXPECT_TRUE(absl::IsFailedPrecondition(stale.status()) || absl::IsAborted(stale.status()))
        << stale.status();
    ExpectReadsAsReadKv(**path, id);
  }
}

#if KVMEM_WITH_UCX
// kvmemd --ucx seen from another host: reads by RMA gets and appends as messages, bit-exact
// for every precision; a small append goes in the request, a large one by UCX.
TEST_F(KvPathTest, AutoPicksUcxFromAnotherHost) {
  ASSERT_TRUE(StartWithUcx());
  auto path = Open(RemoteInfo(), client::KvTransport::kAuto);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ((*path)->reads(), client::KvTransport::kUcx) << (*path)->reason();
  EXPECT_EQ((*path)->appends(), client::KvTransport::kUcx);
  EXPECT_THAT((*path)->reason(), HasSubstr("another host"));
  for (client::Precision p : {client::Precision::kLayout, client::Precision::kInt8,
                              client::Precision::kInt4, client::Precision::kNF4}) {
    SCOPED_TRACE(static_cast<int>(p));
    const uint64_t before = (*path)->ucx_bytes_read();
    ExpectReadsAsReadKv(**path, Mixed(p));
    EXPECT_GT((*path)->ucx_bytes_read(), before);
  }
  // Appends: 2 tokens are 4 KiB of K and V (in the request), 64 tokens 128 KiB (UCX).
  const uint64_t id = Create();
  for (const auto& [first, n] : {std::pair<int64_t, uint32_t>{0, 2}, {2, 64}}) {
    const std::vector<int64_t> positions = testing::Range(first, n);
    const std::string k = testing::Payload16(kL * kH, first, n, kD, 0);
    const std::string v = testing::Payload16(kL * kH, first, n, kD, 1);
    EXPECT_EQ((*path)->AppendsByUcx(k.size() + v.size()), n == 64);
    const uint64_t sent = (*path)->ucx_bytes_sent();
    auto appended = (*path)->Append(id, {positions, {}, k, v, {}, {}});
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_EQ(appended->appended_tokens, first + n);  // the sequence's, so far
    EXPECT_EQ((*path)->ucx_bytes_sent() - sent, n == 64 ? k.size() + v.size() : 0u);
  }
  ExpectContentMatchesPositions(id);
  // Past the daemon's --ucx-max-payload-bytes: in the request.
  EXPECT_FALSE((*path)->AppendsByUcx(Info().ucx.max_payload_bytes + 1));
  EXPECT_EQ(Info().ucx.max_payload_bytes, limits_.ucx_max_payload_bytes);
  // On the same host, attach still wins; large appends go by UCX (shared memory or TCP).
  auto here = Open(Info(), client::KvTransport::kAuto);
  ASSERT_TRUE(here.ok()) << here.status();
  EXPECT_EQ((*here)->reads(), client::KvTransport::kAttach) << (*here)->reason();
  EXPECT_EQ((*here)->appends(), client::KvTransport::kUcx);
  // Asked for: every append by UCX, however small.
  auto forced = Open(RemoteInfo(), client::KvTransport::kUcx);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE((*forced)->AppendsByUcx(8));
}

// A read larger than UcxPool's staging buffer: blocks side by side in the pool (K and V
// planes, and one stream's blocks after another's) are got as runs of at most 8 MiB, in
// rounds of at most 16 MiB staged, each copied out before the next: every byte where ReadKv
// puts it.
TEST_F(KvPathTest, AReadLargerThanTheStagingBufferIsExact) {
  ASSERT_TRUE(StartWithUcx());
  const uint64_t id = Create();
  for (int64_t first = 0; first < 12000; first += 2000) {  // 24 MB of K/V, 4 MB a call
    ASSERT_TRUE(AppendRange(id, first, 2000).ok());
  }
  auto path = Open(RemoteInfo(), client::KvTransport::kUcx);
  ASSERT_TRUE(path.ok()) << path.status();
  ExpectReadsAsReadKv(**path, id);
  EXPECT_GE((*path)->ucx_bytes_read(), 12000ull * kL * kH * kD * 2 * 2);
}

// A daemon restarted on its address (a new UCX worker, new keys): a path's broken connection
// to the pool is made again from the new daemon's GetInfo; UCX asked for reads by UCX again
// at once, auto too (or by gRPC while it cannot).
TEST_F(KvPathTest, AReaderWhoseDaemonRestartedConnectsAgain) {
  ASSERT_TRUE(StartWithUcx());
  client::ClientOptions options;
  options.deadline = absl::Seconds(20);
  // The paths' own client, which outlives the restart (the fixture's does not).
  auto own = client::Client::Connect(absl::StrCat("127.0.0.1:", server_->port()), options);
  ASSERT_TRUE(own.ok()) << own.status();
  auto forced = client::KvPath::Open(own->get(), RemoteInfo(), {client::KvTransport::kUcx});
  auto automatic = client::KvPath::Open(own->get(), RemoteInfo(), {client::KvTransport::kAuto});
  ASSERT_TRUE(forced.ok()) << forced.status();
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  ASSERT_EQ((*automatic)->reads(), client::KvTransport::kUcx);
  ExpectReadsAsReadKv(**forced, Mixed(client::Precision::kLayout));
  ExpectReadsAsReadKv(**automatic, Mixed(client::Precision::kLayout));

  listen_port_ = server_->port();
  StartDaemon(64ull << 20);
  ASSERT_FALSE(HasFatalFailure());
  const uint64_t id = Mixed(client::Precision::kInt8);
  for (client::KvPath* path : {forced->get(), automatic->get()}) {
    const uint64_t before = path->ucx_bytes_read();
    ExpectReadsAsReadKv(*path, id);
    ExpectReadsAsReadKv(*path, id);
    EXPECT_GT(path->ucx_bytes_read(), before);
  }
}

// A tenant is given no key to the pool (it reads every tenant's blocks): reads by gRPC,
// appends by UCX (the appends' worker serves every caller).
TEST(KvPathTenantTest, ATenantReadsByGrpcAndAppendsByUcx) {
  const testing::ScopedEnv tcp("UCX_TLS", "tcp");
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/kvmem_kv_path_tokens.", getpid());
  std::ofstream(tokens) << "alice alice-token-0123456789\n";
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 8ull << 20;
  config.auth_tokens = tokens;
  config.ucx = true;
  config.ucx_trusted_network = true;
  auto server = service::Server::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions options;
  options.auth_token = "alice-token-0123456789";
  auto alice = *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
  auto info = alice->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  auto path = client::KvPath::Open(alice.get(), *info, {});
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ((*path)->reads(), client::KvTransport::kGrpc) << (*path)->reason();
  EXPECT_EQ((*path)->appends(), client::KvTransport::kUcx);
  EXPECT_THAT((*path)->reason(), HasSubstr("no pool key"));
  auto forced = client::KvPath::Open(alice.get(), *info, {client::KvTransport::kUcx});
  EXPECT_TRUE(absl::IsFailedPrecondition(forced.status())) << forced.status();
  const client::Layout layout{2, 2, 64, client::DType::kF16, 16, 1000};
  const uint64_t id = alice->CreateSequence(layout, {"full", {}})->id;
  const std::vector<int64_t> positions = testing::Range(0, 100);
  const std::string k = testing::Payload16(4, 0, 100, 64, 0),
                    v = testing::Payload16(4, 0, 100, 64, 1);
  auto appended = (*path)->Append(id, {positions, {}, k, v, {}, {}});
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ((*path)->ucx_bytes_sent(), k.size() + v.size());
  auto table = alice->GetBlockTable(id);
  ASSERT_TRUE(table.ok()) << table.status();
  auto read = (*path)->Read(*table);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 4u);
  for (uint32_t s = 0; s < 4; ++s) {
    EXPECT_EQ((*read)[s].k, testing::Expected16(s, positions, 64, 0)) << s;
    EXPECT_EQ((*read)[s].v, testing::Expected16(s, positions, 64, 1)) << s;
  }
  std::remove(tokens.c_str());
}
#endif

}  // namespace
}  // namespace kvmem
