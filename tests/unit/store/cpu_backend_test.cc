#include "server/store/cpu_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/store/shared_segment.h"

namespace kvmem::store {
namespace {

TEST(CpuBackendTest, WriteReadMoveRoundTrip) {
  auto backend = *CpuBackend::Create(1 << 16);
  const std::string data = "0123456789abcdef";
  ASSERT_TRUE(backend->Write({{data.data(), 100, data.size()}}).ok());
  // Overlapping forward move behaves as memmove.
  ASSERT_TRUE(backend->Move({{100, 98, 16}}).ok());
  std::string out(16, '\0');
  ASSERT_TRUE(backend->Read({{98, out.data(), 16}}).ok());
  EXPECT_EQ(out, data);
}

TEST(CpuBackendTest, OutOfRangeIsAnErrorAndWritesNothing) {
  auto backend = *CpuBackend::Create(4096);
  const std::string data(64, 'x');
  const std::string zeros(64, '\0');
  absl::Status s = backend->Write({{data.data(), 0, 64}, {data.data(), 4090, 64}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  std::string out(64, '?');
  ASSERT_TRUE(backend->Read({{0, out.data(), 64}}).ok());
  EXPECT_EQ(out, zeros);
}

TEST(CpuBackendTest, ExportsItsPoolByName) {
  auto backend = *CpuBackend::Create(4096);
  ASSERT_TRUE(backend->pool_export().has_value());
  const SharedMemoryExport shm = std::get<SharedMemoryExport>(*backend->pool_export());
  EXPECT_EQ(shm.bytes, 4096u);
  EXPECT_EQ(shm.name.rfind("/kvmem-pool-", 0), 0u);
}

// Page faults this thread has taken so far.
long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

uint64_t PageBytes() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

// Writes one byte into each page of [offset, offset + bytes); returns the faults taken.
long FaultsWriting(CpuBackend& backend, uint64_t offset, uint64_t bytes) {
  const char one = 1;
  const long before = MinorFaults();
  for (uint64_t at = offset; at < offset + bytes; at += PageBytes()) {
    EXPECT_TRUE(backend.Write({{&one, at, 1}}).ok());
  }
  return MinorFaults() - before;
}

TEST(CpuBackendTest, PrefaultMapsThePoolWithoutChangingIt) {
  constexpr uint64_t kHalf = 2 << 20;
  auto backend = *CpuBackend::Create(2 * kHalf);
  const std::string data = "kept across the prefault";
  ASSERT_TRUE(backend->Write({{data.data(), kHalf + 100, data.size()}}).ok());
  absl::Status s = backend->Prefault(kHalf, kHalf);
  if (s.code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << s;
  ASSERT_TRUE(s.ok()) << s;
  // The half not prefaulted faults at its first writes (once per page, or per huge page
  // where /dev/shm has them); the other not at all (a few faults of this thread's own are
  // allowed for).
  EXPECT_GE(FaultsWriting(*backend, 0, kHalf), 1);
  EXPECT_LE(FaultsWriting(*backend, kHalf + PageBytes(), kHalf - PageBytes()), 8);
  std::string out(data.size(), '\0');
  ASSERT_TRUE(backend->Read({{kHalf + 100, out.data(), out.size()}}).ok());
  EXPECT_EQ(out, data);
  EXPECT_EQ(backend->Prefault(kHalf, kHalf + 1).code(), absl::StatusCode::kInternal);
}

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
}  // namespace kvmem::store
