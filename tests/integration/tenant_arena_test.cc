// Tenant arenas (kvmemd --tenant-arena): a tenant with an arena holds its blocks there and
// nowhere else, and its same-host clients receive that arena's descriptor and nothing of the
// rest of the pool: they read (and, with --in-place-writes, write) their own blocks in
// place, and another tenant's block is outside their mapping. An admin maps the shared part.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmem/attach.h"
#include "kvmem/client.h"
#include "kvmem/kv_path.h"
#include "kvmem/shared_pool.h"
#include "kvmem/v1/attach.h"
#include "server/service/server.h"
#include "tests/testing/payload.h"

namespace kvmem {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kL = 2, kH = 2, kD = 64;
constexpr uint64_t kPool = 16ull << 20, kArena = 4ull << 20;
constexpr char kAlice[] = "alice-token-0123456789";
constexpr char kBob[] = "bob-token-0123456789ab";
constexpr char kAdmin[] = "admin-token-0123456789";

client::Layout TestLayout() { return client::Layout{kL, kH, kD, client::DType::kF16, 16, 49152}; }

class TenantArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = absl::StrCat(::testing::TempDir(), "/kvmem_arena_test_tokens.", getpid());
    std::ofstream(tokens_) << "alice " << kAlice << "\nbob " << kBob << "\nops " << kAdmin
                           << " admin\n";
    service::ServerConfig config;
    config.listen = "127.0.0.1:0";
    config.engine.pool_bytes = kPool + 1000;  // not whole pages: the arenas' pool is made so
    config.engine.max_sequences = 64;
    config.engine.in_place_writes = in_place_writes_;
    config.engine.table_area_bytes = 1 << 20;
    config.engine.tenant_arenas = {{"alice", kArena}};
    config.reaper_period = absl::Hours(1);
    config.auth_tokens = tokens_;
    auto server = service::Server::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = Connect(kAlice);
    bob_ = Connect(kBob);
    admin_ = Connect(kAdmin);
  }
  void TearDown() override { std::remove(tokens_.c_str()); }

  std::unique_ptr<client::Client> Connect(const std::string& token) {
    client::ClientOptions options;
    options.deadline = absl::Seconds(20);
    options.max_attempts = 1;
    options.auth_token = token;
    return *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()), options);
  }

  // A sequence of `who` with tokens [0, n) appended.
  uint64_t Filled(client::Client& who, uint32_t n) {
    auto seq = who.CreateSequence(TestLayout(), {"full", {}});
    EXPECT_TRUE(seq.ok()) << seq.status();
    if (!seq.ok()) return 0;
    const std::vector<int64_t> positions = testing::Range(0, n);
    const std::string k = testing::Payload16(kL * kH, 0, n, kD, 0);
    const std::string v = testing::Payload16(kL * kH, 0, n, kD, 1);
    const absl::Status appended = who.Append(seq->id, {positions, {}, k, v, {}, {}}).status();
    EXPECT_TRUE(appended.ok()) << appended;
    return seq->id;
  }

  bool in_place_writes_ = true;
  std::string tokens_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<client::Client> alice_, bob_, admin_;
};

