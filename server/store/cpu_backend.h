#pragma once
// CpuBackend: the pool in host memory, in a shared-memory segment so that same-host
// workers can map it read-only and read blocks in place. Work is synchronous.
//
// With arenas the pool is several segments side by side in one range of addresses: the
// shared part, then one per arena, each a memfd of its own, so that a client given an
// arena's descriptor maps that arena and nothing else.
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/store/backend.h"
#include "server/transport/shared_segment.h"

namespace kvmem::store {

class CpuBackend final : public Backend {
 public:
  // `arena_bytes`: the arenas' sizes, in order, taken from the end of the pool (each a
  // whole number of system pages; the shared part keeps the rest, at least one page).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(uint64_t pool_bytes,
                                                            std::vector<uint64_t> arena_bytes = {});

  absl::string_view kind() const override { return "cpu"; }
  bool prefers_device_step() const override { return false; }  // the host code is faster
  std::string device_name() const override;
  uint64_t pool_bytes() const override { return bytes_; }

  absl::Status Write(absl::Span<const WriteOp> ops) override;
  absl::Status Read(absl::Span<const ReadOp> ops) override;
  absl::Status Move(absl::Span<const MoveOp> ops) override;
  absl::Status Quantize(kernels::ElemType elem, const kernels::QuantGeometry& geometry,
                        absl::Span<const QuantizeOp> ops) override;
  absl::Status Dequantize(const kernels::QuantGeometry& geometry, kernels::ElemType elem,
                          absl::Span<const DequantizeOp> ops) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<SlotState>> CreateSlotState(uint32_t num_streams) override {
    return MakeHostSlotState(num_streams);
  }
  [[nodiscard]] absl::Status Prefault(uint64_t offset, uint64_t bytes) const override;
  std::optional<PoolExport> pool_export() const override;
  std::vector<SharedMemoryExport> pool_pieces() const override;
  uint8_t* host_pool() const override { return base_; }

 private:
  struct Piece {
    std::shared_ptr<transport::SharedSegment> segment;
    uint64_t offset;  // in the pool
  };
  explicit CpuBackend(std::vector<Piece> pieces);
  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const char* what) const;
  const std::vector<Piece> pieces_;  // in the pool's order, side by side
  uint8_t* const base_;
  const uint64_t bytes_;
};

}  // namespace kvmem::store
