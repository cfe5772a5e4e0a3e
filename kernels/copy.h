#pragma once
// Batched byte copies on the pool: compaction moves, appends (scatter from a staging
// buffer into blocks) and reads (gather from blocks into a staging buffer). The C++
// reference (copy_ref.cc) is what the CPU backend runs; copy.cu is the CUDA twin.
//
// Semantics of a move batch: the ops apply in order, each as if by memmove (an op may
// overlap itself). The CUDA twin runs a batch as few "waves" as that allows: within a wave
// every source is read before any destination is written (gather to scratch, then
// scatter), so a wave may not contain an op whose source overlaps an earlier op's
// destination in the same wave (read after write), nor two ops writing the same bytes
// (write after write). MoveWaves() splits a batch at exactly those points; reading what a
// later op overwrites (write after read) is fine within a wave. Results are byte-exact
// against the reference for every batch.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvmem::kernels {

struct CopyOp {
  uint64_t src;    // byte offset in the source buffer
  uint64_t dst;    // byte offset in the destination buffer
  uint64_t bytes;  // length; 0 is allowed and copies nothing
};

// In-order memmove of every op inside one buffer.
void MoveBatchRef(uint8_t* base, const CopyOp* ops, size_t n);

// From `src` to `dst` (distinct buffers): ops[i] copies [src+ops[i].src, +bytes) to
// [dst+ops[i].dst, +bytes). Destinations must not overlap (the order is unspecified).
void CopyBatchRef(const uint8_t* src, uint8_t* dst, const CopyOp* ops, size_t n);

// From `src` to destinations anywhere (pointers into distinct allocations: the slot states
// of a batch): ops[i] copies [src + ops[i].src, + bytes) to ops[i].dst. Destinations must
// not overlap.
struct ScatterOp {
  uint64_t src;
  uint8_t* dst;
  uint64_t bytes;
};
void ScatterBatchRef(const uint8_t* src, const ScatterOp* ops, size_t n);

// Start indices of the waves of a move batch (always begins with 0; empty for n = 0).
std::vector<size_t> MoveWaves(const CopyOp* ops, size_t n);

// How the CUDA twin runs a move batch: per wave, `gather` copies every source into a
// scratch buffer (packed, each run 16-byte aligned, `scratch_bytes` in all) and `scatter`
// copies the scratch to the destinations. Running the waves in order, each gather before
// its scatter, equals MoveBatchRef.
struct MoveWave {
  std::vector<CopyOp> gather;   // pool -> scratch
  std::vector<CopyOp> scatter;  // scratch -> pool
  uint64_t scratch_bytes = 0;
};
std::vector<MoveWave> PlanMoveWaves(const CopyOp* ops, size_t n);
// The waves of several move batches that touch disjoint bytes (the sequences of a batched
// step): wave w runs every batch's own wave w, so the batches take as many waves as the
// longest of them, not their sum. Running them equals MoveBatchRef of each batch.
std::vector<MoveWave> PlanMoveWaves(const std::vector<std::vector<CopyOp>>& batches);

}  // namespace kvmem::kernels
