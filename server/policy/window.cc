#include "server/policy/window.h"

namespace kvmem::policy {
namespace {

class FullPolicy final : public Policy {
 public:
  const PolicyDescriptor& descriptor() const override { return FullDescriptor(); }
  Decision Step(const CallContext&, absl::Span<StreamState> streams) const override {
    return Decision{std::nan(""), 0, std::vector<std::optional<KeepSet>>(streams.size())};
  }
  // `full` never evicts, even when a target is asked: that is what the name promises.
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    return Step(ctx, streams);
  }
};

class WindowPolicy final : public Policy {
 public:
  explicit WindowPolicy(const ResolvedParams& params)
      : window_(static_cast<uint32_t>(params.Get("window"))) {}
  const PolicyDescriptor& descriptor() const override { return WindowDescriptor(); }
  Decision Step(const CallContext&, absl::Span<StreamState> streams) const override {
    return KeepLastOf(streams, window_);
  }
  // An explicit target narrows the window for this call only.
  Decision Compress(const CallContext& ctx, absl::Span<StreamState> streams) const override {
    return KeepLastOf(streams, ctx.target_tokens > 0 ? ctx.target_tokens : window_);
  }

 private:
  static Decision KeepLastOf(absl::Span<StreamState> streams, uint32_t w) {
    Decision decision;
    decision.budget_tokens = w;
    decision.keep.resize(streams.size());
    for (size_t s = 0; s < streams.size(); ++s) {
      const size_t n = streams[s].positions.size();
      if (n > w) {
        decision.keep[s] = KeepSet::Range(static_cast<uint32_t>(n - w), static_cast<uint32_t>(n));
      }
    }
    return decision;
  }
  const uint32_t window_;
};

}  // namespace

const PolicyDescriptor& FullDescriptor() {
  static const PolicyDescriptor* d =
      new PolicyDescriptor{"full", "Keeps every token (the quality ceiling).", {}, 0, 0};
  return *d;
}

const PolicyDescriptor& WindowDescriptor() {
  static const PolicyDescriptor* d =
      new PolicyDescriptor{"window",
                           "Sliding window: keeps the last W tokens of every stream, every step.",
                           {{"window", 512, 1, 1 << 24, true, "W, tokens kept per stream"}},
                           0,
                           0};
  return *d;
}

std::unique_ptr<Policy> MakeFullPolicy(const ResolvedParams&) {
  return std::make_unique<FullPolicy>();
}
std::unique_ptr<Policy> MakeWindowPolicy(const ResolvedParams& params) {
  return std::make_unique<WindowPolicy>(params);
}

}  // namespace kvmem::policy
