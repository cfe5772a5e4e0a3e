// simd_loops.h against the loops written one value at a time.
#include "server/common/simd_loops.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem {
namespace {

TEST(FirstOutsideTest, FindsTheFirstBadValueAtEveryIndexAndLength) {
  const float bad[] = {std::nanf(""),
                       -std::nanf(""),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       -1e-30f,
                       2.5f};
  std::vector<size_t> lengths;  // around the 64-value rounds and the scalar tail
  for (size_t n = 0; n < 40; ++n) lengths.push_back(n);
  for (size_t n : {63, 64, 65, 127, 128, 129, 257}) lengths.push_back(n);
  for (size_t n : lengths) {
    std::vector<float> v(n, 0.5f);
    for (size_t j = 0; j < n; ++j) v[j] = j % 3 == 0 ? -0.0f : (j % 3 == 1 ? 2.0f : 0.0f);
    ASSERT_EQ(FirstOutside(v.data(), n, 0.0f, 2.0f), n) << "n " << n;  // -0 and the bounds pass
    for (size_t at = 0; at < n; ++at) {
      for (float b : bad) {
        std::vector<float> w = v;
        w[at] = b;
        if (at + 2 < n) w[at + 2] = b;  // a later bad value does not hide the first
        ASSERT_EQ(FirstOutside(w.data(), n, 0.0f, 2.0f), at) << "n " << n << " value " << b;
      }
    }
  }
}

TEST(FirstOutsideTest, InfiniteBoundsStillRejectInfAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v(100, -1e30f);
  EXPECT_EQ(FirstOutside(v.data(), v.size(), -inf, inf), v.size());
  v[70] = inf;
  EXPECT_EQ(FirstOutside(v.data(), v.size(), -inf, inf), 70u);
  v[10] = std::nanf("");
  EXPECT_EQ(FirstOutside(v.data(), v.size(), -inf, 0.0f), 10u);
}

TEST(FillAscendingTest, WritesTheRunAndNothingElse) {
  for (uint32_t count = 0; count < 20; ++count) {
    std::vector<uint32_t> out(count + 2, 7);
    FillAscending(out.data() + 1, 1000, count);
    EXPECT_EQ(out.front(), 7u);
    EXPECT_EQ(out.back(), 7u);
    for (uint32_t i = 0; i < count; ++i) ASSERT_EQ(out[1 + i], 1000 + i);
  }
}

TEST(AscendingBelowTest, RejectsEveryOutOfOrderPairAndEveryValueAtTheBound) {
  for (size_t n = 0; n < 24; ++n) {
    std::vector<uint32_t> v(n);
    // Around 2^31 (a signed compare would misorder them) and up to the largest bound.
    for (size_t j = 0; j < n; ++j) v[j] = static_cast<uint32_t>((1u << 31) - 12 + 3 * j);
    if (n > 0 && n % 2 == 0) v.back() = UINT32_MAX - 1;
    const uint32_t bound = n == 0 ? 0 : v.back() + 1;
    ASSERT_TRUE(AscendingBelow(v.data(), n, bound)) << "n " << n;
    if (n > 0) ASSERT_FALSE(AscendingBelow(v.data(), n, bound - 1)) << "n " << n;
    for (size_t at = 1; at < n; ++at) {
      for (uint32_t back : {0u, 1u}) {  // equal to its left neighbour, or below it
        std::vector<uint32_t> w = v;
        w[at] = w[at - 1] - back;
        ASSERT_FALSE(AscendingBelow(w.data(), n, bound)) << "n " << n << " at " << at;
      }
    }
  }
}

}  // namespace
}  // namespace kvmem
