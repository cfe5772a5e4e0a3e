#pragma once
// FaultyBackend: a Backend that forwards to another and fails its N-th data call (Write,
// Read, Move, Quantize, Dequantize, Synchronize) with INTERNAL, for failure sweeps.
#include <atomic>
#include <memory>

#include "server/store/backend.h"

namespace kvmem::testing {

class FaultyBackend final : public store::Backend {
 public:
  explicit FaultyBackend(std::unique_ptr<store::Backend> inner) : inner_(std::move(inner)) {}

  // A function that wraps a backend in a FaultyBackend and points *out at it (for fixtures
  // that build the inner backend themselves).
  static auto Wrapper(FaultyBackend** out) {
    return [out](std::unique_ptr<store::Backend> inner) -> std::unique_ptr<store::Backend> {
      auto faulty = std::make_unique<FaultyBackend>(std::move(inner));
      *out = faulty.get();
      return faulty;
    };
  }

  // The n-th data call from now on fails (1-based); 0 disarms.
  void FailAt(uint64_t n) {
    calls_.store(0);
    fail_at_.store(n);
  }
  uint64_t calls() const { return calls_.load(); }

  absl::string_view kind() const override { return inner_->kind(); }
  std::string device_name() const override { return inner_->device_name(); }
  uint64_t pool_bytes() const override { return inner_->pool_bytes(); }
  bool prefers_device_step() const override { return inner_->prefers_device_step(); }
  absl::Status Write(absl::Span<const store::WriteOp> ops) override {
    return Fail() ? Injected("write") : inner_->Write(ops);
  }
  absl::Status Read(absl::Span<const store::ReadOp> ops) override {
    return Fail() ? Injected("read") : inner_->Read(ops);
  }
  absl::Status Move(absl::Span<const store::MoveOp> ops) override {
    // Half the moves happen before the failure: a batch that breaks midway.
    if (Fail()) {
      (void)inner_->Move(ops.first(ops.size() / 2));
      return Injected("move");
    }
    return inner_->Move(ops);
  }
  absl::Status Quantize(kernels::ElemType elem, const kernels::QuantGeometry& geometry,
                        absl::Span<const store::QuantizeOp> ops) override {
    return Fail() ? Injected("quantize") : inner_->Quantize(elem, geometry, ops);
  }
  absl::Status Dequantize(const kernels::QuantGeometry& geometry, kernels::ElemType elem,
                          absl::Span<const store::DequantizeOp> ops) override {
    return Fail() ? Injected("dequantize") : inner_->Dequantize(geometry, elem, ops);
  }
  absl::Status Synchronize() override {
    return Fail() ? Injected("synchronize") : inner_->Synchronize();
  }
  absl::StatusOr<std::unique_ptr<store::SlotState>> CreateSlotState(uint32_t num_streams) override {
    return inner_->CreateSlotState(num_streams);
  }
  std::optional<store::PoolExport> pool_export() const override { return inner_->pool_export(); }

 private:
  bool Fail() { return calls_.fetch_add(1) + 1 == fail_at_.load(); }
  static absl::Status Injected(const char* what) {
    return absl::InternalError(absl::StrCat("backend ", what, ": injected failure"));
  }
  std::unique_ptr<store::Backend> inner_;
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> fail_at_{0};
};

}  // namespace kvmem::testing
