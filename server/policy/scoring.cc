#include "server/policy/scoring.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvmem::policy {

std::vector<uint32_t> TopK(absl::Span<const float> scores, absl::Span<const uint32_t> candidates,
                           size_t k) {
  const size_t m = candidates.size();
  if (k >= m) return std::vector<uint32_t>(candidates.begin(), candidates.end());
  // "Better" = higher score, ties to the older slot. Decode steps drop a handful of slots
  // from hundreds, so the code finds the m - k worst and returns the rest in order.
  auto worse = [&](uint32_t a, uint32_t b) {
    return scores[a] < scores[b] || (scores[a] == scores[b] && a > b);
  };
  const size_t drop = m - k;
  std::vector<uint32_t> dropped;
  if (drop == 1) {
    dropped.push_back(*std::min_element(candidates.begin(), candidates.end(), worse));
  } else {
    dropped.assign(candidates.begin(), candidates.end());
    std::nth_element(dropped.begin(), dropped.begin() + (drop - 1), dropped.end(), worse);
    dropped.resize(drop);
  }
  std::sort(dropped.begin(), dropped.end());
  std::vector<uint32_t> keep;
  keep.reserve(k);
  size_t d = 0;
  for (uint32_t c : candidates) {
    if (d < dropped.size() && dropped[d] == c) {
      ++d;
    } else {
      keep.push_back(c);
    }
  }
  return keep;
}

std::vector<uint32_t> MergeSorted(absl::Span<const uint32_t> a, absl::Span<const uint32_t> b) {
  std::vector<uint32_t> out;
  out.reserve(a.size() + b.size());
  std::set_union(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

std::vector<float> AvgPool(absl::Span<const float> x, uint32_t kernel) {
  const int64_t half = kernel / 2;
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> out(x.size());
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t j = std::max<int64_t>(0, i - half); j <= std::min(n - 1, i + half); ++j) {
      sum += x[j];
    }
    out[i] = static_cast<float>(sum / kernel);
  }
  return out;
}

std::vector<uint32_t> KeepWindowPlusTop(size_t n, size_t window, size_t budget,
                                        absl::Span<const float> scores) {
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  if (n <= budget) return all;
  window = std::min(window, budget);
  const size_t prefix = n - window;
  std::vector<uint32_t> kept =
      TopK(scores, absl::MakeConstSpan(all).first(prefix), budget - window);
  for (size_t i = prefix; i < n; ++i) kept.push_back(static_cast<uint32_t>(i));
  return kept;
}

double Confidence(double entropy, double p1, double p2, uint32_t vocab_size, double w_entropy,
                  double w_gap, double w_p1) {
  const double normalized = 1.0 - entropy / std::log(static_cast<double>(vocab_size));
  const double gap = p1 > 0 ? 1.0 - p2 / p1 : 0.0;
  return w_entropy * std::clamp(normalized, 0.0, 1.0) + w_gap * gap + w_p1 * p1;
}

std::vector<uint32_t> PyramidBudgets(uint32_t n, uint32_t budget, uint32_t window,
                                     uint32_t num_layers, uint32_t beta) {
  if (n < budget || budget <= window) return {};
  const int64_t cw = int64_t{budget} - window;
  if (n < 2 * cw || num_layers < 2) {
    return std::vector<uint32_t>(num_layers, static_cast<uint32_t>(cw));
  }
  int64_t min_budget = cw / beta;
  int64_t max_budget = 2 * cw - min_budget;
  if (max_budget >= int64_t{n} - window) {
    max_budget = int64_t{n} - window;
    min_budget = 2 * cw - max_budget;
  }
  const int64_t step = (max_budget - min_budget) / (num_layers - 1);
  std::vector<uint32_t> budgets(num_layers);
  for (uint32_t l = 0; l < num_layers; ++l) {
    budgets[l] = static_cast<uint32_t>(std::max<int64_t>(0, max_budget - l * step));
  }
  return budgets;
}

uint32_t RefreeStopIndex(const std::vector<std::vector<float>>& rows, double threshold) {
  if (rows.empty()) return 0;
  const size_t m = rows[0].size();
  // Suffix norms per head: tail[h][j] = sqrt(sum_{k >= j} a_h[k]^2).
  std::vector<double> mean_tail(m + 1, 0.0);
  for (const std::vector<float>& row : rows) {
    double acc = 0;
    mean_tail[m] += 0;
    for (size_t j = m; j-- > 0;) {
      acc += double{row[j]} * row[j];
      mean_tail[j] += std::sqrt(acc);
    }
  }
  for (double& v : mean_tail) v /= static_cast<double>(rows.size());
  const double base = mean_tail[0];
  if (base <= 0) return 0;
  uint32_t stop = 0;
  for (size_t j = 0; j <= m; ++j) {
    if ((base - mean_tail[j]) / base <= threshold) stop = static_cast<uint32_t>(j);
  }
  return stop;
}

}  // namespace kvmem::policy
