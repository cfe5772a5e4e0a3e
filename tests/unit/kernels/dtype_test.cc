#include "kernels/dtype.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace kvmem::kernels {
namespace {

// Every half bit pattern survives half -> float -> half (NaNs stay NaN); the float value
// matches the compiler's own _Float16 conversion.
TEST(DtypeTest, HalfRoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    _Float16 ref;
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&ref, &bits, 2);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref)));
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatBits(f), FloatBits(static_cast<float>(ref))) << h;
    ASSERT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(DtypeTest, FloatToHalfRoundsLikeTheCompiler) {
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const float f = BitsFloat(rng());
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &ref, 2);
    ASSERT_EQ(FloatToHalf(f), bits) << f;
  }
}

TEST(DtypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(DtypeTest, LoadStoreEveryType) {
  for (ElemType t : {ElemType::kF16, ElemType::kBF16, ElemType::kF32}) {
    uint8_t buf[16] = {};
    StoreElem(buf, 2, t, 1.5f);
    EXPECT_EQ(LoadElem(buf, 2, t), 1.5f);
  }
}

}  // namespace
}  // namespace kvmem::kernels
