#include "server/store/cpu_backend.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace kvmem::store
