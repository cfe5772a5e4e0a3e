// The quantize/dequantize reference: error bounds, the nf4 code set, layouts.
#include "kernels/quantize.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem::kernels {
namespace {

struct Plane {
  std::vector<float> x;  // [B][D] f32
};

std::vector<float> Gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng);
  return x;
}

// Mean relative error ||x - x_hat|| / ||x|| over many blocks, both planes.
double RoundTripError(QuantType type, uint32_t B, uint32_t D, ElemType elem) {
  const QuantGeometry g{type, B, D};
  double err2 = 0, norm2 = 0;
  for (uint32_t seed = 0; seed < 50; ++seed) {
    std::vector<float> x = Gaussian(2ull * B * D, seed);
    std::vector<uint8_t> src(2ull * B * D * ElemBytes(elem));
    for (size_t i = 0; i < x.size(); ++i) {
      StoreElem(src.data(), i, elem, x[i]);
      x[i] = LoadElem(src.data(), i, elem);  // the value the cache actually held
    }
    std::vector<uint8_t> block(g.block_bytes());
    QuantizeBlockRef(src.data(), elem, g, 0, B, block.data());
    std::vector<uint8_t> k(uint64_t{B} * D * ElemBytes(ElemType::kF32)), v(k.size());
    DequantizeBlockRef(block.data(), g, 0, B, ElemType::kF32, k.data(), v.data());
    for (size_t i = 0; i < uint64_t{B} * D; ++i) {
      const float kh = LoadElem(k.data(), i, ElemType::kF32);
      const float vh = LoadElem(v.data(), i, ElemType::kF32);
      err2 += std::pow(kh - x[i], 2) + std::pow(vh - x[uint64_t{B} * D + i], 2);
      norm2 += std::pow(x[i], 2) + std::pow(x[uint64_t{B} * D + i], 2);
    }
  }
  return std::sqrt(err2 / norm2);
}

TEST(QuantizeTest, Int8RelativeErrorBelowHalfAPercentOnGaussianData) {
  for (ElemType elem : {ElemType::kF32, ElemType::kF16, ElemType::kBF16}) {
    const double e = RoundTripError(QuantType::kInt8, 16, 64, elem);
    EXPECT_LT(e, 0.005) << static_cast<int>(elem);
    std::printf("int8 relative error %.4f%%\n", 100 * e);
  }
}

TEST(QuantizeTest, Int4AndNf4ErrorsAreOrdered) {
  const double int8 = RoundTripError(QuantType::kInt8, 16, 64, ElemType::kF32);
  const double int4 = RoundTripError(QuantType::kInt4, 16, 64, ElemType::kF32);
  const double nf4 = RoundTripError(QuantType::kNF4, 16, 64, ElemType::kF32);
  std::printf("relative error: int8 %.3f%%, int4 %.2f%%, nf4 %.2f%%\n", 100 * int8, 100 * int4,
              100 * nf4);
  EXPECT_LT(int8, int4);
  EXPECT_LT(nf4, 0.15);
  EXPECT_LT(int4, 0.25);
}

TEST(QuantizeTest, PerElementBoundIsHalfAStep) {
  const QuantGeometry g{QuantType::kInt8, 16, 24};
  std::vector<float> x = Gaussian(2 * 16 * 24, 9);
  std::vector<uint8_t> block(g.block_bytes());
  QuantizeBlockRef(reinterpret_cast<const uint8_t*>(x.data()), ElemType::kF32, g, 3, 10,
                   block.data());
  std::vector<float> k(10 * 24), v(10 * 24);
  DequantizeBlockRef(block.data(), g, 3, 10, ElemType::kF32, k.data(), v.data());
  for (uint32_t c = 0; c < 24; ++c) {
    float absmax = 0;
    for (uint32_t t = 3; t < 13; ++t) absmax = std::max(absmax, std::fabs(x[t * 24 + c]));
    for (uint32_t t = 3; t < 13; ++t) {
      EXPECT_LE(std::fabs(k[(t - 3) * 24 + c] - x[t * 24 + c]), absmax / 254 * (1 + 1e-5));
    }
  }
}

TEST(QuantizeTest, Nf4UsesExactlyTheSixteenCodes) {
  const QuantGeometry g{QuantType::kNF4, 16, 64};
  // One row spanning [-1, 1] hits every code; scale is the absmax (1).
  std::vector<float> x(2 * 16 * 64, 0.0f);
  for (uint32_t t = 0; t < 16; ++t) {
    for (uint32_t c = 0; c < 64; ++c) x[t * 64 + c] = -1.0f + 2.0f * ((t * 64 + c) % 97) / 96.0f;
  }
  std::vector<uint8_t> block(g.block_bytes());
  QuantizeBlockRef(reinterpret_cast<const uint8_t*>(x.data()), ElemType::kF32, g, 0, 16,
                   block.data());
  std::vector<float> k(16 * 64), v(16 * 64);
  DequantizeBlockRef(block.data(), g, 0, 16, ElemType::kF32, k.data(), v.data());
  // Every decoded value is absmax * one of the 16 codes, and all 16 occur.
  std::set<int> seen;
  for (uint32_t t = 0; t < 16; ++t) {
    float absmax = 0;
    for (uint32_t c = 0; c < 64; ++c) absmax = std::max(absmax, std::fabs(x[t * 64 + c]));
    for (uint32_t c = 0; c < 64; ++c) {
      int match = -1;
      for (int q = 0; q < 16; ++q) {
        if (k[t * 64 + c] == kNf4Codes[q] * absmax) match = q;
      }
      ASSERT_GE(match, 0) << k[t * 64 + c];
      seen.insert(match);
    }
  }
  EXPECT_EQ(seen.size(), 16u);
  // V (all zeros) decodes to exactly zero.
  for (float vv : v) EXPECT_EQ(vv, 0.0f);
}

