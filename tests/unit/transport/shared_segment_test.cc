// SharedSegment: page population stays inside the segment, and names nobody can guess.
#include "server/transport/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvmem::transport {
namespace {

uint64_t PageBytes() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

TEST(SharedSegmentTest, PopulateTakesRangesInsideTheSegmentOnly) {
  auto segment = *SharedSegment::Create("kvmem-test", 3 * PageBytes() + 100);
  absl::Status s = segment->Populate(0, 1);
  if (s.code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << s;
  ASSERT_TRUE(s.ok()) << s;
  // An unaligned start, the partial last page, an empty range at the end.
  EXPECT_TRUE(segment->Populate(PageBytes() + 7, 2 * PageBytes() + 93).ok());
  EXPECT_TRUE(segment->Populate(segment->bytes(), 0).ok());
  EXPECT_EQ(segment->Populate(segment->bytes(), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(segment->Populate(1, segment->bytes()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(segment->Populate(~uint64_t{0}, 2).code(), absl::StatusCode::kInvalidArgument);
}

// A segment's name cannot be guessed: names another process created first, following the
// daemon's own, do not keep it from making its next segment (O_EXCL refused it before).
TEST(SharedSegmentTest, NamesTakenAheadDoNotBlockTheNextSegment) {
  auto first = SharedSegment::Create("kvmem-test", 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  // "/kvmem-test-<pid>-<n>...": the counted names that would follow it.
  const std::string& name = (*first)->name();
  const std::string stem = name.substr(0, name.rfind('-') + 1);
  std::string count = name.substr(stem.size());
  if (count.size() > 20) count.resize(count.size() - 20);  // the random digits after it
  const uint64_t n = std::stoull(count);
  std::vector<std::string> taken;
  for (uint64_t next = n + 1; next < n + 10; ++next) {
    taken.push_back(stem + std::to_string(next));
    const int fd = shm_open(taken.back().c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << taken.back();
    close(fd);
  }
  auto second = SharedSegment::Create("kvmem-test", 4096);
  for (const std::string& t : taken) shm_unlink(t.c_str());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE((*second)->name(), (*first)->name());
}

}  // namespace
}  // namespace kvmem::transport
