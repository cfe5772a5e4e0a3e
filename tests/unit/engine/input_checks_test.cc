// IndexSignals (server/engine/input_checks.cc): of a request's signals, the first bad one in
// order is named, whichever check it fails (a signal's shape is checked before its values),
// also with streams long enough that the values are checked on several threads; a rejected
// step changes nothing.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

class InputChecksTest : public EngineTest {
 protected:
  static constexpr uint32_t kSlots = 9000;  // StreamGrain: tasks of 3 of the 8 streams

  void SetUp() override {
    MakeEngine(16 << 20);
    id_ = Create("h2o", {{"budget", 20000}, {"recent", 8}});
    for (uint32_t first = 0; first < kSlots; first += 1000) {
      ASSERT_TRUE(AppendRange(id_, first, 1000).ok());
    }
    rows_.assign(kL * kH, std::vector<float>(kSlots, 1.0f / kSlots));
  }

  // One signal per stream, in stream order (signal i is stream i).
  StepInput Input() {
    StepInput input;
    input.epoch = engine_->GetBlockTable(id_)->epoch;
    for (uint32_t s = 0; s < kL * kH; ++s) input.attention.push_back({s / kH, s % kH, rows_[s]});
    return input;
  }

  std::string Rejection(const StepInput& input) {
    absl::StatusOr<StepResult> r = engine_->Step(id_, input);
    EXPECT_FALSE(r.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    return std::string(r.status().message());
  }

  uint64_t id_ = 0;
  std::vector<std::vector<float>> rows_;
};

TEST_F(InputChecksTest, TheFirstBadSignalInOrderIsNamed) {
  const std::string before = Content(id_);
  rows_[5][700] = std::nanf("");
  rows_[6][3] = INFINITY;
  rows_[7][kSlots - 1] = -1.0f;
  EXPECT_THAT(Rejection(Input()), HasSubstr("attention[5][700]: nan"));

  StepInput later_shape = Input();  // a shape error after the bad value: the value is named
  later_shape.attention[6].layer = kL;
  EXPECT_THAT(Rejection(later_shape), HasSubstr("attention[5][700]"));

  StepInput earlier_head = Input();  // before it: the shape
  earlier_head.attention[2].kv_head = kH;
  EXPECT_THAT(Rejection(earlier_head), HasSubstr("attention[2].kv_head"));

  StepInput twice = Input();
  twice.attention[4].layer = 0;  // stream (0, 0) again
  twice.attention[4].kv_head = 0;
  EXPECT_THAT(Rejection(twice), HasSubstr("attention[4]: stream (layer 0, kv_head 0) appears"));

  StepInput short_row = Input();
  short_row.attention[3].values = short_row.attention[3].values.subspan(1);
  EXPECT_THAT(Rejection(short_row), HasSubstr("attention[3]: 8999 values"));

  rows_[5][700] = 0.0f;
  EXPECT_THAT(Rejection(Input()), HasSubstr("attention[6][3]: inf"));
  rows_[6][3] = 0.0f;
  EXPECT_THAT(Rejection(Input()), HasSubstr("attention[7][8999]: -1"));
  EXPECT_EQ(Content(id_), before);

  for (int round = 0; round < 20; ++round) {  // every chunk finds one: the first is named
    for (uint32_t s = 1; s < kL * kH; ++s) rows_[s][s * 100] = INFINITY;
    EXPECT_THAT(Rejection(Input()), HasSubstr("attention[1][100]: inf"));
    for (uint32_t s = 1; s < kL * kH; ++s) rows_[s][s * 100] = 0.0f;
  }
  EXPECT_EQ(Content(id_), before);

  rows_[7][kSlots - 1] = -0.0f;  // zero of either sign is a weight
  EXPECT_TRUE(engine_->Step(id_, Input()).ok());
}

// Attention weights are probabilities: a value past 1 (raw scores or logits sent by mistake)
// is refused like a negative one. Top-k log-probabilities come instead of the three numbers,
// never beside them, and at most one per vocabulary entry.
TEST_F(InputChecksTest, AttentionPastOneAndMalformedTopLogprobsAreRefused) {
  rows_[3][7] = 1.5f;
  EXPECT_THAT(Rejection(Input()),
              HasSubstr("attention[3][7]: 1.5 is not a finite value in [0, 1.01]"));
  rows_[3][7] = 1.002f;  // rounding past 1 (a bf16 group mean) passes
  StepInput input = Input();
  input.logits = RawLogitStats{1.0f, 0.5f, 0.2f, {-0.1f, -2.0f}};
  EXPECT_THAT(Rejection(input), HasSubstr("logit_stats.top_logprobs: sent beside entropy"));
  input.logits = RawLogitStats{0, 0, 0, std::vector<float>(1001, -7.0f)};
  EXPECT_THAT(Rejection(input), HasSubstr("1001 values, more than the vocabulary's 1000"));
  input.logits = RawLogitStats{0, 0, 0, {-0.5f, -2.0f}};  // 0.61 + 0.14
  absl::StatusOr<StepResult> r = engine_->Step(id_, input);
  EXPECT_TRUE(r.ok()) << r.status();
}

// An infinity or NaN anywhere in K or V, in every layout dtype, is refused with the element
// named (and where it lies), and the sequence is as before: quantizing a block with it
// would spread it to the same channel of every token of the block.
TEST_F(EngineTest, NonFiniteKvIsRefusedInEveryDtype) {
  struct Case {
    DType dtype;
    uint32_t bytes;
    std::vector<uint32_t> bad;  // bit patterns: +inf, -inf, a NaN
  };
  const Case cases[] = {{DType::kF16, 2, {0x7c00, 0xfc00, 0x7e01}},
                        {DType::kBF16, 2, {0x7f80, 0xff80, 0x7fc1}},
                        {DType::kF32, 4, {0x7f800000, 0xff800000, 0x7fc00001}}};
  constexpr uint32_t kTokens = 3;
  for (const Case& c : cases) {
    const Layout layout{kL, kH, kD, c.dtype, kB, 1000};
    auto created = engine_->CreateSequence(layout, "full", {}, {}, absl::ZeroDuration());
    ASSERT_TRUE(created.ok()) << created.status();
    const uint64_t id = created->sequence_id;
    const std::vector<int64_t> positions = {0, 1, 2};
    // 0x3c00 / 0x3f80 / 0x3f800000: 1.0 in each format.
    const uint32_t one = c.bytes == 4 ? 0x3f800000u : (c.dtype == DType::kF16 ? 0x3c00u : 0x3f80u);
    std::string good(size_t{kL} * kH * kTokens * kD * c.bytes, '\0');
    for (size_t i = 0; i < good.size() / c.bytes; ++i) {
      std::memcpy(good.data() + i * c.bytes, &one, c.bytes);
    }
    // Element of layer 2, kv_head 1, token 2, dim 5 in [L][H][n][D].
    const size_t at = ((2 * kH + 1) * kTokens + 2) * kD + 5;
    for (uint32_t bad : c.bad) {
      for (const bool in_v : {false, true}) {
        std::string broken = good;
        std::memcpy(broken.data() + at * c.bytes, &bad, c.bytes);
        const AppendChunk chunk{positions, {}, in_v ? good : broken, in_v ? broken : good, {}, {}};
        auto r = engine_->Append(id, absl::MakeConstSpan(&chunk, 1));
        ASSERT_FALSE(r.ok()) << DTypeName(c.dtype) << " " << bad;
        EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
        EXPECT_THAT(r.status().message(),
                    HasSubstr(absl::StrCat(in_v ? "v[" : "k[", at,
                                           "]: an infinity or NaN (layer 2, kv_head 1, token 2, "
                                           "dim 5)")));
        EXPECT_EQ(engine_->GetBlockTable(id)->streams[0].positions.size(), 0u);
      }
    }
    const AppendChunk chunk{positions, {}, good, good, {}, {}};
    ASSERT_TRUE(engine_->Append(id, absl::MakeConstSpan(&chunk, 1)).ok()) << DTypeName(c.dtype);
    ASSERT_TRUE(engine_->Release(id).ok());
  }
}

}  // namespace
}  // namespace kvmem::engine