TEST_F(TenantArenaTest, ATenantMapsItsArenaAloneAndReadsItsBlocksThere) {
  absl::StatusOr<client::Info> alices = alice_->GetInfo();
  absl::StatusOr<client::Info> bobs = bob_->GetInfo();
  absl::StatusOr<client::Info> admins = admin_->GetInfo();
  ASSERT_TRUE(alices.ok() && bobs.ok() && admins.ok());
  EXPECT_EQ(alices->shm_bytes, kPool);
  EXPECT_EQ(alices->shm_piece_offset, kPool - kArena);
  EXPECT_EQ(alices->shm_piece_bytes, kArena);
  EXPECT_EQ(bobs->shm_bytes, 0u);  // no arena, no admin: no mapping
  EXPECT_EQ(admins->shm_piece_offset, 0u);
  EXPECT_EQ(admins->shm_piece_bytes, kPool - kArena);
  // The table area shows every sequence's table: the admin's to map, not alice's.
  EXPECT_NE(admins->table_area_bytes, 0u);
  EXPECT_EQ(alices->table_area_bytes, 0u);
  EXPECT_NE(alices->epoch_slots, 0u);

  // What alice's ticket hands her: the arena's descriptor, of the arena's size and no more.
  absl::StatusOr<std::vector<client::ReceivedSegment>> received =
      client::ReceiveSegments(alices->attach, "test");
  ASSERT_TRUE(received.ok()) << received.status();
  bool pool_seen = false;
  for (const client::ReceivedSegment& r : *received) {
    struct stat st {};
    ASSERT_EQ(fstat(r.fd, &st), 0);
    if (r.kind == v1::attach::kPool) {
      pool_seen = true;
      EXPECT_EQ(r.bytes, kArena);
      EXPECT_EQ(static_cast<uint64_t>(st.st_size), kArena);
      EXPECT_TRUE(r.writable);  // --in-place-writes: her arena only
    }
    close(r.fd);
  }
  EXPECT_TRUE(pool_seen);
  // Stats: alice sees her arena, bob none, the admin every one.
  absl::StatusOr<client::Stats> her_stats = alice_->GetStats(false);
  ASSERT_TRUE(her_stats.ok()) << her_stats.status();
  ASSERT_EQ(her_stats->arenas.size(), 1u);
  EXPECT_EQ(her_stats->arenas[0].tenant, "alice");
  EXPECT_EQ(her_stats->arenas[0].bytes, kArena);
  EXPECT_EQ(her_stats->arenas[0].free_bytes, kArena);
  EXPECT_TRUE(bob_->GetStats(false)->arenas.empty());
  EXPECT_EQ(admin_->GetStats(false)->arenas.size(), 1u);

  const uint64_t hers = Filled(*alice_, 40);
  const uint64_t his = Filled(*bob_, 40);
  absl::StatusOr<client::BlockTable> her_table = alice_->GetBlockTable(hers);
  absl::StatusOr<client::BlockTable> his_table = admin_->GetBlockTable(his);
  ASSERT_TRUE(her_table.ok() && his_table.ok());
  for (const client::StreamTable& st : her_table->streams) {
    for (const client::TableBlock& b : st.blocks) {
      EXPECT_GE(b.offset, kPool - kArena);
      EXPECT_LE(b.offset + her_table->block_bytes, kPool);
    }
  }
  for (const client::StreamTable& st : his_table->streams) {
    for (const client::TableBlock& b : st.blocks) EXPECT_LT(b.offset, kPool - kArena);
  }

  absl::StatusOr<std::unique_ptr<client::SharedPool>> her_pool =
      client::SharedPool::Attach(*alices);
  ASSERT_TRUE(her_pool.ok()) << her_pool.status();
  absl::StatusOr<std::vector<client::StreamKv>> read = (*her_pool)->ReadStreams(*her_table);
  absl::StatusOr<std::vector<client::StreamKv>> sent = alice_->ReadKv(hers);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(sent.ok()) << sent.status();
  ASSERT_EQ(read->size(), sent->size());
  for (size_t s = 0; s < read->size(); ++s) {
    EXPECT_EQ((*read)[s].k, (*sent)[s].k) << s;
    EXPECT_EQ((*read)[s].v, (*sent)[s].v) << s;
  }
  // Bob's blocks are outside her mapping: refused, never read.
  absl::StatusOr<std::vector<client::BlockView>> his_blocks =
      (*her_pool)->StreamBlocks(*his_table, 0, 0);
  EXPECT_EQ(his_blocks.status().code(), absl::StatusCode::kOutOfRange) << his_blocks.status();

  // The admin maps the shared part: bob's blocks, not alice's.
  absl::StatusOr<std::unique_ptr<client::SharedPool>> shared = client::SharedPool::Attach(*admins);
  ASSERT_TRUE(shared.ok()) << shared.status();
  absl::StatusOr<std::vector<client::StreamKv>> his_read = (*shared)->ReadStreams(*his_table);
  absl::StatusOr<std::vector<client::StreamKv>> his_sent = bob_->ReadKv(his);
  ASSERT_TRUE(his_read.ok() && his_sent.ok()) << his_read.status();
  EXPECT_EQ((*his_read)[3].k, (*his_sent)[3].k);
  EXPECT_EQ((*shared)->StreamBlocks(*her_table, 0, 0).status().code(),
            absl::StatusCode::kOutOfRange);
  // The admin's path on its own choice reads what its mapping lacks by gRPC; asked for
  // attach alone, it refuses.
  for (const client::KvTransport t : {client::KvTransport::kAuto, client::KvTransport::kAttach}) {
    absl::StatusOr<std::unique_ptr<client::KvPath>> path =
        client::KvPath::Open(admin_.get(), *admin_->GetInfo(), {t});
    ASSERT_TRUE(path.ok()) << path.status();
    ASSERT_EQ((*path)->reads(), client::KvTransport::kAttach);
    absl::StatusOr<std::vector<client::StreamKv>> via = (*path)->Read(*her_table);
    if (t == client::KvTransport::kAttach) {
      EXPECT_EQ(via.status().code(), absl::StatusCode::kOutOfRange) << via.status();
      continue;
    }
    ASSERT_TRUE(via.ok()) << via.status();
    EXPECT_EQ((*via)[2].k, (*sent)[2].k);
  }
}

