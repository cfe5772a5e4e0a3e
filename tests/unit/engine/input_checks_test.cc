// IndexSignals (server/engine/input_checks.cc): of a request's signals, the first bad one in
// order is named, whichever check it fails (a signal's shape is checked before its values),
// also with streams long enough that the values are checked on several threads; a rejected
// step changes nothing.
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

}  // namespace
}  // namespace kvmem::engine
