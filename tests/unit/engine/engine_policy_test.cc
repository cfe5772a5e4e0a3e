// Policies and quantization through the engine: random keep-sets keep retained K/V
// bit-exact and in order; quantized codes never re-round however many compactions follow.
#include <cmath>
#include <map>
#include <random>

#include "gmock/gmock.h"
#include "tests/testing/engine_twins.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

// Attention rows for every stream over its current slots: random, normalized.
std::vector<std::vector<float>> RandomRows(Engine& engine, uint64_t id, std::mt19937& rng,
                                           uint64_t* epoch) {
  const BlockTable table = *engine.GetBlockTable(id);
  *epoch = table.epoch;
  return twins::Rows(table, rng);
}

StepInput RowsInput(const std::vector<std::vector<float>>& rows, uint64_t epoch, uint32_t H) {
  StepInput input;
  input.epoch = epoch;
  input.logits = RawLogitStats{1.0f, 0.5f, 0.2f, {}};
  for (size_t s = 0; s < rows.size(); ++s) {
    input.attention.push_back(
        {static_cast<uint32_t>(s / H), static_cast<uint32_t>(s % H), rows[s]});
  }
  return input;
}

TEST_F(EngineTest, RandomEvictionsKeepRetainedKvBitExactAndInOrder) {
  for (const char* name : {"h2o", "confkv"}) {
    const uint64_t id = std::string(name) == "h2o"
                            ? Create("h2o", {{"budget", 40}, {"recent", 8}})
                            : Create("confkv", {{"c_high", 24}, {"c_low", 40}, {"protect", 4}});
    std::mt19937 rng(42);
    ASSERT_TRUE(AppendRange(id, 0, 64).ok());
    for (int64_t t = 64; t < 400; ++t) {
      uint64_t epoch;
      const auto rows = RandomRows(*engine_, id, rng, &epoch);
      auto step = engine_->Step(id, RowsInput(rows, epoch, kH));
      ASSERT_TRUE(step.ok()) << step.status();
      ASSERT_TRUE(AppendRange(id, t, 1 + (t % 3 == 0)).ok());
      if (t % 3 == 0) ++t;
      if (t % 25 == 0) ExpectContentMatchesPositions(id);
    }
    ExpectContentMatchesPositions(id);
    // Merges keep the pool near the retained slots: at most one extra block per stream
    // beyond a dense packing, plus sparse neighbours (fill > B/2 on average).
    auto stats = engine_->Stats(true);
    const auto& seq = stats.sequences.back();
    EXPECT_LE(seq.blocks, 2 * (seq.max_stream_tokens / kB + 2) * kL * kH) << name;
    ASSERT_TRUE(engine_->Release(id).ok());
  }
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, 0u);
}

class QuantizedEngineTest : public EngineTest {
 protected:
  static constexpr uint32_t kD32 = 16;
  static Layout F32Layout() { return Layout{2, 2, kD32, DType::kF32, 8, 1000}; }
  static float Value(uint32_t stream, int64_t pos, uint32_t d) {
    // Deterministic, Gaussian-looking, with per-channel scale differences.
    const double u = std::sin(pos * 12.9898 + stream * 78.233 + d * 37.719) * 43758.5453;
    return static_cast<float>((u - std::floor(u) - 0.5) * (1 + d % 4));
  }
  absl::StatusOr<AppendResult> AppendF32(uint64_t id, int64_t pos) {
    positions_ = {pos};
    std::vector<float> k, v;
    for (uint32_t s = 0; s < 4; ++s) {
      for (uint32_t d = 0; d < kD32; ++d) {
        k.push_back(Value(s, pos, d));
        v.push_back(-Value(s, pos, d) / 2);
      }
    }
    k_.assign(reinterpret_cast<const char*>(k.data()), k.size() * 4);
    v_.assign(reinterpret_cast<const char*>(v.data()), v.size() * 4);
    AppendChunk chunk{positions_, {}, k_, v_, {}, {}};
    return engine_->Append(id, absl::MakeConstSpan(&chunk, 1));
  }
};

