// The engine's counters and histograms: Prometheus `le` buckets, fractional counters, and
// the attention mass of the slots a keep-set leaves out.
#include "server/engine/telemetry.h"

#include <cmath>
#include <random>
#include <thread>

#include "gtest/gtest.h"

namespace kvmem::engine {
namespace {

TEST(TelemetryTest, AHistogramBucketsByLessOrEqual) {
  Histogram h({1, 2, 4});
  for (double v : {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 9.0}) h.Observe(v);
  h.Observe(std::nan(""));  // nothing measured
  const Histogram::Snapshot s = h.Read();
  EXPECT_EQ(s.counts, (std::vector<uint64_t>{2, 2, 2, 1}));  // le=1, le=2, le=4, +Inf
  EXPECT_EQ(s.count, 7u);
  EXPECT_DOUBLE_EQ(s.sum, 21.0);
}

TEST(TelemetryTest, ConcurrentObservationsAreAllCounted) {
  Histogram h(LatencyBounds());
  FractionalCounter c;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        h.Observe(0.5);
        c.Add(0.25);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(h.Read().count, 40000u);
  EXPECT_DOUBLE_EQ(h.Read().sum, 20000.0);
  EXPECT_DOUBLE_EQ(c.Read(), 10000.0);
}

TEST(TelemetryTest, EvictedMassIsTheWeightOutsideTheKeepSet) {
  const std::vector<float> row = {0.1f, 0.2f, 0.3f, 0.4f};
  EXPECT_NEAR(EvictedMass(row, KeepSet::FromSlots(std::vector<uint32_t>{1, 3})), 0.4, 1e-6);
  EXPECT_NEAR(EvictedMass(row, KeepSet::FromSlots(std::vector<uint32_t>{})), 1.0, 1e-6);
  EXPECT_NEAR(EvictedMass(row, KeepSet::FromSlots(std::vector<uint32_t>{0, 1, 2, 3})), 0.0, 1e-6);
}

// The gap walk against the definition: every slot of the row not named by the keep-set, summed
// in slot order (so the sums are equal to the bit), over keep-sets with runs and gaps of every
// length, at either end, and entries past the row.
TEST(TelemetryTest, EvictedMassWalksTheGapsAsEverySlotWould) {
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    std::vector<float> row(rng() % 300);
    for (float& w : row) w = std::uniform_real_distribution<float>(0, 1)(rng);
    std::vector<uint32_t> keep;
    const uint32_t drop_one_in = 1 + rng() % 40;
    const size_t past = row.size() + rng() % 3;  // keep-sets may name slots past the row
    for (uint32_t i = 0; i < past; ++i) {
      if (rng() % drop_one_in != 0) keep.push_back(i);
    }
    double expected = 0;
    size_t k = 0;
    for (size_t i = 0; i < row.size(); ++i) {
      if (k < keep.size() && keep[k] == i) {
        ++k;
      } else {
        expected += row[i];
      }
    }
    ASSERT_EQ(EvictedMass(row, KeepSet::FromSlots(keep)), expected) << "round " << round;
  }
}

TEST(TelemetryTest, EveryRegisteredPolicyHasItsEntry) {
  Telemetry t({"full", "confkv"});
  ASSERT_NE(t.For("confkv"), nullptr);
  EXPECT_EQ(t.For("confkv")->policy, "confkv");
  EXPECT_EQ(t.For("nope"), nullptr);
}

}  // namespace
}  // namespace kvmem::engine
