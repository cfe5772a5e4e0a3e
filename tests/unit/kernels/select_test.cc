// Scoring and selection references (select.h) against oracles written the obvious way.
#include "kernels/select.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/select_oracle.h"

namespace kvmem::kernels {
namespace {

using ::testing::ElementsAre;

TEST(SelectTest, EmaAndAccumulateByHand) {
  std::vector<StreamSlice> streams = {{0, 3, 0, 0}, {3, 2, 0, 0}};
  std::vector<float> scores = {std::nanf(""), 1.0f, 0.5f, 2.0f, 0.0f};
  const std::vector<float> att = {0.25f, 0.5f, 0.25f, 1.0f, 3.0f};
  std::vector<float> mx(2);
  UpdateScoresRef(ScoreRule::kEma, 0.9f, streams.data(), 1, att.data(), scores.data(), mx.data());
  // NaN -> a; 0.9 * 1 + 0.1 * 0.5 = 0.95; 0.9 * 0.5 + 0.1 * 0.25 = 0.475.
  EXPECT_FLOAT_EQ(scores[0], 0.25f);
  EXPECT_FLOAT_EQ(scores[1], 0.95f);
  EXPECT_FLOAT_EQ(scores[2], 0.475f);
  EXPECT_FLOAT_EQ(mx[0], 0.95f);
  UpdateScoresRef(ScoreRule::kAccumulate, 0, streams.data() + 1, 1, att.data(), scores.data(),
                  mx.data() + 1);
  EXPECT_FLOAT_EQ(scores[3], 3.0f);
  EXPECT_FLOAT_EQ(scores[4], 3.0f);
  EXPECT_FLOAT_EQ(mx[1], 3.0f);
}

// Oracle: priorities by the formula, a full sort by (priority desc, index asc).
std::vector<uint8_t> OracleTop(const StreamSlice& st, const float* scores, float mx,
                               const int64_t* pos, float w) {
  return testing::OracleTopFlags(scores, pos, st.length, st.budget, st.protect, mx, w);
}

TEST(SelectTest, TopMatchesTheSortOracleOnRandomStreams) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<StreamSlice> streams;
    std::vector<float> scores, mx;
    std::vector<int64_t> positions;
    const uint32_t num = 1 + rng() % 6;
    for (uint32_t s = 0; s < num; ++s) {
      const uint32_t n = rng() % 300;
      // Every other stream is in the steady state of decoding: one slot over the budget.
      const uint32_t budget = s % 2 == 1 && n > 1 ? n - 1 : 1 + rng() % 200;
      streams.push_back(
          {static_cast<uint32_t>(scores.size()), n, budget, static_cast<uint32_t>(rng() % 40)});
      int64_t at = rng() % 5;
      float m = 0;
      for (uint32_t j = 0; j < n; ++j) {
        // Coarse values so that ties are common.
        scores.push_back(static_cast<float>(rng() % 8) / 8);
        m = std::max(m, scores.back());
        positions.push_back(at);
        at += 1 + rng() % 3;
      }
      mx.push_back(m);
    }
    const float w = trial % 3 == 0 ? 1.0f : 0.65f;
    const bool raw = trial % 4 == 1;  // no normalizer: max = 1 everywhere (H2O)
    std::vector<uint8_t> keep(scores.size(), 7);
    SelectTopRef(streams.data(), num, scores.data(), raw ? nullptr : mx.data(), positions.data(), w,
                 keep.data());
    for (uint32_t s = 0; s < num; ++s) {
      const StreamSlice& st = streams[s];
      const std::vector<uint8_t> want = OracleTop(st, scores.data() + st.offset, raw ? 1.0f : mx[s],
                                                  positions.data() + st.offset, w);
      ASSERT_EQ(
          std::vector<uint8_t>(keep.begin() + st.offset, keep.begin() + st.offset + st.length),
          want)
          << "trial " << trial << " stream " << s;
      const uint32_t kept = std::accumulate(want.begin(), want.end(), 0u);
      EXPECT_EQ(kept, std::min(st.length, st.budget));
    }
  }
}

