#include "dropping_kv_store.h"

#include <utility>

namespace kvmem::worker {

absl::Status DroppingKvStore::Past(uint32_t layer, uint32_t kv_head, PastStream* out) {
  PastStream all;
  if (absl::Status s = inner_.Past(layer, kv_head, &all); !s.ok()) return s;
  out->runs.clear();
  out->positions.clear();
  out->scratch = std::move(all.scratch);  // runs may point into it; moving keeps the buffer
  size_t base = 0;                        // index in all.positions of the run's first slot
  for (const PastStream::Run& run : all.runs) {
    uint32_t begin = 0;
    for (uint32_t i = 0; i <= run.count; ++i) {
      const bool end = i == run.count;
      const bool dropped =
          !end && all.positions[base + i] >= from_ && all.positions[base + i] < to_;
      if (!end && !dropped) continue;
      if (i > begin) {
        out->runs.push_back(
            {run.k + uint64_t{begin} * dim_, run.v + uint64_t{begin} * dim_, i - begin});
        out->positions.insert(out->positions.end(), all.positions.begin() + base + begin,
                              all.positions.begin() + base + i);
      }
      begin = i + 1;
    }
    base += run.count;
  }
  return absl::OkStatus();
}

}  // namespace kvmem::worker
