#pragma once
// Which step signals each sequence's policy uses (GetInfo's PolicyInfo::step_signals), for
// the sequences a client created or forked: Step and StepBatch send no others. A sequence
// not recorded (another client's) is sent every signal. Thread-safe; internal to the C++
// client.
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvmem/client.h"

namespace kvmem::client::internal {

class PolicySignals {
 public:
  struct Needs {
    bool logit_stats = true, attention_rows = true;
  };

  // Whether Learn has run (the daemon's policies are known).
  bool known() const;
  void Learn(const Info& info);
  // Sequence `sequence_id` runs `policy`; a policy not learned records nothing.
  void Record(uint64_t sequence_id, const std::string& policy);
  // A Fork's child uses its parent's signals.
  void Inherit(uint64_t parent_id, uint64_t child_id);
  Needs Of(uint64_t sequence_id) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Needs> by_policy_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Needs> by_sequence_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmem::client::internal