// The score update at every length (the reference runs four slots at a time, then a scalar
// tail): each slot's value and the stream max bit for bit against the formulas written out
// slot by slot, with never-scored slots (NaN), zeros of both signs and ties.
TEST(SelectTest, UpdateMatchesTheFormulasAtEveryLength) {
  std::mt19937 rng(7);
  const float values[] = {0.0f, -0.0f, 0.125f, 0.5f, 1.0f, 3.0e-39f, 7.5f};
  for (uint32_t n = 0; n < 40; ++n) {
    for (const ScoreRule rule : {ScoreRule::kEma, ScoreRule::kAccumulate}) {
      std::vector<float> scores(n), att(n);
      for (uint32_t j = 0; j < n; ++j) {
        scores[j] = rule == ScoreRule::kEma && rng() % 3 == 0 ? std::nanf("") : values[rng() % 7];
        att[j] = values[rng() % 7];
      }
      std::vector<float> want = scores;
      float want_max = 0.0f;
      for (uint32_t j = 0; j < n; ++j) {
        if (rule == ScoreRule::kAccumulate) {
          want[j] = want[j] + att[j];
        } else if (std::isnan(want[j])) {
          want[j] = att[j];
        } else {
          const float decayed = 0.9f * want[j];
          const float fresh = (1.0f - 0.9f) * att[j];
          want[j] = decayed + fresh;
        }
        want_max = std::max(want_max, want[j]);
      }
      const StreamSlice slice{0, n, 0, 0};
      // Out of place first (the old scores stay), then in place.
      const std::vector<float> old = scores;
      std::vector<float> out(n, -1.0f);
      float out_max = -1.0f;
      UpdateScoresRef(rule, 0.9f, &slice, 1, att.data(), old.data(), out.data(), &out_max);
      float got_max = -1.0f;
      UpdateScoresRef(rule, 0.9f, &slice, 1, att.data(), scores.data(), &got_max);
      for (uint32_t j = 0; j < n; ++j) {
        ASSERT_EQ(FloatBits(scores[j]), FloatBits(want[j])) << "n " << n << " slot " << j;
        ASSERT_EQ(FloatBits(out[j]), FloatBits(want[j]))
            << "out of place, n " << n << " slot " << j;
      }
      ASSERT_EQ(FloatBits(got_max), FloatBits(want_max)) << "n " << n;
      ASSERT_EQ(FloatBits(out_max), FloatBits(want_max)) << "out of place, n " << n;
    }
  }
}

// The one-out steady state against the sort oracle where positions are far from zero
// (their low 32-bit words wrap) and where a stream spans more than 2^31 positions.
TEST(SelectTest, OneOutMatchesTheSortOracleForLargePositions) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 400; ++trial) {
    const uint32_t n = 2 + rng() % 70;
    const bool wide = trial % 2 == 1;
    std::vector<float> scores(n);
    std::vector<int64_t> positions(n);
    int64_t at = (int64_t{1} << 40) - static_cast<int64_t>(rng() % 1000);  // crosses 2^40
    float mx = 0;
    for (uint32_t j = 0; j < n; ++j) {
      scores[j] = static_cast<float>(rng() % 4) / 4;  // ties are common
      mx = std::max(mx, scores[j]);
      positions[j] = at;
      at += wide && rng() % 4 == 0 ? (int64_t{1} << 30) + rng() % 7 : 1 + rng() % 3;
    }
    const uint32_t protect = rng() % (n - 1);
    const float w = trial % 3 == 0 ? 1.0f : 0.65f;
    const StreamSlice slice{0, n, n - 1, protect};
    std::vector<uint8_t> keep(n, 7);
    SelectTopRef(&slice, 1, scores.data(), &mx, positions.data(), w, keep.data());
    const std::vector<uint8_t> want =
        testing::OracleTopFlags(scores.data(), positions.data(), n, n - 1, protect, mx, w);
    ASSERT_EQ(keep, want) << "trial " << trial;
    const uint32_t dropped =
        LowestPriorityRef(scores.data(), positions.data(), n, n - protect, mx, w);
    ASSERT_EQ(want[dropped], 0) << "trial " << trial;
    ASSERT_EQ(dropped,
              LowestPriorityPortable(scores.data(), positions.data(), n, n - protect, mx, w))
        << "trial " << trial;
  }
}

// LowestPriorityRef (eight lanes where the CPU has AVX2) and the four-lane path pick the same
// slot: over streams of every length up to a few hundred slots (full vectors and tails),
// with many ties, narrow and wide position spans, and scores the update left NaN.
TEST(SelectTest, LowestPriorityIsTheSameAtEveryVectorWidth) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no AVX2: one width only";
#else
  GTEST_SKIP() << "one width only off x86-64";
