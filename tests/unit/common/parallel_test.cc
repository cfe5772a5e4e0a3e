// ParallelFor: every index once, in ranges of at most the grain, exceptions to the caller.
#include "server/common/parallel.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "oneapi/tbb/global_control.h"
#include "oneapi/tbb/task_arena.h"

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
// task (a StepBatch entry, holding that sequence's lock) could, while its nested loop waits,
// start another outer task whose lock is held by a thread doing the same: a deadlock. The
// test counts outer tasks started inside another on the same thread.
TEST(ParallelForTest, AWaitingCallerRunsOnlyItsOwnChunks) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ParallelFor runs serially under ThreadSanitizer";
#endif
  // Eight threads however many cores there are: work to steal is what makes the hazard.
  oneapi::tbb::global_control threads(oneapi::tbb::global_control::max_allowed_parallelism, 8);
  oneapi::tbb::task_arena arena(8);
  thread_local int depth = 0;
  std::atomic<int> nested{0};
  arena.execute([&] {
    oneapi::tbb::parallel_for(
        size_t{0}, size_t{64},
        [&](size_t) {
          if (++depth > 1) nested.fetch_add(1);
          ParallelFor(8, 1, [](size_t, size_t) {
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          });
          --depth;
        },
        oneapi::tbb::simple_partitioner());
  });
  EXPECT_EQ(nested.load(), 0);
}

TEST(StreamGrainTest, TasksOfUpTo32kSlots) {
  EXPECT_EQ(StreamGrain(0), 32768u);
  EXPECT_EQ(StreamGrain(257), 127u);  // SmolLM2's 90 streams: one task
  EXPECT_EQ(StreamGrain(4097), 7u);   // Llama-8B's 256 streams: 64 tasks of 4
  EXPECT_EQ(StreamGrain(100000), 1u);
}

}  // namespace
}  // namespace kvmem
