#pragma once
// Every check of a client's input that a mutation runs before it changes anything: appended
// chunks (shapes, finiteness, positions, the signals the policy needs), and a Step's or a
// Compress's signals (epoch, per-stream rows and window scores, logit statistics). An error
// names the field and the limit; a stale table (the rows follow an older one) is
// FAILED_PRECONDITION with the current epoch and version (TableVersions::StaleEpoch).
// The service only translates the wire format (f16 rows, field presence).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/engine/engine_types.h"
#include "server/engine/sequence.h"
#include "server/policy/policy.h"

namespace kvmem::engine {

// The largest value of an attention weight (a probability, with room for the rounding of a
// GQA group's mean: nine heads' 1.0 times a rounded 1/9 sums past 1, by 0.2 % in bf16) and
// of a window score (a sum of probabilities over the window's queries).
inline constexpr float kMaxAttention = 1.01f;
inline constexpr float kMaxWindowScore = 1e30f;

// Chunk `index` of an append (0: the first; later ones are named in errors): its shape
// against the layout and --max-message-bytes, finite K/V and signals, positions past
// *last_position (advanced to its last), and the per-token signals the policy needs.
// `written`: the K/V is in the pool already (an in-place write plan): the chunk must carry
// none.
absl::Status CheckChunk(const Sequence& seq, uint64_t max_append_bytes, const AppendChunk& chunk,
                        size_t index, int64_t* last_position, bool written = false)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

// A Step's input against the sequence, `pending` tokens appended before it runs (a folded
// step); `table_version`: the table the client says it holds (0: not said).
struct CheckedStep {
  std::vector<absl::Span<const float>> rows;  // by stream; empty spans without rows
  std::optional<policy::LogitStats> logits;
};
absl::StatusOr<CheckedStep> CheckStep(const Sequence& seq, const StepInput& input, size_t pending,
                                      uint64_t table_version) ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

struct CheckedCompress {
  std::vector<absl::Span<const float>> rows;           // by stream
  std::vector<absl::Span<const float>> window_scores;  // by stream
};
absl::StatusOr<CheckedCompress> CheckCompress(const Sequence& seq, const CompressInput& input)
    ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

}  // namespace kvmem::engine
