#pragma once
// The keep-set of kernels/select.h's SelectTop for one stream, computed the obvious way:
// every candidate's priority by the formula, then a full sort by (priority desc, index
// asc). The oracle of the kernel tests and of the slot-state script.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/select.h"

namespace kvmem::testing {

// keep[j] = 1 for the slots of an n-slot stream that SelectTop keeps.
inline std::vector<uint8_t> OracleTopFlags(const float* scores, const int64_t* pos, uint32_t n,
                                           uint32_t budget, uint32_t protect, float max_score,
                                           float weight) {
  std::vector<uint8_t> keep(n, 1);
  if (n <= budget) return keep;
  protect = std::min(protect, budget);
  const uint32_t unprotected = n - protect;
  const kernels::PriorityScale p =
      kernels::PriorityScaleFor(weight, max_score, pos[n - 1] - pos[0]);
  std::vector<std::pair<float, uint32_t>> r;
  for (uint32_t j = 0; j < unprotected; ++j) {
    const float a = scores[j] * p.e_scale;
    const float b = static_cast<float>(pos[j] - pos[0]) * p.r_scale;
    r.push_back({(a + b) + p.r_const, j});
  }
  std::sort(r.begin(), r.end(), [](auto x, auto y) {
    return x.first != y.first ? x.first > y.first : x.second < y.second;
  });
  for (uint32_t j = 0; j < unprotected; ++j) keep[j] = 0;
  for (uint32_t i = 0; i < budget - protect; ++i) keep[r[i].second] = 1;
  return keep;
}

}  // namespace kvmem::testing
