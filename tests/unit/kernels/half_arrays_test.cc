// half_arrays.h's loops (the four-lane one everywhere, the F16C one where the CPU has it, and
// the entry points that choose) against the scalar twins in dtype.h, bit for bit.
#include "kernels/half_arrays.h"

#include <algorithm>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace kvmem::kernels {
namespace {

using Widen = void (*)(const void*, size_t, float*);
using Narrow = void (*)(const float*, size_t, void*);

struct Loops {
  std::string name;
  Widen widen;
  Narrow narrow;
};

void PrintTo(const Loops& loops, std::ostream* os) { *os << loops.name; }

std::vector<Loops> AllLoops() {
  std::vector<Loops> loops = {{"Lanes", HalfToFloatLanes, FloatToHalfLanes},
                              {"Chosen", HalfToFloat, FloatToHalf}};
#if defined(__x86_64__)
  if (HasF16c()) loops.push_back({"F16c", HalfToFloatF16c, FloatToHalfF16c});
#endif
  return loops;
}

class HalfArraysTest : public testing::TestWithParam<Loops> {};

INSTANTIATE_TEST_SUITE_P(Loops, HalfArraysTest, testing::ValuesIn(AllLoops()),
                         [](const testing::TestParamInfo<Loops>& info) { return info.param.name; });

TEST_P(HalfArraysTest, EveryHalfWidensAsTheScalarTwinAtEveryOffset) {
  // All 65,536 halves (zeros, subnormals, normals, infinities, quiet and signaling NaNs),
  // from every byte offset mod 8 and with every tail length.
  std::vector<uint16_t> all(1 << 16);
  for (uint32_t h = 0; h < all.size(); ++h) all[h] = static_cast<uint16_t>(h);
  std::vector<char> unaligned(2 * all.size() + 8);
  for (size_t shift = 0; shift < 8; ++shift) {
    std::memcpy(unaligned.data() + shift, all.data(), 2 * all.size());
    for (size_t tail = 0; tail < 8; ++tail) {  // every remainder of 4 and of 8
      const size_t n = all.size() - tail;
      std::vector<float> got(n + 1, 7.0f);
      GetParam().widen(unaligned.data() + shift, n, got.data());
      for (size_t i = 0; i < n; ++i) {
        const uint32_t want = FloatBits(HalfToFloat(all[i]));
        ASSERT_EQ(FloatBits(got[i]), want) << "half " << i << " shift " << shift;
      }
      ASSERT_EQ(got[n], 7.0f) << "wrote past the end";
    }
  }
}

// Floats where the narrowing changes its rule or rounds: every half's exact value and its
// neighbours, the midpoints between consecutive halves and theirs (ties go to even), both
// signs; every NaN class; and a stride through all 2^32 bit patterns.
std::vector<uint32_t> NarrowingCases() {
  std::vector<uint32_t> bits;
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const uint32_t exact = FloatBits(HalfToFloat(static_cast<uint16_t>(h)));
    const uint32_t next = FloatBits(HalfToFloat(static_cast<uint16_t>(h + 1)));
    const uint32_t mid = FloatBits((BitsFloat(exact) + BitsFloat(next)) / 2);  // exact in f32
    for (uint32_t b : {exact, mid}) {
      for (int d = -2; d <= 2; ++d) bits.push_back(b + static_cast<uint32_t>(d));
    }
  }
  for (uint32_t b :
       {0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, 0x33000000u, 0x33000001u, 0x337fffffu,
        0x387fffffu, 0x38800000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u, 0x7f7fffffu,
        0x7f800000u, 0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0x7fffffffu}) {
    bits.push_back(b);
  }
  for (uint64_t b = 0; b <= 0xffffffffu; b += 65521) bits.push_back(static_cast<uint32_t>(b));
  const size_t positive = bits.size();
  for (size_t i = 0; i < positive; ++i) bits.push_back(bits[i] ^ 0x80000000u);
  return bits;
}

TEST_P(HalfArraysTest, NarrowsAsTheScalarTwinAtEveryOffsetAndTail) {
  const std::vector<uint32_t> bits = NarrowingCases();
  std::vector<float> values(bits.size());
  std::memcpy(values.data(), bits.data(), 4 * bits.size());
  std::vector<char> out(2 * values.size() + 8);
  for (size_t shift = 0; shift < 4; ++shift) {
    for (size_t tail = 0; tail < 8; ++tail) {  // every remainder of 4 and of 8
      const size_t n = values.size() - tail;
      std::fill(out.begin(), out.end(), '\x5a');
      GetParam().narrow(values.data(), n, out.data() + shift);
      for (size_t i = 0; i < n; ++i) {
        uint16_t got;
        std::memcpy(&got, out.data() + shift + 2 * i, 2);
        ASSERT_EQ(got, FloatToHalf(values[i]))
            << std::hex << "float bits 0x" << bits[i] << " shift " << shift;
      }
      ASSERT_EQ(out[shift + 2 * n], '\x5a') << "wrote past the end";
      ASSERT_EQ(out[shift + 2 * n + 1], '\x5a') << "wrote past the end";
    }
  }
}

// The lanes of one call and the tail each convert their own value: a special value in any
// lane leaves its neighbours as they would be alone.
TEST_P(HalfArraysTest, LanesAreIndependent) {
  const float specials[] = {BitsFloat(0x7fc00001u), BitsFloat(0xff800000u), 1e-7f, 65520.0f, -0.0f};
  for (size_t n = 1; n <= 17; ++n) {
    for (size_t at = 0; at < n; ++at) {
      for (float special : specials) {
        std::vector<float> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = 0.1f * static_cast<float>(i + 1);
        v[at] = special;
        std::vector<uint16_t> got(n);
        GetParam().narrow(v.data(), n, got.data());
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], FloatToHalf(v[i])) << n << " " << at;
      }
    }
  }
}

#if defined(__x86_64__)
// A process may run with subnormals flushed (MXCSR's FTZ and DAZ; some BLAS and inference
// libraries set them): the conversions still give the twins' values, subnormal halves
// included.
TEST_P(HalfArraysTest, SubnormalHalvesSurviveFlushToZero) {
  const unsigned int saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
  std::vector<uint16_t> halves;
  for (uint32_t h = 0; h < 0x0400; h += 3) {
    halves.push_back(static_cast<uint16_t>(h));
    halves.push_back(static_cast<uint16_t>(h | 0x8000));
  }
  std::vector<float> wide(halves.size());
  GetParam().widen(halves.data(), halves.size(), wide.data());
  std::vector<uint16_t> back(halves.size());
  GetParam().narrow(wide.data(), wide.size(), back.data());
  _mm_setcsr(saved);
  for (size_t i = 0; i < halves.size(); ++i) {
    ASSERT_EQ(FloatBits(wide[i]), FloatBits(HalfToFloat(halves[i]))) << std::hex << halves[i];
    ASSERT_EQ(back[i], halves[i]) << std::hex << halves[i];
  }
}
#endif

}  // namespace
}  // namespace kvmem::kernels