TEST_F(QuantizedEngineTest, Int8CodesNeverReRoundAcrossAThousandCompactions) {
  auto created =
      engine_->CreateSequence(F32Layout(), "h2o", {{"budget", 48}, {"recent", 4}},
                              QuantConfig{kernels::QuantType::kInt8, 16}, absl::ZeroDuration());
  ASSERT_TRUE(created.ok()) << created.status();
  const uint64_t id = created->sequence_id;
  float channel_max[kD32] = {};
  for (int64_t p = 0; p < 1100; ++p) {
    for (uint32_t s = 0; s < 4; ++s) {
      for (uint32_t d = 0; d < kD32; ++d) {
        channel_max[d] = std::max(channel_max[d], std::fabs(Value(s, p, d)));
      }
    }
  }
  std::mt19937 rng(5);
  // Dequantized K of (stream, position, channel) the first time it was seen quantized.
  std::map<std::tuple<uint32_t, int64_t, uint32_t>, float> first_seen;
  uint64_t quantized = 0, compactions = 0;
  for (int64_t t = 0; t < 1100; ++t) {
    ASSERT_TRUE(AppendF32(id, t).ok());
    uint64_t epoch;
    const auto rows = RandomRows(*engine_, id, rng, &epoch);
    auto step = engine_->Step(id, RowsInput(rows, epoch, 2));
    ASSERT_TRUE(step.ok()) << step.status();
    quantized += step->quantized_tokens;
    compactions += step->evicted_tokens > 0;
    if (t % 10 != 0 && t < 1090) continue;
    BlockTable table = *engine_->GetBlockTable(id);
    absl::Status s = engine_->ReadKV(id, 0, 0, 0, [&](StreamKV&& kv) {
      const uint32_t stream = kv.layer * 2 + kv.kv_head;
      const StreamTable& st = table.streams[stream];
      const float* k = reinterpret_cast<const float*>(kv.k.data());
      size_t slot = 0;
      for (const TableBlock& b : st.blocks) {
        for (uint32_t i = 0; i < b.count; ++i, ++slot) {
          const int64_t pos = kv.positions[slot];
          for (uint32_t d = 0; d < kD32; ++d) {
            const float x = Value(stream, pos, d);
            const float xh = k[slot * kD32 + d];
            if (b.precision == Precision::kLayout) {
              EXPECT_EQ(xh, x);  // unquantized: bit-exact
              continue;
            }
            // Bound: |x - x_hat| <= s_c / 2 <= (channel absmax) / 254, and it never grows.
            EXPECT_LE(std::fabs(xh - x), channel_max[d] / 254 * (1 + 1e-5));
            auto [it, inserted] = first_seen.try_emplace({stream, pos, d}, xh);
            if (!inserted) {
              EXPECT_EQ(it->second, xh) << "re-rounded at step " << t;
            }
          }
        }
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_GE(compactions, 1000u);
  EXPECT_GT(quantized, 0u);
  EXPECT_GT(first_seen.size(), 1000u);
}

TEST_F(QuantizedEngineTest, KvBytesCountCodesAndScales) {
  auto created = engine_->CreateSequence(
      F32Layout(), "full", {}, QuantConfig{kernels::QuantType::kInt8, 8}, absl::ZeroDuration());
  const uint64_t id = created->sequence_id;
  for (int64_t t = 0; t < 40; ++t) ASSERT_TRUE(AppendF32(id, t).ok());
  const uint64_t epoch_before = engine_->GetBlockTable(id)->epoch;
  auto step = engine_->Step(id, {});
  ASSERT_TRUE(step.ok());
  // 40 tokens per stream, B = 8, recent 8: the first 4 blocks (32 tokens) are int8.
  EXPECT_EQ(step->quantized_tokens, 4u * 32);
  const uint64_t int8_block = 2 * 8 * 16 + 2 * 16 * 4;  // codes + per-channel scales
  const uint64_t f32_tokens = 8 * 2 * 16 * 4;
  EXPECT_EQ(step->kv_bytes_after, 4 * (4 * int8_block + f32_tokens));
  EXPECT_EQ(step->kv_bytes_before, 4u * 40 * 2 * 16 * 4);
  // Quantization changes the table: new epoch.
  EXPECT_NE(step->epoch, epoch_before);
  EXPECT_EQ(step->epoch, engine_->GetBlockTable(id)->epoch);
}

TEST_F(EngineTest, PoliciesDemandTheirSignals) {
  const uint64_t conf = Create("confkv", {{"c_high", 40}, {"c_low", 60}});
  ASSERT_TRUE(AppendRange(conf, 0, 10).ok());
  auto s = engine_->Step(conf, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("attention"));
  StepInput only_logits;
  only_logits.logits = RawLogitStats{1.0f, 0.5f, 0.1f, {}};
  EXPECT_THAT(engine_->Step(conf, only_logits).status().message(), HasSubstr("attention"));

  const uint64_t info = Create("infokv");
  auto a = AppendRange(info, 0, 4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("token_entropy"));

  const uint64_t snap = Create("snapkv", {{"budget", 8}});
  ASSERT_TRUE(AppendRange(snap, 0, 20).ok());
  auto c = engine_->Compress(snap, {});
  EXPECT_THAT(c.status().message(), HasSubstr("window_scores"));
}

TEST_F(EngineTest, RefreeKvReportsItsOwnKeptSharePerLayer) {
  const uint64_t id = Create("refreekv");
  ASSERT_TRUE(AppendRange(id, 0, 100).ok());
  const uint64_t epoch = engine_->GetBlockTable(id)->epoch;
  // Attention concentrated on the last 10 tokens: old tokens carry almost no norm.
  std::vector<std::vector<float>> rows(kL * kH, std::vector<float>(100, 1e-5f));
  for (auto& row : rows) {
    for (int j = 90; j < 100; ++j) row[j] = 0.1f;
  }
  CompressInput input;
  input.epoch = epoch;
  for (size_t s = 0; s < rows.size(); ++s) {
    input.attention.push_back(
        {static_cast<uint32_t>(s / kH), static_cast<uint32_t>(s % kH), rows[s]});
  }
  auto r = engine_->Compress(id, input);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->layers.size(), kL);
  EXPECT_EQ(r->layers[0].kept_tokens, 100u * kH);  // layers 0 and 1 untouched
  EXPECT_EQ(r->layers[1].kept_tokens, 100u * kH);
  EXPECT_LT(r->layers[2].kept_tokens, 100u * kH);
  EXPECT_GE(r->layers[2].kept_tokens, 14u * kH);  // 4 sinks + the 10 that carry the mass
  ExpectContentMatchesPositions(id);
}

// ReFreeKV's decode-time rule looks only at the slots decoded after the prompt (their
// arrival step, which the engine keeps for this policy alone): prompt slots stay however
// little attention they get, decoded ones go.
TEST_F(EngineTest, RefreeKvStepEvictsDecodedSlotsOnly) {
  const uint64_t id = Create("refreekv", {{"interval", 1}, {"sinks", 0}});
  ASSERT_TRUE(AppendRange(id, 0, 40).ok());
  for (int64_t t = 40; t < 80; ++t) {
    auto table = engine_->GetBlockTable(id);
    ASSERT_TRUE(table.ok()) << table.status();
    std::vector<std::vector<float>> rows;
    for (const StreamTable& st : table->streams) {
      std::vector<float> row(st.positions.size(), 1e-6f);
      row.back() = 1.0f;  // all the mass on the newest slot
      rows.push_back(row);
    }
    auto step = engine_->Step(id, RowsInput(rows, table->epoch, kH));
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE(AppendRange(id, t, 1).ok());
  }
  auto table = engine_->GetBlockTable(id);
  ASSERT_TRUE(table.ok()) << table.status();
  for (const StreamTable& st : table->streams) {
    // Every prompt position is still there, in every layer.
    ASSERT_GE(st.positions.size(), 40u);
    for (int64_t p = 0; p < 40; ++p) EXPECT_EQ(st.positions[p], p) << "layer " << st.layer;
    if (st.layer >= 2) {
      EXPECT_LT(st.positions.size(), 80u) << "layer " << st.layer << ": nothing decoded went";
    } else {
      EXPECT_EQ(st.positions.size(), 80u) << "layer " << st.layer << " is skipped";
    }
  }
  ExpectContentMatchesPositions(id);
}

// Attention rows on a Step cover every stream or none: refreekv reads them when sent, and
// rows for some streams only once made it read a stream's missing row (a null span) for its
// decoded slots: the daemon crashed. Now INVALID_ARGUMENT, and nothing changes.
TEST_F(EngineTest, RefreeKvStepWithRowsForSomeStreamsIsRefused) {
  const uint64_t id = Create("refreekv", {{"interval", 1}, {"sinks", 0}});
  ASSERT_TRUE(AppendRange(id, 0, 6).ok());
  ASSERT_TRUE(engine_->Step(id, StepInput{}).ok());  // step 0: no rows, nothing runs
  ASSERT_TRUE(AppendRange(id, 6, 1).ok());           // a slot decoded at step 1
  auto before = engine_->GetBlockTable(id);
  ASSERT_TRUE(before.ok()) << before.status();
  const std::vector<std::vector<float>> one_row = {std::vector<float>(7, 1.0f / 7)};
  auto step = engine_->Step(id, RowsInput(one_row, before->epoch, kH));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
  EXPECT_THAT(step.status().message(), ::testing::HasSubstr("one entry per stream"));
  auto after = engine_->GetBlockTable(id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->version, before->version);
  EXPECT_EQ(after->epoch, before->epoch);
  ExpectContentMatchesPositions(id);
}

}  // namespace
}  // namespace kvmem::engine