TEST_F(TenantArenaTest, AFullArenaRefusesItsTenantAndNoOneElse) {
  // 4 MiB of arena hold about 19 sequences of 200 tokens (13 blocks of 4 KiB in each of 4
  // streams: 208 KiB); the next one's Append is refused, naming the arena.
  std::vector<uint64_t> hers;
  absl::Status refused = absl::OkStatus();
  for (int i = 0; i < 40 && refused.ok(); ++i) {
    auto seq = alice_->CreateSequence(TestLayout(), {"full", {}});
    ASSERT_TRUE(seq.ok()) << seq.status();
    hers.push_back(seq->id);
    const std::vector<int64_t> positions = testing::Range(0, 200);
    const std::string k = testing::Payload16(kL * kH, 0, 200, kD, 0);
    refused = alice_->Append(seq->id, {positions, {}, k, k, {}, {}}).status();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the arena of tenant 'alice'"));
  EXPECT_GE(hers.size(), 15u);
  // The shared part is untouched by it: bob appends as before.
  EXPECT_NE(Filled(*bob_, 40), 0u);
  // Released, alice's blocks go back to her arena.
  for (uint64_t id : hers) ASSERT_TRUE(alice_->Release(id).ok());
  EXPECT_NE(Filled(*alice_, 40), 0u);
}

// The shared part full gives back what is cached there, never what a tenant keeps cached in
// its arena (which would free nothing the shared part can use).
TEST_F(TenantArenaTest, AFullSharedPartLeavesTheArenasCacheAlone) {
  client::Prompt prompt;
  for (int32_t t = 0; t < 64; ++t) prompt.token_ids.push_back(1000 + t);
  {
    auto seq = alice_->CreateSequence(TestLayout(), {"full", {}}, std::nullopt, &prompt);
    ASSERT_TRUE(seq.ok()) << seq.status();
    const std::vector<int64_t> positions = testing::Range(0, 64);
    const std::string k = testing::Payload16(kL * kH, 0, 64, kD, 0);
    ASSERT_TRUE(alice_->Append(seq->id, {positions, prompt.token_ids, k, k, {}, {}}).ok());
    ASSERT_TRUE(alice_->Publish(seq->id).ok());
    ASSERT_TRUE(alice_->Release(seq->id).ok());  // its blocks: cached in her arena alone
  }
  const uint64_t cached = *alice_->Lookup(TestLayout(), prompt);
  ASSERT_GE(cached, 48u);
  // Bob fills the shared part.
  absl::Status refused = absl::OkStatus();
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    auto seq = bob_->CreateSequence(TestLayout(), {"full", {}});
    if (!seq.ok()) {
      refused = seq.status();
      break;
    }
    const std::vector<int64_t> positions = testing::Range(0, 400);
    const std::string k = testing::Payload16(kL * kH, 0, 400, kD, 0);
    refused = bob_->Append(seq->id, {positions, {}, k, k, {}, {}}).status();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the shared part of the pool"));
  EXPECT_EQ(*alice_->Lookup(TestLayout(), prompt), cached);
}

TEST_F(TenantArenaTest, InPlaceWritesLandInTheTenantsArena) {
  absl::StatusOr<client::Info> info = alice_->GetInfo();
  ASSERT_TRUE(info.ok() && info->in_place_writes);
  absl::StatusOr<std::unique_ptr<client::SharedPool>> pool =
      client::SharedPool::Attach(*info, /*writable=*/true);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t id = Filled(*alice_, 20);
  absl::StatusOr<client::BlockTable> table = alice_->GetBlockTable(id);
  ASSERT_TRUE(table.ok());
  client::BatchEntry ask;
  ask.sequence_id = id;
  ask.plan_tokens = 1;
  absl::StatusOr<std::vector<client::BatchResult>> planned =
      alice_->StepBatch(absl::MakeConstSpan(&ask, 1));
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_TRUE((*planned)[0].plan.has_value()) << (*planned)[0].plan_status;
  const client::WritePlan plan = *(*planned)[0].plan;
  for (uint64_t offset : plan.block_offsets) EXPECT_GE(offset, kPool - kArena);
  const std::string k = testing::Payload16(kL * kH, 20, 1, kD, 0);
  const std::string v = testing::Payload16(kL * kH, 20, 1, kD, 1);
  ASSERT_TRUE((*pool)->WritePlanned(plan, *table, 1, k, v).ok());
  const std::vector<int64_t> position = {20};
  client::BatchEntry commit;
  commit.sequence_id = id;
  commit.append = client::AppendArgs{position, {}, {}, {}, {}, {}};
  commit.written_plan = plan.plan_id;
  absl::StatusOr<std::vector<client::BatchResult>> out =
      alice_->StepBatch(absl::MakeConstSpan(&commit, 1));
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  absl::StatusOr<std::vector<client::StreamKv>> streams = alice_->ReadKv(id);
  ASSERT_TRUE(streams.ok()) << streams.status();
  const uint64_t row = uint64_t{kD} * 2;
  for (size_t s = 0; s < streams->size(); ++s) {
    ASSERT_EQ((*streams)[s].positions.back(), 20);
    EXPECT_EQ((*streams)[s].k.substr(20 * row), k.substr(s * row, row)) << s;
    EXPECT_EQ((*streams)[s].v.substr(20 * row), v.substr(s * row, row)) << s;
  }
}

class ReadOnlyArenaTest : public TenantArenaTest {
 protected:
  void SetUp() override {
    in_place_writes_ = false;
    TenantArenaTest::SetUp();
  }
};

// Without --in-place-writes the arena's descriptor maps read-only, however it is mapped.
TEST_F(ReadOnlyArenaTest, TheArenasDescriptorMapsReadOnly) {
  absl::StatusOr<client::Info> info = alice_->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<std::vector<client::ReceivedSegment>> received =
      client::ReceiveSegments(info->attach, "test");
  ASSERT_TRUE(received.ok()) << received.status();
  for (const client::ReceivedSegment& r : *received) {
    if (r.kind == v1::attach::kPool) {
      EXPECT_FALSE(r.writable);
      EXPECT_EQ(r.bytes, kArena);
      EXPECT_EQ(mmap(nullptr, kArena, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0), MAP_FAILED);
      void* read_only = mmap(nullptr, kArena, PROT_READ, MAP_SHARED, r.fd, 0);
      EXPECT_NE(read_only, MAP_FAILED);
      if (read_only != MAP_FAILED) munmap(read_only, kArena);
    }
    close(r.fd);
  }
  EXPECT_EQ(client::SharedPool::Attach(*info, /*writable=*/true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const uint64_t hers = Filled(*alice_, 24);
  absl::StatusOr<std::unique_ptr<client::SharedPool>> pool = client::SharedPool::Attach(*info);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::vector<client::StreamKv>> read =
      (*pool)->ReadStreams(*alice_->GetBlockTable(hers));
  absl::StatusOr<std::vector<client::StreamKv>> sent = alice_->ReadKv(hers);
  ASSERT_TRUE(read.ok() && sent.ok()) << read.status();
  EXPECT_EQ((*read)[1].v, (*sent)[1].v);
}

TEST(TenantArenaConfigTest, ArenasNeedIdentitiesAndTheCpuBackend) {
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = kPool;
  config.engine.max_sequences = 8;
  config.engine.tenant_arenas = {{"alice", kArena}};
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(config);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("--tenant-arena"));
}

}  // namespace
}  // namespace kvmem
