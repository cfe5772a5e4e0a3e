#pragma once
// A view of another KvStore without the slots whose positions fall in [drop_from, drop_to):
// what attention would see had those tokens been evicted (kvmem_worker kl). Reads only; the
// inner store must outlive the view.
#include <cstdint>

#include "model.h"

namespace kvmem::worker {

class DroppingKvStore final : public KvStore {
 public:
  // `head_dim`: floats per slot in the inner store's runs.
  DroppingKvStore(KvStore& inner, int64_t drop_from, int64_t drop_to, uint32_t head_dim)
      : inner_(inner), from_(drop_from), to_(drop_to), dim_(head_dim) {}
  absl::Status BeginForward() override { return inner_.BeginForward(); }
  absl::Status Past(uint32_t layer, uint32_t kv_head, PastStream* out) override;

 private:
  KvStore& inner_;
  int64_t from_, to_;
  uint32_t dim_;
};

}  // namespace kvmem::worker
