#include "server/store/cpu_backend.h"

#include <unistd.h>

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvmem::store {

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(uint64_t pool_bytes) {
  absl::StatusOr<std::shared_ptr<transport::SharedSegment>> segment =
      transport::SharedSegment::Create("kvmem-pool", pool_bytes);
  if (absl::IsResourceExhausted(segment.status())) {
    return absl::ResourceExhaustedError(
        absl::StrCat("--pool-bytes=", pool_bytes, ": ", segment.status().message(),
                     "; lower --pool-bytes or give kvmemd more memory"));
  }
  if (!segment.ok()) return segment.status();
  return std::unique_ptr<CpuBackend>(new CpuBackend(*std::move(segment)));
}

std::string CpuBackend::device_name() const {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return absl::StrCat("cpu (", sysconf(_SC_NPROCESSORS_ONLN), " cores)");
}

// The engine computes every offset from the pool's own bookkeeping, so a range error here
// is a bug upstream; it is reported, never written through.
absl::Status CpuBackend::CheckRange(uint64_t offset, uint64_t bytes, const char* what) const {
  if (offset > segment_->bytes() || bytes > segment_->bytes() - offset) {
    return absl::InternalError(absl::StrCat(what, ": range [", offset, ", ", offset + bytes,
                                            ") outside the pool of ", segment_->bytes(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Prefault(uint64_t offset, uint64_t bytes) const {
  if (absl::Status s = CheckRange(offset, bytes, "prefault"); !s.ok()) return s;
  return segment_->Populate(offset, bytes);
}

absl::Status CpuBackend::Write(absl::Span<const WriteOp> ops) {
  for (const WriteOp& op : ops) {
    if (absl::Status s = CheckRange(op.dst, op.bytes, "write"); !s.ok()) return s;
  }
  for (const WriteOp& op : ops) std::memcpy(segment_->data() + op.dst, op.src, op.bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Read(absl::Span<const ReadOp> ops) {
  for (const ReadOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "read"); !s.ok()) return s;
  }
  for (const ReadOp& op : ops) std::memcpy(op.dst, segment_->data() + op.src, op.bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Move(absl::Span<const MoveOp> ops) {
  for (const MoveOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "move source"); !s.ok()) return s;
    if (absl::Status s = CheckRange(op.dst, op.bytes, "move destination"); !s.ok()) return s;
  }
  for (const MoveOp& op : ops) {
    std::memmove(segment_->data() + op.dst, segment_->data() + op.src, op.bytes);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Quantize(kernels::ElemType elem, const kernels::QuantGeometry& geometry,
                                  absl::Span<const QuantizeOp> ops) {
  const uint64_t layout_bytes =
      2ull * geometry.block_tokens * geometry.head_dim * kernels::ElemBytes(elem);
  for (const QuantizeOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, layout_bytes, "quantize source"); !s.ok()) return s;
    if (absl::Status s = CheckRange(op.dst, geometry.block_bytes(), "quantize destination");
        !s.ok()) {
      return s;
    }
  }
  for (const QuantizeOp& op : ops) {
    kernels::QuantizeBlockRef(segment_->data() + op.src, elem, geometry, op.start, op.count,
                              segment_->data() + op.dst);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Dequantize(const kernels::QuantGeometry& geometry, kernels::ElemType elem,
                                    absl::Span<const DequantizeOp> ops) {
  for (const DequantizeOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, geometry.block_bytes(), "dequantize"); !s.ok()) {
      return s;
    }
  }
  for (const DequantizeOp& op : ops) {
    kernels::DequantizeBlockRef(segment_->data() + op.src, geometry, op.start, op.count, elem,
                                op.k_dst, op.v_dst);
  }
  return absl::OkStatus();
}

std::optional<PoolExport> CpuBackend::pool_export() const {
  return SharedMemoryExport{segment_, segment_->bytes()};
}

}  // namespace kvmem::store
