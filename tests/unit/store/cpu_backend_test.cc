#include "server/store/cpu_backend.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "server/transport/shared_segment.h"

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
  ASSERT_NE(shm.segment.lock(), nullptr);
  EXPECT_EQ(shm.segment.lock()->label(), "kvmem-pool");
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

// Arenas: pieces side by side, each a segment of its own, one range of addresses for the
// backend's work across them.
TEST(CpuBackendArenaTest, PiecesLieSideBySideEachItsOwnSegment) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  auto backend = *CpuBackend::Create(8 * page, {2 * page, page});
  EXPECT_EQ(backend->pool_bytes(), 8 * page);
  const std::vector<SharedMemoryExport> pieces = backend->pool_pieces();
  ASSERT_EQ(pieces.size(), 3u);
  const uint64_t offsets[] = {0, 5 * page, 7 * page}, sizes[] = {5 * page, 2 * page, page};
  for (size_t i = 0; i < 3; ++i) {
    auto segment = pieces[i].segment.lock();
    ASSERT_NE(segment, nullptr);
    EXPECT_EQ(pieces[i].offset, offsets[i]);
    EXPECT_EQ(pieces[i].bytes, 8 * page);
    EXPECT_EQ(segment->bytes(), sizes[i]);
    EXPECT_EQ(segment->data(), backend->host_pool() + offsets[i]);
  }
  // A write across two pieces lands in both segments, and reads back whole.
  const std::string data(64, 'a');
  ASSERT_TRUE(backend->Write({{data.data(), 5 * page - 32, 64}}).ok());
  // A prefault across the pieces changes no byte (each piece's part of it populated).
  const absl::Status prefault = backend->Prefault(4 * page, 4 * page);
  EXPECT_TRUE(prefault.ok() || absl::IsUnimplemented(prefault)) << prefault;
  std::string out(64, '\0');
  ASSERT_TRUE(backend->Read({{5 * page - 32, out.data(), 64}}).ok());
  EXPECT_EQ(out, data);
  // The arena's descriptor holds its bytes alone: its first 32 are what was written there.
  auto arena = pieces[1].segment.lock();
  std::string through_fd(32, '\0');
  ASSERT_EQ(pread(arena->fd(), through_fd.data(), 32, 0), 32);
  EXPECT_EQ(through_fd, std::string(32, 'a'));
}

TEST(CpuBackendArenaTest, ArenasThatAreNotWholePagesOrLeaveNoSharedPartAreRefused) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(CpuBackend::Create(8 * page, {page + 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuBackend::Create(8 * page, {8 * page}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuBackend::Create(8 * page + 1, {page}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuBackend::Create(8 * page, {0}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvmem::store
