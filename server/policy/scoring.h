#pragma once
// Pure helpers shared by the policies: selection, pooling, the confidence of CONF-KV, the
// pyramid budgets of PyramidKV and the stopping rule of ReFreeKV. Formulas and defaults are
// in ../shared/ALGORITHMS.md; every helper here is tested by hand-computed cases.
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace kvmem::policy {

// The `k` candidates with the largest scores, in candidate order; ties go to the older
// (smaller) index so that selection is deterministic. `candidates` must be ascending.
std::vector<uint32_t> TopK(absl::Span<const float> scores, absl::Span<const uint32_t> candidates,
                           size_t k);

// Ascending union of two ascending index lists without duplicates.
std::vector<uint32_t> MergeSorted(absl::Span<const uint32_t> a, absl::Span<const uint32_t> b);

// 1-D average pooling, stride 1, zero padding (kernel/2 each side), divided by `kernel`
// (PyTorch avg_pool1d with count_include_pad=True, as SnapKV uses it).
std::vector<float> AvgPool(absl::Span<const float> x, uint32_t kernel);

// Keeps the last `window` slots of n plus the top (budget - window) of the rest by
// `scores` (pooled by the caller as needed). Returns all of [0, n) if n <= budget.
std::vector<uint32_t> KeepWindowPlusTop(size_t n, size_t window, size_t budget,
                                        absl::Span<const float> scores);

// CONF-KV confidence: w_h (1 - H / ln V) + w_g (1 - p2 / p1) + w_p p1.
double Confidence(double entropy, double p1, double p2, uint32_t vocab_size, double w_entropy,
                  double w_gap, double w_p1);

// PyramidKV per-layer budgets (tokens kept beyond the window) for n tokens, total budget C,
// window w, L layers and beta. Empty when n < C (no compression); all equal to C - w when
// n < 2 (C - w) (no pyramid).
std::vector<uint32_t> PyramidBudgets(uint32_t n, uint32_t budget, uint32_t window,
                                     uint32_t num_layers, uint32_t beta);

// ReFreeKV stopping index: rows[h] is head h's attention over the candidates in eviction
// order. B = mean_h ||a_h||, N_j = mean_h ||a_h[j:]||, drop_j = (B - N_j) / B; returns the
// largest j in [0, |cand|] with drop_j <= threshold (0 when B is 0).
uint32_t RefreeStopIndex(const std::vector<std::vector<float>>& rows, double threshold);

}  // namespace kvmem::policy
