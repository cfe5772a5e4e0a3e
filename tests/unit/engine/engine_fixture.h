#pragma once
// A small engine on the CPU backend with a fake clock, for engine unit tests.
#include <functional>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"
#include "server/store/cpu_backend.h"
#include "tests/testing/payload.h"

namespace kvmem::engine {

class EngineTest : public ::testing::Test {
 public:
  static constexpr uint32_t kL = 4, kH = 2, kD = 8, kB = 16;

 protected:
  void SetUp() override { MakeEngine(1 << 20); }

  // `adjust` changes the test configuration; `wrap` may put a backend around the CPU one.
  void MakeEngine(
      uint64_t pool_bytes, const std::function<void(EngineConfig&)>& adjust = {},
      const std::function<std::unique_ptr<store::Backend>(std::unique_ptr<store::Backend>)>& wrap =
          {}) {
    engine_.reset();
    EngineConfig config;
    config.pool_bytes = pool_bytes;
    config.page_bytes = 4096;
    config.max_sequences = 8;
    config.default_lease = absl::Seconds(10);
    config.reclaim_reserve_pages = 0;  // the tests count pages exactly
    if (adjust) adjust(config);
    std::unique_ptr<store::Backend> backend = *store::CpuBackend::Create(pool_bytes);
    if (wrap) backend = wrap(std::move(backend));
    engine_ = *Engine::Create(config, std::move(backend), &clock_);
  }

  static Layout TestLayout() { return Layout{kL, kH, kD, DType::kF16, kB, 1000}; }

  uint64_t Create(const std::string& policy = "full", policy::ParamOverrides params = {},
                  absl::Duration lease = absl::ZeroDuration(), QuantConfig quant = {}) {
    auto created = engine_->CreateSequence(TestLayout(), policy, params, quant, lease);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->sequence_id : 0;
  }

  // Appends positions first..first+n-1 with K salt 0 and V salt 1.
  absl::StatusOr<AppendResult> AppendRange(uint64_t id, int64_t first, uint32_t n) {
    positions_ = testing::Range(first, n);
    k_ = testing::Payload16(kL * kH, first, n, kD, 0);
    v_ = testing::Payload16(kL * kH, first, n, kD, 1);
    AppendChunk chunk{positions_, {}, k_, v_, {}, {}};
    return engine_->Append(id, absl::MakeConstSpan(&chunk, 1));
  }

  // Reads every stream and checks K and V against the positions the table names.
  void ExpectContentMatchesPositions(uint64_t id) {
    size_t streams = 0;
    absl::Status s = engine_->ReadKV(id, 0, 0, 0, [&](StreamKV&& kv) {
      const uint32_t stream = kv.layer * kH + kv.kv_head;
      EXPECT_EQ(kv.k, testing::Expected16(stream, kv.positions, kD, 0)) << "stream " << stream;
      EXPECT_EQ(kv.v, testing::Expected16(stream, kv.positions, kD, 1)) << "stream " << stream;
      ++streams;
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(streams, kL * kH);
  }

  // A fingerprint without block ids and offsets: two sequences that hold the same tokens,
  // scores and K/V compare equal.
  std::string Content(uint64_t id) {
    absl::StatusOr<std::string> fp = engine_->Fingerprint(id);
    if (!fp.ok()) return fp.status().ToString();
    std::string out;
    for (absl::string_view line : absl::StrSplit(*fp, '\n')) {
      if (!absl::StartsWith(line, "blocks")) absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

  FakeClock clock_;
  std::unique_ptr<Engine> engine_;
  std::vector<int64_t> positions_;
  std::string k_, v_;
};

// Positions first..first+n-1 as one chunk (K salt 0, V salt 1) and the buffers it views.
struct RangeChunk {
  RangeChunk(int64_t first, uint32_t n)
      : positions(testing::Range(first, n)),
        k(testing::Payload16(EngineTest::kL * EngineTest::kH, first, n, EngineTest::kD, 0)),
        v(testing::Payload16(EngineTest::kL * EngineTest::kH, first, n, EngineTest::kD, 1)) {}
  AppendChunk chunk() const { return AppendChunk{positions, {}, k, v, {}, {}}; }
  std::vector<int64_t> positions;
  std::string k, v;
};

// Adds the range to an append session (Add is done with the buffers when it returns).
inline absl::Status AddRange(AppendSession& session, int64_t first, uint32_t n) {
  return session.Add(RangeChunk(first, n).chunk());
}
// The same as one unary Append.
inline absl::Status AppendTokens(Engine& engine, uint64_t id, int64_t first, uint32_t n) {
  const RangeChunk range(first, n);
  const AppendChunk chunk = range.chunk();
  return engine.Append(id, absl::MakeConstSpan(&chunk, 1)).status();
}

}  // namespace kvmem::engine
