#pragma once
// Backend: the device that holds the pool and does the data work on it.
//
// One implementation per device (CpuBackend here; CudaBackend behind the same interface).
// The engine decides *what* moves; a backend only moves bytes. Every call takes a batch
// covering all streams of one request (one launch per operation per step on a GPU), and
// may complete asynchronously: work is ordered, and Synchronize() waits for all of it.
// Host pointers in a batch must stay valid until Synchronize() returns.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/quantize.h"
#include "server/store/slot_state.h"

namespace kvmem::transport {
class SharedSegment;
}

namespace kvmem::store {

// Host -> pool: `bytes` from `src` to pool offset `dst`.
struct WriteOp {
  const void* src;
  uint64_t dst;
  uint64_t bytes;
};

// Pool -> host.
struct ReadOp {
  uint64_t src;
  void* dst;
  uint64_t bytes;
};

// Pool -> pool. Ops in one batch apply in order, each as if by memmove; compaction relies
// on this (a stream's retained slots move toward its front, possibly overlapping; a copied
// block is then compacted in place). kernels/copy.h states how the CUDA twin keeps it.
struct MoveOp {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
};

// Layout block -> quantized block: live slots [start, start + count) of both planes.
struct QuantizeOp {
  uint64_t src;
  uint64_t dst;
  uint32_t start;
  uint32_t count;
};

// Quantized block -> host, in the layout dtype: slots [start, start + count) of K and V,
// [count][D] each.
struct DequantizeOp {
  uint64_t src;
  uint32_t start;
  uint32_t count;
  void* k_dst;
  void* v_dst;
};

// How a same-host process maps the pool without copies, one kind per mapping: a POSIX
// shared-memory segment (CPU backend) or a CUDA IPC handle of the device allocation (CUDA
// backend). In both, block offsets index into `bytes` of mapping.
struct SharedMemoryExport {
  // The pool's segment (a same-host client receives its descriptor: transport/attach_socket.h).
  std::weak_ptr<const transport::SharedSegment> segment;
  uint64_t bytes = 0;  // the pool's: what block offsets index into
  // Where the segment's first byte lies in the pool: 0 for the whole pool; with arenas
  // (CpuBackend's), each piece is a segment of its own, the shared part first.
  uint64_t offset = 0;
};
struct CudaIpcExport {
  std::string handle;  // cudaIpcMemHandle_t bytes
  uint64_t bytes = 0;
  int device = -1;          // device ordinal in the daemon
  std::string device_uuid;  // the GPU's UUID (hex), to find it in another process
};
using PoolExport = std::variant<SharedMemoryExport, CudaIpcExport>;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual absl::string_view kind() const = 0;  // "cpu", "cuda": for people, not for branching
  // Capabilities. Whether per-step policy work (scores, selection) should run where the
  // pool lives unless told otherwise (kvmemd --device_step=auto): true where moving the
  // scores to the host would cost a bus crossing per step.
  virtual bool prefers_device_step() const = 0;
  // Whether its slot states step together (SlotState::stepper()): a batch of steps then
  // costs one round trip to the device, not one per sequence.
  virtual bool steps_slot_states_together() const { return false; }
  virtual std::string device_name() const = 0;
  virtual uint64_t pool_bytes() const = 0;

  [[nodiscard]] virtual absl::Status Write(absl::Span<const WriteOp> ops) = 0;
  [[nodiscard]] virtual absl::Status Read(absl::Span<const ReadOp> ops) = 0;
  [[nodiscard]] virtual absl::Status Move(absl::Span<const MoveOp> ops) = 0;
  // Several move batches that touch disjoint bytes (the sequences of a batched step), each
  // applied in order; a backend may interleave them (the CUDA one runs their waves side by
  // side). By default, one after another.
  [[nodiscard]] virtual absl::Status MoveDisjoint(
      absl::Span<const absl::Span<const MoveOp>> batches) {
    for (absl::Span<const MoveOp> ops : batches) {
      if (absl::Status s = Move(ops); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // Quantization entry points (kernels/quantize.h is the contract); one call per batch.
  [[nodiscard]] virtual absl::Status Quantize(kernels::ElemType elem,
                                              const kernels::QuantGeometry& geometry,
                                              absl::Span<const QuantizeOp> ops) = 0;
  [[nodiscard]] virtual absl::Status Dequantize(const kernels::QuantGeometry& geometry,
                                                kernels::ElemType elem,
                                                absl::Span<const DequantizeOp> ops) = 0;
  [[nodiscard]] virtual absl::Status Synchronize() = 0;

  // Per-sequence slot metadata where this backend computes (slot_state.h).
  virtual absl::StatusOr<std::unique_ptr<SlotState>> CreateSlotState(uint32_t num_streams) = 0;

  // Makes [offset, offset + bytes) of the pool ready for writes without a page fault per
  // page (kvmemd maps the pool ahead of use, in the background: --pool-prefault). Changes
  // no byte, safe beside every other call. UNIMPLEMENTED where there is nothing to do (a
  // pool in device memory is ready when created) or the kernel cannot (before Linux 5.14).
  [[nodiscard]] virtual absl::Status Prefault(uint64_t /*offset*/, uint64_t /*bytes*/) const {
    return absl::UnimplementedError("the pool is ready when created");
  }

  // The same-host export of the pool, when the backend has one.
  virtual std::optional<PoolExport> pool_export() const { return std::nullopt; }
  // The pool's pieces, each a segment of its own: the whole pool in one (pool_export's), or
  // the shared part then each arena (CpuBackend::Create's). Empty where there are none.
  virtual std::vector<SharedMemoryExport> pool_pieces() const { return {}; }
  // The pool's bytes as this process addresses them, where they are host memory that may be
  // written in place of Write (a move's gets land there: SequenceImport::Reserve); null
  // where they are not (device memory).
  virtual uint8_t* host_pool() const { return nullptr; }
};

}  // namespace kvmem::store
