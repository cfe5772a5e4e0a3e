#pragma once
// One workload through two engines that must agree at every step: results, block tables
// and K/V. The device-step test runs it on device_step on/off; the GPU test on the CUDA
// backend against the CPU one.
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/engine/engine.h"
#include "tests/testing/payload.h"

namespace kvmem::engine::twins {

constexpr uint32_t kL = 4, kH = 2, kD = 8, kB = 16, kVocab = 1000;

struct Case {
  const char* policy;
  policy::ParamOverrides params;
  QuantConfig quant;
};

inline void PrintTo(const Case& c, std::ostream* os) { *os << c.policy; }

// Every policy with a kernel step, with and without quantization, intervals and pyramids.
inline std::vector<Case> Cases() {
  return {
      Case{"confkv", {{"c_high", 40}, {"c_low", 72}, {"protect", 8}}, {}},
      Case{"confkv", {{"c_high", 40}, {"c_low", 72}, {"protect", 8}, {"interval", 3}}, {}},
      Case{"confkv_l", {{"c_high", 48}, {"c_low", 96}, {"layer_floor", 24}, {"protect", 8}}, {}},
      Case{"confkv",
           {{"c_high", 40}, {"c_low", 72}, {"protect", 8}},
           {kernels::QuantType::kInt8, 32}},
      Case{"h2o", {{"budget", 64}, {"recent", 16}}, {}},
      Case{"h2o", {{"budget", 64}, {"recent", 16}, {"pyramid", 1}, {"beta", 4}}, {}},
      Case{"h2o", {{"budget", 64}}, {kernels::QuantType::kInt4, 24}}};
}

inline absl::Status Append(Engine& e, uint64_t id, int64_t first, uint32_t n) {
  const std::vector<int64_t> positions = testing::Range(first, n);
  const std::string k = testing::PayloadF16(kL * kH, first, n, kD, 0);
  const std::string v = testing::PayloadF16(kL * kH, first, n, kD, 1);
  AppendChunk chunk{positions, {}, k, v, {}, {}};
  return e.Append(id, absl::MakeConstSpan(&chunk, 1)).status();
}

inline std::vector<std::vector<float>> Rows(const BlockTable& table, std::mt19937& rng) {
  std::vector<std::vector<float>> rows;
  std::exponential_distribution<float> e(1.0f);
  for (const StreamTable& st : table.streams) {
    std::vector<float> row(st.positions.size());
    float sum = 0;
    for (float& a : row) sum += (a = e(rng));
    for (float& a : row) a /= sum;
    rows.push_back(std::move(row));
  }
  return rows;
}

inline std::vector<StreamSignal> Signals(const std::vector<std::vector<float>>& rows) {
  std::vector<StreamSignal> out;
  for (size_t s = 0; s < rows.size(); ++s) {
    out.push_back({static_cast<uint32_t>(s / kH), static_cast<uint32_t>(s % kH), rows[s]});
  }
  return out;
}

inline void ExpectSameTables(Engine& a, uint64_t ida, Engine& b, uint64_t idb,
                             const std::string& at) {
  const BlockTable ta = *a.GetBlockTable(ida), tb = *b.GetBlockTable(idb);
  ASSERT_EQ(ta.streams.size(), tb.streams.size());
  for (size_t s = 0; s < ta.streams.size(); ++s) {
    ASSERT_EQ(ta.streams[s].positions, tb.streams[s].positions) << at << " stream " << s;
    ASSERT_EQ(ta.streams[s].blocks.size(), tb.streams[s].blocks.size()) << at << " stream " << s;
  }
}

// Checks every stream's K and V against the values appended at its positions: bit-exact in
// layout-precision blocks; in quantized blocks within kernels/quantize.h's bound, |x - x_hat|
// <= s / 2 with s <= absmax / qmax (absmax of any value ever appended: 1000 / 64), plus the
// f16 rounding of the dequantized value. A slot read from the wrong position is off by ~2.
inline void ExpectContent(Engine& e, uint64_t id, std::optional<kernels::QuantType> quant) {
  const BlockTable table = *e.GetBlockTable(id);
  const float absmax = 1000.0f / 64.0f;
  const float step = quant == kernels::QuantType::kInt8 ? absmax / 127 : absmax / 7;
  const float bound = quant == kernels::QuantType::kNF4 ? absmax * 0.17f : step / 2 + 1e-2f;
  size_t streams = 0;
  absl::Status s = e.ReadKV(id, 0, 0, 0, [&](StreamKV&& kv) -> absl::Status {
    const uint32_t stream = kv.layer * kH + kv.kv_head;
    const StreamTable& st = table.streams[stream];
    size_t slot = 0;
    for (const TableBlock& b : st.blocks) {
      for (uint32_t j = 0; j < b.count; ++j, ++slot) {
        for (uint32_t d = 0; d < kD; ++d) {
          for (int plane = 0; plane < 2; ++plane) {
            const std::string& bytes = plane == 0 ? kv.k : kv.v;
            uint16_t h;
            std::memcpy(&h, bytes.data() + (slot * kD + d) * 2, 2);
            const float got = kernels::HalfToFloat(h);
            const float want =
                testing::ElementValue(stream, kv.positions[slot], d, static_cast<uint16_t>(plane));
            const bool exact = b.precision == Precision::kLayout;
            if (exact ? got != want : !(std::fabs(got - want) <= bound)) {
              ADD_FAILURE() << "stream " << stream << " slot " << slot << " position "
                            << kv.positions[slot] << " d " << d << ": " << got << " vs " << want
                            << (exact ? " (exact)" : " (quantized)");
              return absl::InternalError("content mismatch");
            }
          }
        }
      }
    }
    EXPECT_EQ(slot, kv.positions.size());
    ++streams;
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(streams, kL * kH);
}

// `a_engine` is checked against `b_engine` (the reference).
inline void RunTwinWorkload(Engine& a_engine, Engine& b_engine, const Case& c) {
  const Layout layout{kL, kH, kD, DType::kF16, kB, kVocab};
  const uint64_t d = a_engine.CreateSequence(layout, c.policy, c.params, c.quant, {})->sequence_id;
  const uint64_t h = b_engine.CreateSequence(layout, c.policy, c.params, c.quant, {})->sequence_id;
  std::mt19937 rng(7);
  ASSERT_TRUE(Append(a_engine, d, 0, 150).ok());
  ASSERT_TRUE(Append(b_engine, h, 0, 150).ok());

  // Prefill compression with window scores (host policy code on both sides).
  {
    const BlockTable table = *a_engine.GetBlockTable(d);
    const std::vector<std::vector<float>> window = Rows(table, rng);
    CompressInput in;
    in.window_scores = Signals(window);
    in.epoch = table.epoch;
    absl::StatusOr<CompressResult> rd = a_engine.Compress(d, in);
    in.epoch = b_engine.GetBlockTable(h)->epoch;
    absl::StatusOr<CompressResult> rh = b_engine.Compress(h, in);
    ASSERT_TRUE(rd.ok()) << rd.status();
    ASSERT_TRUE(rh.ok()) << rh.status();
    EXPECT_EQ(rd->evicted_tokens, rh->evicted_tokens);
    ExpectSameTables(a_engine, d, b_engine, h, "after compress");
  }

  uint64_t dc = 0, hc = 0;  // forks, stepped alongside from step 270 on
  uint64_t evicted = 0;
  std::set<uint32_t> budgets;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t t = 150; t < 450; ++t) {
    const std::string at = "step " + std::to_string(t);
    if (t == 270) {
      dc = a_engine.Fork(d, {})->sequence_id;
      hc = b_engine.Fork(h, {})->sequence_id;
    }
    for (auto [a, b] : {std::pair{d, h}, std::pair{dc, hc}}) {
      if (a == 0) continue;
      ASSERT_TRUE(Append(a_engine, a, t, 1).ok());
      ASSERT_TRUE(Append(b_engine, b, t, 1).ok());
      const BlockTable table = *a_engine.GetBlockTable(a);
      const std::vector<std::vector<float>> rows = Rows(table, rng);
      StepInput in;
      in.attention = Signals(rows);
      const float p1 = 0.05f + 0.9f * unit(rng);
      in.logits = RawLogitStats{unit(rng) * std::log(float(kVocab)), p1, p1 * unit(rng), {}};
      in.epoch = table.epoch;
      absl::StatusOr<StepResult> rd = a_engine.Step(a, in);
      in.epoch = b_engine.GetBlockTable(b)->epoch;
      absl::StatusOr<StepResult> rh = b_engine.Step(b, in);
      ASSERT_TRUE(rd.ok()) << at << ": " << rd.status();
      ASSERT_TRUE(rh.ok()) << at << ": " << rh.status();
      if (!std::isnan(rh->confidence)) {
        EXPECT_EQ(rd->confidence, rh->confidence) << at;
      }
      EXPECT_EQ(std::isnan(rd->confidence), std::isnan(rh->confidence)) << at;
      EXPECT_EQ(rd->budget_tokens, rh->budget_tokens) << at;
      EXPECT_EQ(rd->evicted_tokens, rh->evicted_tokens) << at;
      EXPECT_EQ(rd->quantized_tokens, rh->quantized_tokens) << at;
      EXPECT_EQ(rd->kv_bytes_after, rh->kv_bytes_after) << at;
      ExpectSameTables(a_engine, a, b_engine, b, at);
      evicted += rd->evicted_tokens;
      budgets.insert(rd->budget_tokens);
    }
  }
  EXPECT_GT(evicted, 1000u);  // the comparison is about evictions: there must be many
  if (std::string(c.policy).rfind("confkv", 0) == 0) {
    EXPECT_EQ(budgets.size(), 2u);  // both confidence regimes were exercised
  }
  ExpectContent(a_engine, d, c.quant.type);
  ExpectContent(a_engine, dc, c.quant.type);
  EXPECT_TRUE(a_engine.Release(d).ok());
  EXPECT_TRUE(a_engine.Release(dc).ok());
}

}  // namespace kvmem::engine::twins
