#pragma once
// CpuBackend: the pool in host memory, in a named shared-memory segment so that same-host
// workers can map it read-only and read blocks in place. Work is synchronous.
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/store/backend.h"
#include "server/transport/shared_segment.h"

namespace kvmem::store {

class CpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(uint64_t pool_bytes);

  absl::string_view kind() const override { return "cpu"; }
  bool prefers_device_step() const override { return false; }  // the host code is faster
  std::string device_name() const override;
  uint64_t pool_bytes() const override { return segment_->bytes(); }

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
  uint8_t* host_pool() const override { return segment_->data(); }

 private:
  explicit CpuBackend(std::shared_ptr<transport::SharedSegment> segment)
      : segment_(std::move(segment)) {}
  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const char* what) const;
  std::shared_ptr<transport::SharedSegment> segment_;
};

}  // namespace kvmem::store
