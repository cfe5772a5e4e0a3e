// KeepSet against the slot lists it stands for.
#include "server/common/keep_set.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmem {
namespace {

using ::testing::ElementsAre;

TEST(KeepSetTest, RunsAreMaximalAndIterateAsTheSlots) {
  std::mt19937 rng(3);
  for (int round = 0; round < 2000; ++round) {
    const uint32_t n = rng() % 200;
    const uint32_t drop_one_in = 1 + rng() % 6;
    std::vector<uint32_t> slots;
    for (uint32_t j = 0; j < n; ++j) {
      if (rng() % drop_one_in != 0) slots.push_back(j);
    }
    const KeepSet set = KeepSet::FromSlots(slots);
    ASSERT_EQ(set.size(), slots.size());
    ASSERT_EQ(set.Slots(), slots);
    ASSERT_EQ(std::vector<uint32_t>(set.begin(), set.end()), slots);
    ASSERT_TRUE(set.ValidFor(n));
    if (!slots.empty()) {
      ASSERT_FALSE(set.ValidFor(slots.back()));  // the last slot is out
    }
    size_t runs = 0;  // one run per kept slot whose predecessor is not kept
    for (size_t i = 0; i < slots.size(); ++i) runs += i == 0 || slots[i - 1] + 1 != slots[i];
    ASSERT_EQ(set.runs().size(), runs);
    // Built run by run, the same set.
    KeepSet by_runs;
    for (const SlotRun& r : set.runs()) by_runs.AddRun(r.begin, r.end);
    ASSERT_EQ(by_runs, set);
  }
}

TEST(KeepSetTest, OutOfOrderRepeatedOrUnrepresentableSlotsAreInvalid) {
  EXPECT_FALSE(KeepSet::FromSlots(std::vector<uint32_t>{2, 1}).ValidFor(10));
  EXPECT_FALSE(KeepSet::FromSlots(std::vector<uint32_t>{1, 1}).ValidFor(10));
  EXPECT_FALSE(KeepSet::FromSlots(std::vector<uint32_t>{0, 1, 2, 1}).ValidFor(10));
  EXPECT_FALSE(KeepSet::FromSlots(std::vector<uint32_t>{UINT32_MAX}).ValidFor(SIZE_MAX));
  KeepSet reversed = KeepSet::Range(0, 2);
  reversed.AddRun(9, 5);  // a caller's arithmetic gone wrong: not a smaller set
  EXPECT_FALSE(reversed.ValidFor(10));
  KeepSet overlapping = KeepSet::Range(0, 5);
  overlapping.AddRun(3, 8);
  EXPECT_FALSE(overlapping.ValidFor(10));
  EXPECT_TRUE(KeepSet().ValidFor(0));  // keeps nothing: valid for any stream
  EXPECT_TRUE(KeepSet::Range(4, 4).empty());
  EXPECT_THAT(KeepSet::Range(7, 10), ElementsAre(7, 8, 9));
  KeepSet two = KeepSet::Range(0, 2);
  two.AddRun(2, 4);  // touching: one run
  two.AddRun(6, 7);
  EXPECT_EQ(two.runs().size(), 2u);
  EXPECT_THAT(two, ElementsAre(0, 1, 2, 3, 6));
}

}  // namespace
}  // namespace kvmem
