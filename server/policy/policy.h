#pragma once
// The policy interface: pure functions from per-stream state and per-step signals to a
// keep-set per stream. No I/O, no device code, no knowledge of blocks or the pool.
//
// The engine calls Step() once per decode step and Compress() on explicit compression
// (after prefill, every N tokens). Before calling, the engine has validated every signal
// the policy declares it needs (lengths, finiteness, epochs), so policies trust their input.
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/select.h"
#include "server/common/keep_set.h"
#include "server/policy/params.h"

namespace kvmem::policy {

// Signals a policy may need; a worker sends only what its sequence's policy declares.
enum Signal : uint32_t {
  kLogitStats = 1u << 0,     // entropy, p1, p2 of the next-token distribution
  kAttentionRows = 1u << 1,  // newest query's attention per stream
  kWindowScores = 1u << 2,   // prefill window column sums per stream
  kTokenEntropy = 1u << 3,   // per appended token
  kLayerDistance = 1u << 4,  // per appended token
};
using SignalSet = uint32_t;
std::vector<std::string> SignalNames(SignalSet signals);

struct PolicyDescriptor {
  std::string name;
  std::string description;
  std::vector<ParamSpec> params;
  SignalSet step_signals = 0;      // required on every Step
  SignalSet compress_signals = 0;  // required on every Compress
  SignalSet append_signals = 0;    // per-token signals required on every Append
  // Score state of a newly appended slot (NaN = "not scored yet"); none = the policy keeps
  // no per-slot score (StreamState::scores and next_scores are then empty, and the engine
  // neither keeps nor stages one: 8 bytes per slot and stream saved). A policy with a kernel
  // step keeps one.
  std::optional<float> initial_score;
  // Cross-parameter check run once the parameters are resolved (may be null).
  absl::Status (*check)(const ResolvedParams& params) = nullptr;
  // Whether the policy reads StreamState::arrival_step; none other keeps it (8 bytes per
  // slot and stream saved, and one column less to close up at every eviction).
  bool arrival_steps = false;
};

struct LogitStats {
  float entropy;  // nats, over the full vocabulary
  float p1;
  float p2;
};

// One stream (layer, kv_head) as a policy sees it. Every span is aligned with the stream's
// retained slots in block-table order.
struct StreamState {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  absl::Span<const int64_t> positions;  // original token positions, increasing
  // Score state (EMA or accumulated attention) as the last committed call left it. A policy
  // never writes it: it writes the next state to `next_scores` (same length; every slot,
  // when it writes at all) and says so in Decision::scores_written. The engine commits the
  // next state only when the whole call succeeds, so a failed call leaves no trace. The two
  // spans may alias (an in-place caller): read scores[j] before writing next_scores[j].
  absl::Span<const float> scores;
  absl::Span<float> next_scores;
  // The last CallContext::history_rows attention rows of this stream, [slot][history_rows],
  // row of step t in column t % history_rows (0 where the slot did not exist yet). The
  // engine records each Step's row after the call commits.
  absl::Span<const float> history;
  absl::Span<const float> attention;      // this call's row; empty when not sent
  absl::Span<const float> window_scores;  // Compress only; empty when not sent
  // Per slot, NaN where the worker sent none; empty unless the policy declares a per-token
  // signal (PolicyDescriptor::append_signals).
  absl::Span<const float> token_entropy;
  absl::Span<const float> layer_distance;
  // Step at which the slot was appended; empty unless PolicyDescriptor::arrival_steps.
  absl::Span<const int64_t> arrival_step;
};

struct CallContext {
  uint64_t step = 0;  // index of this decode step (Step) or of the next one (Compress)
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t vocab_size = 0;
  std::optional<LogitStats> logits;
  uint32_t target_tokens = 0;  // Compress: per-stream target asked by the caller; 0 = own rule
  uint32_t history_rows = 0;   // Policy::history_rows() (StreamState::history's width)
  // Sequence-level mark the policy keeps across calls (infokv: the newest position already
  // compressed); -1 until the policy sets one through Decision::mark.
  int64_t mark = -1;
};

struct Decision {
  double confidence = std::nan("");
  uint32_t budget_tokens = 0;  // 0 = unbounded
  // keep[s]: the slots of stream s to retain (ascending runs); nullopt = keep every slot.
  std::vector<std::optional<KeepSet>> keep;
  bool scores_written = false;  // every stream's next_scores holds the next score state
  std::optional<int64_t> mark;  // the next CallContext::mark, when it changes
};

// A Step whose whole work is "update every slot's score with the newest attention row by
// a rule, then keep each stream's top slots by priority" (kernels/select.h), so that it
// can run where the scores live (store::SlotState, on the device) instead of in Step().
// It decides exactly what Step() would.
struct KernelStep {
  kernels::ScoreStep op;
  std::vector<uint32_t> layer_budget;  // SelectTop budget per layer
  uint32_t protect = 0;                // newest slots always kept
  double confidence = std::nan("");
  uint32_t budget_tokens = 0;
};

// A policy holds its parameters only: every per-sequence state it keeps across calls lives
// in the sequence (scores, history, mark), is handed in read-only and changed only through
// the Decision, so that the engine can make each call all-or-nothing, account the state and
// copy it on Fork. The same inputs always give the same Decision.
class Policy {
 public:
  virtual ~Policy() = default;
  virtual const PolicyDescriptor& descriptor() const = 0;
  virtual Decision Step(const CallContext& ctx, absl::Span<StreamState> streams) const = 0;
  virtual Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const = 0;
  // Policies with a kernel step say so (it decides, at creation, where a sequence's scores
  // live) and plan every Step with PlanKernelStep instead of calling Step().
  virtual bool has_kernel_step() const { return false; }
  virtual KernelStep PlanKernelStep(const CallContext& ctx) const;
  // Attention rows of past Steps the policy reads (StreamState::history); 0 = none.
  virtual uint32_t history_rows() const { return 0; }
};

// Every policy this build knows, in a stable order.
const std::vector<PolicyDescriptor>& AllPolicies();

// A policy instance for one sequence; "" means "full". Errors name policy.name or
// policy.params[...].
absl::StatusOr<std::unique_ptr<Policy>> CreatePolicy(absl::string_view name,
                                                     const ParamOverrides& overrides);

// Checks worker-sent logit stats: entropy in [0, ln V], p1 in (0, 1], p2 in [0, p1].
absl::StatusOr<LogitStats> CheckLogitStats(const LogitStats& stats, uint32_t vocab_size);
// Derives the stats from the top-k log-probabilities (descending, k >= 2). [ours] The mass
// outside the top k counts as one outcome, so the entropy is a lower bound of the full one.
absl::StatusOr<LogitStats> LogitStatsFromTopLogprobs(absl::Span<const float> top_logprobs);

}  // namespace kvmem::policy
