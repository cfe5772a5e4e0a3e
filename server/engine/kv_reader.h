#pragma once
// KvReader: the retained K/V of a sequence's streams, dequantized, in pieces. The sequence
// is found anew and locked for each piece (a reader that stops taking pieces holds nothing
// on it); the whole read is one state of its table: a change of epoch or version between
// pieces ends it with ABORTED.
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "server/engine/engine_types.h"
#include "server/engine/sequence_registry.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

class KvReader {
 public:
  KvReader(SequenceRegistry* registry, const store::BlockPool* pool, store::Backend* backend)
      : registry_(registry), pool_(pool), backend_(backend) {}

  // Calls `sink` per stream of layers [layer_begin, layer_end) in order ([0, 0): every
  // layer): once with the whole stream, or, with `piece_bytes` > 0, once per piece of
  // consecutive slots whose K+V and positions (10 bytes each, their packed most) fit it (at
  // least one slot a piece). `epoch` 0: the current one. A non-OK status from `sink` stops
  // the read and is returned.
  absl::Status Read(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin, uint32_t layer_end,
                    const std::function<absl::Status(StreamKV&&)>& sink, uint64_t piece_bytes);

 private:
  SequenceRegistry* const registry_;
  const store::BlockPool* const pool_;
  store::Backend* const backend_;
};

}  // namespace kvmem::engine