#endif
  std::mt19937 rng(17);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t n = 1 + rng() % 400;
    std::vector<float> scores(n);
    std::vector<int64_t> positions(n);
    int64_t at = trial % 3 == 0 ? -static_cast<int64_t>(rng() % 100) : rng() % 1000;
    float mx = 0;
    for (uint32_t j = 0; j < n; ++j) {
      scores[j] =
          trial % 5 == 0 && rng() % 50 == 0 ? std::nanf("") : static_cast<float>(rng() % 8) / 8;
      if (!std::isnan(scores[j])) mx = std::max(mx, scores[j]);
      positions[j] = at;
      at += trial % 4 == 1 && rng() % 8 == 0 ? (int64_t{1} << 31) : 1 + rng() % 3;
    }
    const uint32_t unprotected = 1 + rng() % n;
    const float w = trial % 2 == 0 ? 1.0f : 0.65f;
    const uint32_t dropped =
        LowestPriorityRef(scores.data(), positions.data(), n, unprotected, mx, w);
    ASSERT_EQ(dropped,
              LowestPriorityPortable(scores.data(), positions.data(), n, unprotected, mx, w))
        << "trial " << trial << ", " << n << " slots";
    if (trial % 5 != 0 && unprotected >= 2) {  // no NaN: against the sort oracle as well
      const uint32_t protect = n - unprotected;
      const std::vector<uint8_t> want =
          testing::OracleTopFlags(scores.data(), positions.data(), n, n - 1, protect, mx, w);
      ASSERT_EQ(want[dropped], 0) << "trial " << trial << ", " << n << " slots";
    }
  }
}

TEST(SelectTest, ThresholdKeepsProtectedTail) {
  std::vector<StreamSlice> streams = {{0, 5, 0, 2}};
  const std::vector<float> scores = {0.5f, 0.1f, 0.3f, 0.0f, 0.0f};
  const float threshold = 0.3f;
  std::vector<uint8_t> keep(5);
  SelectThresholdRef(streams.data(), 1, scores.data(), &threshold, keep.data());
  EXPECT_THAT(keep, ElementsAre(1, 0, 1, 1, 1));
}

TEST(SelectTest, CompactMovesKeptSlotsToTheFrontInOrder) {
  std::vector<StreamSlice> streams = {{0, 4, 0, 0}, {4, 3, 0, 0}};
  const std::vector<uint8_t> keep = {0, 1, 0, 1, 1, 1, 0};
  std::vector<float> scores = {0, 1, 2, 3, 4, 5, 6};
  std::vector<int64_t> positions = {10, 11, 12, 13, 20, 21, 22};
  std::vector<uint32_t> index(7, 99), kept(2);
  CompactSlotsRef(streams.data(), 2, keep.data(), scores.data(), positions.data(), index.data(),
                  kept.data());
  EXPECT_THAT(kept, ElementsAre(2, 2));
  EXPECT_THAT(std::vector<float>(scores.begin(), scores.begin() + 2), ElementsAre(1, 3));
  EXPECT_THAT(std::vector<int64_t>(positions.begin() + 4, positions.begin() + 6),
              ElementsAre(20, 21));
  EXPECT_EQ(index[0], 1u);
  EXPECT_EQ(index[1], 3u);
  EXPECT_EQ(index[4], 0u);
  EXPECT_EQ(index[5], 1u);
}

