// Same-host attach: blocks read in place from the shared pool, zero copies, and the
// seqlock protocol that keeps a reader from trusting a block the daemon is rewriting.
#include "kvmem/shared_pool.h"

#include <atomic>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

class SharedPoolTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    if (HasFatalFailure()) return;
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

// The raw K bytes of one stream as the mapping holds them now, copied through StreamBlocks
// without the protocol: what a reader that skipped BeginRead/EndRead would take.
std::string RawK(const client::SharedPool& pool, const client::BlockTable& table, uint32_t s,
                 uint32_t heads, uint32_t head_dim) {
  auto blocks = pool.StreamBlocks(table, s / heads, s % heads);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  std::string raw;
  if (!blocks.ok()) return raw;
  for (const auto& b : *blocks)
    raw.append(reinterpret_cast<const char*>(b.k), b.count * head_dim * 2);
  return raw;
}

// A read that a rewrite interrupts is refused, by construction rather than by timing: the
// reader begins, copies half the streams, the daemon compacts every stream (a new epoch), the
// reader copies the rest — bytes that no longer match its table — and EndRead refuses the
// whole read. The stale table is refused from then on; a fresh one reads correctly.
// Epochs are unique across restarts too: a table kept from before kvmemd restarted names
// blocks that now hold another sequence's K/V, and must never validate against the new
// sequence in the same slot with the same history (epochs once restarted at 1 each boot).
TEST_F(SharedPoolTest, ATableFromBeforeARestartNeverValidates) {
  const uint64_t before = Create();
  ASSERT_TRUE(AppendRange(before, 0, 40).ok());
  auto old_table = client_->GetBlockTable(before);
  ASSERT_TRUE(old_table.ok()) << old_table.status();
  StartDaemon(64ull << 20);  // another boot
  const uint64_t after = Create();
  ASSERT_TRUE(AppendRange(after, 1000, 40).ok());
  auto table = client_->GetBlockTable(after);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->epoch_slot, old_table->epoch_slot);  // the same slot, the same history
  EXPECT_NE(table->epoch, old_table->epoch);
  auto info = client_->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  auto pool = client::SharedPool::Attach(*info);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->BeginRead(*old_table).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*pool)->BeginRead(*table).ok());
}

TEST_F(SharedPoolTest, AReadInterruptedByARewriteIsRefused) {
  const uint64_t id = Create("window", {{"window", 10}});
  ASSERT_TRUE(AppendRange(id, 0, 40).ok());
  auto table = client_->GetBlockTable(id);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto want = [&](uint32_t s) {
    return testing::Expected16(s, table->streams[s].positions, kD, 0);
  };
  ASSERT_EQ(table->streams[0].positions, testing::Range(0, 40));

  ASSERT_TRUE(pool_->BeginRead(*table).ok());
  constexpr uint32_t kStreams = kL * kH;
  for (uint32_t s = 0; s < kStreams / 2; ++s) {
    EXPECT_EQ(RawK(*pool_, *table, s, kH, kD), want(s)) << "stream " << s;  // untouched so far
  }
  auto step = client_->Step(id, {});  // evicts 30 of 40 tokens, compacting every stream
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_NE(step->epoch, table->epoch);
  // The premise: the step rewrote memory the old table names, so the rest of this read is
  // wrong (were it not, the refusal below would prove less).
  int torn = 0;
  for (uint32_t s = kStreams / 2; s < kStreams; ++s)
    torn += RawK(*pool_, *table, s, kH, kD) != want(s);
  EXPECT_GT(torn, 0) << "premise: the step should rewrite blocks the old table names";
  EXPECT_EQ(pool_->EndRead(*table).code(), absl::StatusCode::kFailedPrecondition);

  // The stale table stays refused, by every entry point.
  EXPECT_EQ(pool_->BeginRead(*table).code(), absl::StatusCode::kFailedPrecondition);
  std::string k, v;
  EXPECT_EQ(pool_->ReadStream(*table, 0, 0, &k, &v).code(), absl::StatusCode::kFailedPrecondition);
  // A fresh table names the compacted blocks and reads them exactly.
  auto fresh = client_->GetBlockTable(id);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->epoch, step->epoch);
  for (uint32_t s = 0; s < kStreams; ++s) {
    ASSERT_TRUE(pool_->ReadStream(*fresh, s / kH, s % kH, &k, &v).ok()) << "stream " << s;
    EXPECT_EQ(fresh->streams[s].positions, testing::Range(30, 10));
    EXPECT_EQ(k, testing::Expected16(s, fresh->streams[s].positions, kD, 0)) << "stream " << s;
    EXPECT_EQ(v, testing::Expected16(s, fresh->streams[s].positions, kD, 1)) << "stream " << s;
  }
}