// NaN and +-Inf in a block (an f16 overflow in the model): the other values decode exactly
// as without them, NaN decodes to 0, +-Inf to +-(the largest code) times the scale of the
// finite values. Before this rule an Inf made its channel's scale Inf and every other value
// of the channel decoded to NaN, and a NaN's code was an undefined float-to-int cast (the
// GPU and the CPU disagreed).
TEST(QuantizeTest, NonFiniteValuesStayInTheirSlot) {
  constexpr uint32_t B = 16, D = 80;
  const float inf = std::numeric_limits<float>::infinity();
  struct Odd {
    uint32_t plane, t, c;
    float x;
  };
  // NaN and +Inf in one K channel, -Inf in a V channel, and a V channel of nothing but Inf
  // (its scale is 0: all of it decodes to 0).
  std::vector<Odd> odd = {
      {0, 3, 5, std::nanf("")}, {0, 7, 5, inf}, {1, 2, 70, -inf}, {1, 9, 0, inf}};
  for (uint32_t t = 0; t < B; ++t) odd.push_back({1, t, 33, t % 2 ? inf : -inf});
  for (QuantType type : {QuantType::kInt8, QuantType::kInt4, QuantType::kNF4}) {
    for (ElemType elem : {ElemType::kF32, ElemType::kF16, ElemType::kBF16}) {
      SCOPED_TRACE(testing::Message() << "type " << int(type) << " elem " << int(elem));
      const QuantGeometry g{type, B, D};
      std::vector<float> x = Gaussian(2ull * B * D, 5);
      std::vector<uint8_t> clean(x.size() * ElemBytes(elem)), src(clean.size());
      for (size_t i = 0; i < x.size(); ++i) StoreElem(clean.data(), i, elem, x[i]);
      src = clean;
      for (const Odd& o : odd) {
        const uint64_t i = (uint64_t{o.plane} * B + o.t) * D + o.c;
        StoreElem(src.data(), i, elem, o.x);
        StoreElem(clean.data(), i, elem, 0.0f);  // contributes nothing to a scale either
      }
      std::vector<uint8_t> block(g.block_bytes()), clean_block(g.block_bytes());
      QuantizeBlockRef(src.data(), elem, g, 0, B, block.data());
      QuantizeBlockRef(clean.data(), elem, g, 0, B, clean_block.data());
      std::vector<float> out(2 * B * D), clean_out(2 * B * D);
      DequantizeBlockRef(block.data(), g, 0, B, ElemType::kF32, out.data(), out.data() + B * D);
      DequantizeBlockRef(clean_block.data(), g, 0, B, ElemType::kF32, clean_out.data(),
                         clean_out.data() + B * D);
      for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << i;
      for (const Odd& o : odd) {
        const uint64_t i = (uint64_t{o.plane} * B + o.t) * D + o.c;
        float expected = 0;
        if (!std::isnan(o.x)) {
          // The scale over the finite values: the channel (int8/int4) or the slot's group of
          // 64 (nf4), from the values the block held.
          float absmax = 0;
          for (uint32_t t = 0; t < B; ++t) {
            for (uint32_t c = 0; c < D; ++c) {
              const bool same = type == QuantType::kNF4 ? t == o.t && c / 64 == o.c / 64 : c == o.c;
              const uint64_t j = (uint64_t{o.plane} * B + t) * D + c;
              if (same) absmax = std::max(absmax, std::fabs(LoadElem(clean.data(), j, elem)));
            }
          }
          const float qmax = type == QuantType::kInt8 ? 127.0f : 7.0f;
          expected = type == QuantType::kNF4 ? absmax : qmax * (absmax / qmax);
          if (o.x < 0) expected = -expected;
        }
        EXPECT_EQ(out[i], expected) << "plane " << o.plane << " slot " << o.t << " channel " << o.c;
        out[i] = clean_out[i] = 0;
      }
      EXPECT_EQ(out, clean_out);
    }
  }
}

TEST(QuantizeTest, GeometryKeepsScalesAligned) {
  for (QuantType t : {QuantType::kInt8, QuantType::kInt4, QuantType::kNF4}) {
    for (uint32_t d : {1u, 3u, 64u, 100u, 128u}) {
      const QuantGeometry g{t, 16, d};
      EXPECT_EQ(g.k_scales_offset() % 16, 0u);
      EXPECT_EQ(g.v_scales_offset() % 4, 0u);
      EXPECT_GT(g.block_bytes(), 2 * g.codes_bytes() - 1);
    }
  }
  // int8 at D = 128, B = 16: 2 x 2048 codes + 2 x 512 scale bytes.
  EXPECT_EQ((QuantGeometry{QuantType::kInt8, 16, 128}.block_bytes()), 5120u);
}

}  // namespace
}  // namespace kvmem::kernels
