#pragma once
// What a sequence reports about itself, under its lock: its line of Stats, the pool bytes of
// its table blocks by storage precision, and (for tests' state fingerprints) everything it
// holds as text.
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine/engine_types.h"
#include "server/engine/sequence.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

SequenceSummary Summarize(const Sequence& seq, absl::Time now) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
// Adds the sequence's table block bytes to `by_precision` (keys: the layout's dtype name,
// then the quantized precision's).
void AddBlockBytes(const Sequence& seq, absl::flat_hash_map<std::string, uint64_t>* by_precision)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
// Per-slot metadata and scores and the block list, as text, without the epoch or the K/V.
absl::StatusOr<std::string> DescribeState(const Sequence& seq, const store::BlockPool& pool)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

}  // namespace kvmem::engine