// A writer appends and evicts (every step rewrites the blocks it keeps) while a reader reads
// in place. Every read the protocol accepts must match its table exactly. Refusals are
// counted but not asserted here (whether the reader meets a rewrite is timing; the test above
// makes one by construction). Accepted reads are made certain: every 50 steps the writer
// pauses until the reader has read a whole table, and with nothing written in a pause the
// protocol must accept one. No ASSERT while the reader runs: failures are recorded, the
// writer stops, the reader is joined, then everything is checked.
TEST_F(SharedPoolTest, ConcurrentReaderNeverAcceptsARewrittenBlock) {
  // Each step appends 30 tokens and evicts 30 of 40, compacting the survivors over blocks
  // readers may still be reading (a one-token step only moves a live range's start and
  // rewrites nothing: a reader would never meet a torn block).
  constexpr int kWindow = 10, kChunk = 30, kSteps = 400;
  const uint64_t id = Create("window", {{"window", kWindow}});
  ASSERT_TRUE(AppendRange(id, 0, kWindow).ok());
  std::atomic<bool> done{false};
  std::atomic<int> accepted{0}, refused{0}, corrupt{0}, torn_unchecked{0}, whole_tables{0};
  std::atomic<int> reader_errors{0};

  std::thread reader([&] {
    auto reader_client = client::Client::Connect("127.0.0.1:" + std::to_string(server_->port()));
    if (!reader_client.ok()) {
      ++reader_errors;
      return;
    }
    while (!done.load()) {
      auto table = (*reader_client)->GetBlockTable(id);
      if (!table.ok()) {
        ++reader_errors;
        continue;
      }
      bool whole = true;
      for (uint32_t s = 0; s < kL * kH; ++s) {
        std::string k, v;
        // Unchecked copy first, to show what a reader without the protocol would see.
        auto blocks = pool_->StreamBlocks(*table, s / kH, s % kH);
        if (!blocks.ok()) {
          ++reader_errors;
          whole = false;
          break;
        }
        std::string raw;
        for (const auto& b : *blocks)
          raw.append(reinterpret_cast<const char*>(b.k), b.count * kD * 2);
        const std::string want = testing::Expected16(s, table->streams[s].positions, kD, 0);
        if (raw != want) ++torn_unchecked;
        const absl::Status status = pool_->ReadStream(*table, s / kH, s % kH, &k, &v);
        if (!status.ok()) {
          ++refused;
          whole = false;
          break;
        }
        ++accepted;
        if (k != want || v != testing::Expected16(s, table->streams[s].positions, kD, 1)) {
          ++corrupt;
        }
      }
      if (whole) ++whole_tables;
    }
  });
  int pauses = 0, pauses_unanswered = 0;
  for (int i = 0; i < kSteps; ++i) {
    const int64_t t = kWindow + int64_t{i} * kChunk;
    const absl::Status appended = AppendRange(id, t, kChunk).status();
    const absl::Status stepped = appended.ok() ? client_->Step(id, {}).status() : appended;
    if (!stepped.ok()) {
      ADD_FAILURE() << "at position " << t << ": " << stepped;
      break;
    }
    if (i % 50 == 49) {
      ++pauses;
      const int before = whole_tables.load();
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      while (whole_tables.load() == before && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      if (whole_tables.load() == before) {
        ++pauses_unanswered;
        break;
      }
    }
  }
  done = true;
  reader.join();
  std::printf("accepted %d stream reads, refused %d stale ones; %d unchecked reads were torn\n",
              accepted.load(), refused.load(), torn_unchecked.load());
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(reader_errors.load(), 0);
  EXPECT_EQ(pauses_unanswered, 0) << "a quiescent pool refused or never served a whole read";
  EXPECT_EQ(pauses, kSteps / 50);
  EXPECT_GE(accepted.load(), pauses * static_cast<int>(kL * kH));
}

}  // namespace
}  // namespace kvmem
