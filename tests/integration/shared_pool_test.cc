// Same-host attach: blocks read in place from the shared pool, zero copies, and the
// seqlock protocol that keeps a reader from trusting a block the daemon is rewriting.
#include "kvmem/shared_pool.h"

#include <atomic>
#include <thread>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

class SharedPoolTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    auto info = client_->GetInfo();
    ASSERT_TRUE(info.ok());
    auto pool = client::SharedPool::Attach(*info);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
  }
  std::unique_ptr<client::SharedPool> pool_;
};

TEST_F(SharedPoolTest, ReadsBlocksInPlaceBitExact) {
  const uint64_t id = Create("window", {{"window", 50}});
  ASSERT_TRUE(AppendRange(id, 0, 120).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());
  auto table = *client_->GetBlockTable(id);
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t h = 0; h < kH; ++h) {
      std::string k, v;
      ASSERT_TRUE(pool_->ReadStream(table, l, h, &k, &v).ok());
      const auto& positions = table.streams[l * kH + h].positions;
      EXPECT_EQ(positions, testing::Range(70, 50));
      EXPECT_EQ(k, testing::Expected16(l * kH + h, positions, kD, 0));
      EXPECT_EQ(v, testing::Expected16(l * kH + h, positions, kD, 1));
    }
  }
  // The views point into the mapping itself: no copy between daemon and reader.
  auto blocks = *pool_->StreamBlocks(table, 0, 0);
  ASSERT_TRUE(pool_->BeginRead(table).ok());
  EXPECT_EQ(blocks.size(), 4u);
  uint16_t first;
  std::memcpy(&first, blocks[0].k, 2);
  EXPECT_EQ(first, testing::Element16(0, 70, 0, 0));
  EXPECT_TRUE(pool_->EndRead(table).ok());
}

TEST_F(SharedPoolTest, StaleTablesAreRefused) {
  const uint64_t id = Create("window", {{"window", 10}});
  ASSERT_TRUE(AppendRange(id, 0, 30).ok());
  auto table = *client_->GetBlockTable(id);
  ASSERT_TRUE(pool_->BeginRead(table).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());  // compaction rewrites the blocks mid-read
  EXPECT_EQ(pool_->EndRead(table).code(), absl::StatusCode::kFailedPrecondition);
  std::string k, v;
  EXPECT_EQ(pool_->ReadStream(table, 0, 0, &k, &v).code(), absl::StatusCode::kFailedPrecondition);
  // A released sequence's table is refused too.
  table = *client_->GetBlockTable(id);
  ASSERT_TRUE(client_->Release(id).ok());
  EXPECT_EQ(pool_->BeginRead(table).code(), absl::StatusCode::kFailedPrecondition);
  // Appending does not move existing slots, so it keeps the epoch and the table valid.
  const uint64_t id2 = Create("full");
  ASSERT_TRUE(AppendRange(id2, 0, 30).ok());
  table = *client_->GetBlockTable(id2);
  ASSERT_TRUE(AppendRange(id2, 30, 5).ok());
  EXPECT_TRUE(pool_->ReadStream(table, 1, 1, &k, &v).ok());
  EXPECT_EQ(k, testing::Expected16(3, testing::Range(0, 30), kD, 0));
}

// A writer appends and evicts (every step moves every slot of every stream) while a reader
// reads in place. Every read the protocol accepts must match its table exactly.
TEST_F(SharedPoolTest, ConcurrentReaderNeverAcceptsARewrittenBlock) {
  const uint64_t id = Create("window", {{"window", 48}});
  ASSERT_TRUE(AppendRange(id, 0, 48).ok());
  std::atomic<bool> done{false};
  std::atomic<int> accepted{0}, refused{0}, corrupt{0}, torn_unchecked{0};

  std::thread reader([&] {
    auto reader_client = *client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()));
    while (!done.load()) {
      auto table = reader_client->GetBlockTable(id);
      if (!table.ok()) continue;
      for (uint32_t s = 0; s < kL * kH; ++s) {
        std::string k, v;
        // Unchecked copy first, to show what a reader without the protocol would see.
        auto blocks = *pool_->StreamBlocks(*table, s / kH, s % kH);
        std::string raw;
        for (const auto& b : blocks)
          raw.append(reinterpret_cast<const char*>(b.k), b.count * kD * 2);
        const std::string want = testing::Expected16(s, table->streams[s].positions, kD, 0);
        if (raw != want) ++torn_unchecked;
        const absl::Status status = pool_->ReadStream(*table, s / kH, s % kH, &k, &v);
        if (!status.ok()) {
          ++refused;
          break;
        }
        ++accepted;
        if (k != want || v != testing::Expected16(s, table->streams[s].positions, kD, 1)) {
          ++corrupt;
        }
      }
    }
  });
  for (int64_t t = 48; t < 448; ++t) {
    ASSERT_TRUE(AppendRange(id, t, 1).ok());
    ASSERT_TRUE(client_->Step(id, {}).ok());
  }
  done = true;
  reader.join();
  std::printf("accepted %d stream reads, refused %d stale ones; %d unchecked reads were torn\n",
              accepted.load(), refused.load(), torn_unchecked.load());
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_GT(accepted.load(), 0);
  EXPECT_GT(refused.load(), 0);
}

}  // namespace
}  // namespace kvmem
