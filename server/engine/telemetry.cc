#include "server/engine/telemetry.h"

#include <algorithm>
#include <cstring>

namespace kvmem::engine {
namespace {

uint64_t Bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

double FromBits(uint64_t b) {
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

void AddDouble(std::atomic<uint64_t>& bits, double value) {
  uint64_t old = bits.load(std::memory_order_relaxed);
  while (!bits.compare_exchange_weak(old, Bits(FromBits(old) + value), std::memory_order_relaxed)) {
  }
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  if (value != value) return;  // NaN: nothing measured
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();  // le
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AddDouble(sum_bits_, value);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  s.counts.resize(bounds_.size() + 1);
  for (size_t i = 0; i < s.counts.size(); ++i) {
    s.counts[i] = counts_[i].load(std::memory_order_relaxed);
    s.count += s.counts[i];
  }
  s.sum = FromBits(sum_bits_.load(std::memory_order_relaxed));
  return s;
}

void FractionalCounter::Add(double value) { AddDouble(bits_, value); }

double FractionalCounter::Read() const { return FromBits(bits_.load(std::memory_order_relaxed)); }

std::vector<double> LatencyBounds() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
          1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1,    2.5,    10};
}

std::vector<double> UnitBounds() {
  std::vector<double> b;
  for (int i = 1; i <= 20; ++i) b.push_back(i * 0.05);
  return b;
}

std::vector<double> MassBounds() {
  return {0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1};
}

std::vector<double> BudgetBounds() {
  std::vector<double> b;
  for (double v = 16; v <= (1 << 20); v *= 2) b.push_back(v);
  return b;
}

PolicyTelemetry::PolicyTelemetry()
    : step_seconds{Histogram(LatencyBounds()), Histogram(LatencyBounds())},
      append_seconds(LatencyBounds()),
      compress_seconds(LatencyBounds()),
      confidence(UnitBounds()),
      budget_tokens(BudgetBounds()),
      evicted_attention_mass(MassBounds()),
      quantized_attention_mass(MassBounds()) {}

Telemetry::Telemetry(const std::vector<std::string>& policies) {
  for (const std::string& name : policies) {
    policies_.push_back(std::make_unique<PolicyTelemetry>());
    policies_.back()->policy = name;
    by_name_[name] = policies_.back().get();
  }
}

PolicyTelemetry* Telemetry::For(std::string_view policy) const {
  auto it = by_name_.find(absl::string_view(policy.data(), policy.size()));
  return it == by_name_.end() ? nullptr : it->second;
}

double EvictedMass(absl::Span<const float> row, const KeepSet& keep) {
  // A step drops few slots of many: walk the gaps between kept runs, not every slot, in
  // ascending slot order as a walk over every slot would sum them.
  double mass = 0;
  size_t next = 0;  // the first slot not yet accounted for
  for (const SlotRun& run : keep.runs()) {
    // A run out of order or past the row (callers check first) counts only where it adds
    // slots, so that the walk stays inside the row all the same.
    const size_t begin = std::min<size_t>(run.begin, row.size());
    for (; next < begin; ++next) mass += row[next];
    next = std::max(next, std::min<size_t>(run.end, row.size()));
  }
  for (; next < row.size(); ++next) mass += row[next];
  return mass;
}

}  // namespace kvmem::engine
