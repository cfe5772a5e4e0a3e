// simd_loops.h against the loops written one value at a time.
#include "server/common/simd_loops.h"

#include <cmath>
#include <cstring>
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

// Every format's infinities and NaNs (any sign, any payload) are found at every index and
// length around the 64-byte rounds; its largest finite values, subnormals and zeros pass.
TEST(FirstNonFiniteTest, FindsTheFirstInfOrNaNOfEachFormat) {
  struct Format {
    uint32_t bytes, exponent;
    std::vector<uint32_t> good, bad;
  };
  const Format formats[] = {
      {2,
       0x7c00,
       {0x0000, 0x8000, 0x7bff, 0xfbff, 0x0001, 0x3c00},
       {0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xffff}},
      {2,
       0x7f80,
       {0x0000, 0x8000, 0x7f7f, 0xff7f, 0x0001, 0x3f80},
       {0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff}},
      {4,
       0x7f800000,
       {0x00000000, 0x80000000, 0x7f7fffff, 0xff7fffff, 0x00000001, 0x3f800000},
       {0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffffffff}},
  };
  for (const Format& f : formats) {
    std::vector<size_t> lengths;
    for (size_t n = 0; n < 40; ++n) lengths.push_back(n);
    for (size_t n : {63, 64, 65, 127, 128, 129, 257}) lengths.push_back(n);
    for (size_t n : lengths) {
      std::vector<unsigned char> v(n * f.bytes);
      auto put = [&](std::vector<unsigned char>& to, size_t i, uint32_t value) {
        std::memcpy(to.data() + i * f.bytes, &value, f.bytes);
      };
      for (size_t j = 0; j < n; ++j) put(v, j, f.good[j % f.good.size()]);
      ASSERT_EQ(FirstNonFinite(v.data(), n, f.bytes, f.exponent), n) << "n " << n;
      for (size_t at = 0; at < n; ++at) {
        for (uint32_t b : f.bad) {
          std::vector<unsigned char> w = v;
          put(w, at, b);
          if (at + 3 < n) put(w, at + 3, b);  // a later bad value does not hide the first
          ASSERT_EQ(FirstNonFinite(w.data(), n, f.bytes, f.exponent), at)
              << "bytes " << f.bytes << " n " << n << " value " << b;
        }
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

}  // namespace
}  // namespace kvmem
