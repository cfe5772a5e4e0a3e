// ParseCost bounds what a parse allocates, read from the wire form alone: for requests of
// tiny records (empty batch entries, one-byte positions, many map keys, unknown fields,
// unpacked repeated fields) it is at least what the parsed message holds, and it refuses
// what protobuf would not parse. ParseBudget holds reservations and refuses past its size.
#include "server/transport/parse_cost.h"

#include <malloc.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "kvmem/v1/kvmem.pb.h"

namespace kvmem::transport {
namespace {

using ::testing::HasSubstr;

// The cost of `wire` as a T, which must be at least what parsing it holds: as protobuf
// counts it (SpaceUsedLong) and as the allocator does (the heap's growth over the parse,
// where glibc's allocator is the one in use; under a sanitizer's it reads 0).
template <class T>
uint64_t CheckedCost(const std::string& wire) {
  absl::StatusOr<uint64_t> cost = ParseCost(T::descriptor(), wire);
  EXPECT_TRUE(cost.ok()) << cost.status();
  const size_t before = mallinfo2().uordblks;
  T parsed;
  EXPECT_TRUE(parsed.ParseFromString(wire));
  const size_t heap = mallinfo2().uordblks - before;
  // (protobuf's own measure of a map field reads through a null pointer under TSan)
#if !defined(__SANITIZE_THREAD__)
  EXPECT_GE(*cost, parsed.SpaceUsedLong()) << T::descriptor()->full_name();
#endif
  EXPECT_GE(*cost, heap) << T::descriptor()->full_name();
  return cost.value_or(0);
}

TEST(ParseCostTest, BoundsWhatParsingTinyRecordsHolds) {
  v1::StepBatchRequest batch;
  for (int i = 0; i < 20000; ++i) batch.add_entries();
  const std::string empty_entries = batch.SerializeAsString();
  EXPECT_EQ(empty_entries.size(), 40000u);  // two bytes each
  // Many times the wire size: what a limit on wire bytes does not see.
  EXPECT_GT(CheckedCost<v1::StepBatchRequest>(empty_entries), 20 * empty_entries.size());

  v1::AppendRequest append;
  for (int i = 0; i < 100000; ++i) append.add_positions(i % 100);  // one byte each, packed
  append.set_k(std::string(1 << 16, 'k'));
  append.set_v(std::string(1 << 16, 'v'));
  std::string wire = append.SerializeAsString();
  // Unknown fields are kept by the parse: a varint and a length-delimited one, many times.
  for (int i = 0; i < 1000; ++i) {
    wire += absl::StrCat(std::string("\xb8\x3e\x01", 3), std::string("\xc2\x3e\x02xy", 5));
  }
  CheckedCost<v1::AppendRequest>(wire);

  // The same positions unpacked: a tag and a byte per element.
  std::string unpacked;
  {
    google::protobuf::io::StringOutputStream out(&unpacked);
    google::protobuf::io::CodedOutputStream coded(&out);
    const int number = v1::AppendRequest::descriptor()->FindFieldByName("positions")->number();
    for (int i = 0; i < 50000; ++i) {
      coded.WriteTag(static_cast<uint32_t>(number << 3));  // varint
      coded.WriteVarint64(i % 100);
    }
  }
  CheckedCost<v1::AppendRequest>(unpacked);

  v1::CreateSequenceRequest create;
  for (int i = 0; i < 5000; ++i) (*create.mutable_policy()->mutable_params())[absl::StrCat(i)] = i;
  CheckedCost<v1::CreateSequenceRequest>(create.SerializeAsString());

  v1::StepRequest step;
  for (int i = 0; i < 3000; ++i) step.add_attention()->add_weights(1.0f);
  CheckedCost<v1::StepRequest>(step.SerializeAsString());

  // A batch whose entries carry appends and attention rows.
  v1::StepBatchRequest full;
  for (int i = 0; i < 64; ++i) {
    v1::StepBatchEntry* entry = full.add_entries();
    entry->set_sequence_id(i + 1);
    entry->mutable_append()->add_positions(i);
    entry->mutable_append()->set_k(std::string(512, 'k'));
    entry->mutable_step()->add_attention()->add_weights(0.5f);
  }
  CheckedCost<v1::StepBatchRequest>(full.SerializeAsString());
  CheckedCost<v1::StepBatchRequest>("");

  // Unknown fields only, each as short as the wire allows, and groups of them (each field
  // in a group is a record of its own: the service harness found the group undercounted).
  std::string unknown;
  for (int i = 0; i < 500; ++i) unknown += std::string("\xb8\x3e\x01", 3);  // field 999 varint
  for (int g = 0; g < 20; ++g) {
    unknown += std::string("\xbb\x3e", 2);  // field 999, start group
    for (int i = 0; i < 50; ++i) unknown += std::string("\x08\x01", 2);
    unknown += std::string("\xbc\x3e", 2);  // end group
  }
  CheckedCost<v1::StatsRequest>(unknown);
}

// A bytes field past protobuf's safe string size grows by doubling as its pieces arrive:
// counted at three times its length (the reviewer measured 2.24 times kept for 64 MiB).
TEST(ParseCostTest, AStringPastTheSafeSizeCountsThreeTimes) {
  v1::AppendRequest append;
  append.set_k(std::string(60000000, 'k'));
  const std::string wire = append.SerializeAsString();
  absl::StatusOr<uint64_t> cost = ParseCost(v1::AppendRequest::descriptor(), wire);
  ASSERT_TRUE(cost.ok()) << cost.status();
  EXPECT_GE(*cost, 180000000u);
  EXPECT_GE(StringParseBytes(60000000), 180000000u);
  EXPECT_LT(StringParseBytes(1000), 2000u);
  // On an arena, repeated fields keep their old arrays: more is counted.
  v1::AppendRequest positions;
  for (int i = 0; i < 1000; ++i) positions.add_positions(i);
  const std::string small = positions.SerializeAsString();
  EXPECT_GT(*ParseCost(v1::AppendRequest::descriptor(), small, /*on_arena=*/true),
            *ParseCost(v1::AppendRequest::descriptor(), small));
}

TEST(ParseCostTest, RefusesWhatDoesNotParse) {
  v1::AppendRequest append;
  append.set_k(std::string(100, 'k'));
  const std::string whole = append.SerializeAsString();
  const std::string nested_groups = std::string(200, '\xbb') /* field 999, start group */;
  for (const std::string& bad : {std::string("\xff\xff\xff", 3), whole.substr(0, whole.size() - 1),
                                 std::string("\x00", 1), nested_groups}) {
    absl::StatusOr<uint64_t> cost = ParseCost(v1::AppendRequest::descriptor(), bad);
    EXPECT_TRUE(absl::IsInvalidArgument(cost.status())) << cost.status();
    EXPECT_THAT(std::string(cost.status().message()), HasSubstr("kvmem.v1.AppendRequest"));
    v1::AppendRequest parsed;
    EXPECT_FALSE(parsed.ParseFromString(bad));  // protobuf agrees
  }
}

TEST(ParseBudgetTest, HoldsUntilReleasedAndRefusesPastItsSize) {
  ParseBudget budget(1000);
  absl::StatusOr<ParseBudget::Reservation> a = budget.Reserve(600, "first");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<ParseBudget::Reservation> b = budget.Reserve(500, "second");
  ASSERT_TRUE(absl::IsResourceExhausted(b.status()));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("--parse-memory-bytes=1000"));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("second"));
  EXPECT_EQ(budget.reserved(), 600u);
  {
    ParseBudget::Reservation moved = *std::move(a);
    EXPECT_EQ(budget.reserved(), 600u);
  }
  EXPECT_EQ(budget.reserved(), 0u);
  EXPECT_TRUE(budget.Reserve(1000, "all").ok());
  EXPECT_EQ(budget.reserved(), 0u);  // the temporary's reservation went with it
  EXPECT_TRUE(absl::IsResourceExhausted(budget.Reserve(1001, "more").status()));
}

}  // namespace
}  // namespace kvmem::transport