// The batched step's segments over two sequences' own arrays step, select and compact each
// stream exactly as the flat per-stream calls do, and leave the scores as they were in
// saved_scores, each slice where a later compaction reads it, the flags in the copy.
TEST(SelectTest, SegmentsOfSeveralSequencesMatchThePerStreamCalls) {
  std::mt19937 rng(17);
  struct Seq {
    std::vector<StreamSlice> slices;
    std::vector<float> scores, attention, saved;
    std::vector<int64_t> positions;
    std::vector<uint8_t> keep;
    std::vector<StreamSlice> slice_out;
  };
  std::vector<Seq> seqs(2);
  const uint32_t C = 50;  // capacity per stream, as a slot state lays them out
  for (Seq& q : seqs) {
    for (uint32_t s = 0; s < 3; ++s) {
      const uint32_t n = 10 + rng() % 40;
      q.slices.push_back({s * C, n, 20, 4});
    }
    q.scores.resize(3 * C);
    q.attention.resize(3 * C);
    q.positions.resize(3 * C);
    for (uint32_t j = 0; j < 3 * C; ++j) {
      q.scores[j] = static_cast<float>(rng() % 100) / 100;
      q.attention[j] = static_cast<float>(rng() % 100) / 100;
      q.positions[j] = 3 * (j % C) + 1;
    }
    q.saved.assign(3 * C, -1);
    q.keep.assign(3 * C, 9);
    q.slice_out.assign(3, StreamSlice{});
  }
  // A batch mixes policies: each segment has its own rule (confkv's, H2O's, an update-only
  // step of an interval).
  const ScoreStep ops[] = {{ScoreRule::kEma, 0.8f, 0.65f, true, true},
                           {ScoreRule::kAccumulate, 0.0f, 1.0f, false, true},
                           {ScoreRule::kEma, 0.5f, 0.65f, true, false}};
  auto op_of = [&](size_t i, size_t s) { return ops[(i + s) % 3]; };
  std::vector<StepSegment> segments;
  uint64_t copy_at = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq& q = seqs[i];
    for (size_t s = 0; s < q.slices.size(); ++s) {
      const StreamSlice sl = q.slices[s];
      segments.push_back({sl, op_of(i, s), q.attention.data() + sl.offset, q.scores.data(),
                          q.saved.data(), q.positions.data(), q.keep.data(), &q.slice_out[s],
                          copy_at});
      copy_at += sl.length;
    }
  }
  const std::vector<Seq> before = seqs;
  std::vector<Seq> want = seqs;
  std::vector<float> mx(segments.size());
  std::vector<uint8_t> copy(copy_at, 7);
  UpdateScoresSegmentsRef(segments.data(), static_cast<uint32_t>(segments.size()), mx.data());
  SelectTopSegmentsRef(segments.data(), static_cast<uint32_t>(segments.size()), mx.data(),
                       copy.data());
  size_t g = 0;
  uint64_t at = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq& w = want[i];
    std::vector<float> wmx(3);
    for (size_t s = 0; s < 3; ++s) {
      const ScoreStep op = op_of(i, s);
      UpdateScoresRef(op.rule, op.lambda, &w.slices[s], 1, w.attention.data(), w.scores.data(),
                      &wmx[s]);
      if (op.select) {
        SelectTopRef(&w.slices[s], 1, w.scores.data(), op.normalize ? &wmx[s] : nullptr,
                     w.positions.data(), op.attention_weight, w.keep.data());
      }
    }
    for (size_t s = 0; s < 3; ++s, ++g) {
      const StreamSlice sl = w.slices[s];
      EXPECT_EQ(mx[g], wmx[s]);
      EXPECT_EQ(seqs[i].slice_out[s].offset, sl.offset);
      EXPECT_EQ(seqs[i].slice_out[s].length, sl.length);
      for (uint32_t j = 0; j < sl.length; ++j) {
        EXPECT_EQ(seqs[i].scores[sl.offset + j], w.scores[sl.offset + j]);
        EXPECT_EQ(seqs[i].saved[sl.offset + j], before[i].scores[sl.offset + j]);
        EXPECT_EQ(seqs[i].keep[sl.offset + j], w.keep[sl.offset + j]);
        EXPECT_EQ(copy[at + j], op_of(i, s).select ? w.keep[sl.offset + j] : 7);
      }
      at += sl.length;
    }
  }
  // Compaction by segments equals CompactSlotsRef per sequence.
  std::vector<CompactSegment> compact;
  std::vector<std::vector<uint32_t>> index(seqs.size(), std::vector<uint32_t>(3 * C));
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (const StreamSlice& sl : seqs[i].slices) {
      compact.push_back({sl, seqs[i].keep.data(), seqs[i].scores.data(), seqs[i].positions.data(),
                         index[i].data()});
    }
  }
  std::vector<uint32_t> kept(compact.size());
  CompactSlotsSegmentsRef(compact.data(), static_cast<uint32_t>(compact.size()), kept.data());
  g = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<uint32_t> windex(3 * C), wkept(3);
    CompactSlotsRef(want[i].slices.data(), 3, want[i].keep.data(), want[i].scores.data(),
                    want[i].positions.data(), windex.data(), wkept.data());
    for (size_t s = 0; s < 3; ++s, ++g) {
      ASSERT_EQ(kept[g], wkept[s]);
      const uint32_t off = want[i].slices[s].offset;
      for (uint32_t r = 0; r < kept[g]; ++r) {
        EXPECT_EQ(index[i][off + r], windex[off + r]);
        EXPECT_EQ(seqs[i].positions[off + r], want[i].positions[off + r]);
        EXPECT_EQ(seqs[i].scores[off + r], want[i].scores[off + r]);
      }
    }
  }
}

}  // namespace
}  // namespace kvmem::kernels
