#include "server/store/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvmem::store {

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(uint64_t pool_bytes,
                                                               std::vector<uint64_t> arena_bytes) {
  auto exhausted = [pool_bytes](const absl::Status& s) {
    if (!absl::IsResourceExhausted(s)) return s;
    return absl::ResourceExhaustedError(
        absl::StrCat("--pool-bytes=", pool_bytes, ": ", s.message(),
                     "; lower --pool-bytes or give kvmemd more memory"));
  };
  if (arena_bytes.empty()) {
    absl::StatusOr<std::shared_ptr<transport::SharedSegment>> segment =
        transport::SharedSegment::Create("kvmem-pool", pool_bytes);
    if (!segment.ok()) return exhausted(segment.status());
    return std::unique_ptr<CpuBackend>(new CpuBackend({{*std::move(segment), 0}}));
  }
  const auto system_page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t arenas = 0;
  for (uint64_t a : arena_bytes) {
    if (a == 0 || a % system_page != 0 || a > pool_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tenant-arena: an arena of ", a, " bytes is not a whole number of ",
                       system_page, "-byte pages within the pool of ", pool_bytes));
    }
    arenas += a;
  }
  if (arenas >= pool_bytes || (pool_bytes - arenas) % system_page != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tenant-arena: arenas of ", arenas, " bytes leave the pool of ", pool_bytes,
                     " no shared part of whole ", system_page, "-byte pages"));
  }
  // One range of addresses, taken now so that the pieces lie side by side; each piece maps
  // its segment over its part, and the range is theirs from then on.
  void* range =
      mmap(nullptr, pool_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (range == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("--pool-bytes=", pool_bytes,
                     ": no room for it in the address space: ", std::strerror(errno)));
  }
  auto* base = static_cast<uint8_t*>(range);
  std::vector<uint64_t> sizes = {pool_bytes - arenas};
  sizes.insert(sizes.end(), arena_bytes.begin(), arena_bytes.end());
  std::vector<Piece> pieces;
  uint64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    absl::StatusOr<std::shared_ptr<transport::SharedSegment>> segment =
        transport::SharedSegment::Create(i == 0 ? "kvmem-pool" : absl::StrCat("kvmem-arena-", i),
                                         sizes[i], base + offset);
    if (!segment.ok()) {
      // The pieces made unmap their parts as they go; the rest of the range is still ours.
      munmap(base + offset, pool_bytes - offset);
      return exhausted(segment.status());
    }
    pieces.push_back({*std::move(segment), offset});
    offset += sizes[i];
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(pieces)));
}

CpuBackend::CpuBackend(std::vector<Piece> pieces)
    : pieces_(std::move(pieces)),
      base_(pieces_.front().segment->data()),
      bytes_(pieces_.back().offset + pieces_.back().segment->bytes()) {}

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
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::InternalError(absl::StrCat(what, ": range [", offset, ", ", offset + bytes,
                                            ") outside the pool of ", bytes_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Prefault(uint64_t offset, uint64_t bytes) const {
  if (absl::Status s = CheckRange(offset, bytes, "prefault"); !s.ok()) return s;
  for (const Piece& p : pieces_) {  // each piece's part of the range
    const uint64_t begin = std::max(offset, p.offset);
    const uint64_t end = std::min(offset + bytes, p.offset + p.segment->bytes());
    if (begin >= end) continue;
    if (absl::Status s = p.segment->Populate(begin - p.offset, end - begin); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Write(absl::Span<const WriteOp> ops) {
  for (const WriteOp& op : ops) {
    if (absl::Status s = CheckRange(op.dst, op.bytes, "write"); !s.ok()) return s;
  }
  for (const WriteOp& op : ops) std::memcpy(base_ + op.dst, op.src, op.bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Read(absl::Span<const ReadOp> ops) {
  for (const ReadOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "read"); !s.ok()) return s;
  }
  for (const ReadOp& op : ops) std::memcpy(op.dst, base_ + op.src, op.bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Move(absl::Span<const MoveOp> ops) {
  for (const MoveOp& op : ops) {
    if (absl::Status s = CheckRange(op.src, op.bytes, "move source"); !s.ok()) return s;
    if (absl::Status s = CheckRange(op.dst, op.bytes, "move destination"); !s.ok()) return s;
  }
  for (const MoveOp& op : ops) {
    std::memmove(base_ + op.dst, base_ + op.src, op.bytes);
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
    kernels::QuantizeBlockRef(base_ + op.src, elem, geometry, op.start, op.count, base_ + op.dst);
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
    kernels::DequantizeBlockRef(base_ + op.src, geometry, op.start, op.count, elem, op.k_dst,
                                op.v_dst);
  }
  return absl::OkStatus();
}

std::optional<PoolExport> CpuBackend::pool_export() const { return pool_pieces().front(); }

std::vector<SharedMemoryExport> CpuBackend::pool_pieces() const {
  std::vector<SharedMemoryExport> pieces;
  for (const Piece& p : pieces_) pieces.push_back({p.segment, bytes_, p.offset});
  return pieces;
}

}  // namespace kvmem::store
