// ParallelFor: every index once, in ranges of at most the grain, exceptions to the caller.
#include "server/common/parallel.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem {
namespace {

TEST(ParallelForTest, CoversEveryIndexOnceInRangesOfAtMostTheGrain) {
  for (size_t n : {0, 1, 7, 8, 9, 100, 1000}) {
    for (size_t grain : {0, 1, 3, 8, 2000}) {
      std::vector<std::atomic<int>> seen(n);
      std::atomic<size_t> widest{0};
      ParallelFor(n, grain, [&](size_t begin, size_t end) {
        ASSERT_LT(begin, end);
        for (size_t i = begin; i < end; ++i) seen[i].fetch_add(1);
        size_t w = widest.load();
        while (end - begin > w && !widest.compare_exchange_weak(w, end - begin)) {
        }
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i].load(), 1) << n << "/" << grain;
      if (n > std::max<size_t>(grain, 1)) {
        EXPECT_LE(widest.load(), std::max<size_t>(grain, 1)) << n << "/" << grain;
      }
    }
  }
}

TEST(ParallelForTest, AnExceptionReachesTheCaller) {
  EXPECT_THROW(ParallelFor(64, 1,
                           [](size_t begin, size_t) {
                             if (begin == 40) throw std::runtime_error("chunk 40");
                           }),
               std::runtime_error);
}

// A caller waiting for its chunks runs only those. Otherwise a thread inside an outer
// chunk (a StepBatch entry, holding that sequence's lock) could, while its nested loop waits,
// start another outer chunk whose lock is held by a thread doing the same: a deadlock. The
// test counts outer chunks started inside another on the same thread, with eight callers
// at once (whatever the cores: work to take is what makes the hazard).
TEST(ParallelForTest, AWaitingCallerRunsOnlyItsOwnChunks) {
  thread_local int depth = 0;
  std::atomic<int> nested{0}, outer{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&] {
      ParallelFor(16, 1, [&](size_t, size_t) {
        outer.fetch_add(1);
        if (++depth > 1) nested.fetch_add(1);
        ParallelFor(8, 1, [](size_t, size_t) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        });
        --depth;
      });
    });
  }
  for (std::thread& c : callers) c.join();
  EXPECT_EQ(outer.load(), 8 * 16);
  EXPECT_EQ(nested.load(), 0);
}

// Many loops at once from threads that come and go (as gRPC's do), each completes whole;
// and a chunk that throws fails its own loop only.
TEST(ParallelForTest, ConcurrentLoopsFromThreadsThatComeAndGo) {
  std::atomic<size_t> sum{0};
  std::atomic<int> thrown{0};
  for (int round = 0; round < 20; ++round) {
    std::vector<std::thread> callers;
    for (int t = 0; t < 6; ++t) {
      callers.emplace_back([&, t] {
        std::vector<int> seen(100);
        try {
          ParallelFor(100, 3, [&](size_t begin, size_t end) {
            if (t == 5 && begin == 51) throw std::runtime_error("chunk 51");
            for (size_t i = begin; i < end; ++i) seen[i] += 1;
          });
        } catch (const std::runtime_error&) {
          thrown.fetch_add(1);
          return;
        }
        for (int s : seen) sum.fetch_add(static_cast<size_t>(s));
      });
    }
    for (std::thread& c : callers) c.join();
  }
  EXPECT_EQ(sum.load(), 20u * 5 * 100);
  EXPECT_EQ(thrown.load(), 20);
}

TEST(StreamGrainTest, TasksOfUpTo32kSlots) {
  EXPECT_EQ(StreamGrain(0), 32768u);
  EXPECT_EQ(StreamGrain(257), 127u);  // SmolLM2's 90 streams: one task
  EXPECT_EQ(StreamGrain(4097), 7u);   // Llama-8B's 256 streams: 64 tasks of 4
  EXPECT_EQ(StreamGrain(100000), 1u);
}

}  // namespace
}  // namespace kvmem
