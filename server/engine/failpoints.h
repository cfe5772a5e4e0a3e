#pragma once
// Failpoints: a test hook that makes the N-th operation of a kind fail, so that tests can
// sweep a failure over every point of a mutation (allocation, backend call, commit step)
// and check that the sequence is either unchanged or poisoned. Production engines have
// none (EngineConfig::failpoints is null); the checks then cost one pointer test.
#include <atomic>
#include <cstdint>

namespace kvmem::engine {

class Failpoints {
 public:
  enum Site : int { kAllocate = 0, kCommit = 1, kNumSites = 2 };

  // The n-th hit (1-based) of `site` from now on fails; 0 disarms it.
  void FailAt(Site site, uint64_t n) {
    hits_[site].store(0);
    fail_at_[site].store(n);
  }
  void Disarm() {
    for (int s = 0; s < kNumSites; ++s) FailAt(static_cast<Site>(s), 0);
  }
  // Counts a hit; true when this is the one that must fail.
  bool Hit(Site site) {
    const uint64_t n = hits_[site].fetch_add(1) + 1;
    return fail_at_[site].load() == n;
  }
  uint64_t hits(Site site) const { return hits_[site].load(); }

 private:
  std::atomic<uint64_t> hits_[kNumSites] = {};
  std::atomic<uint64_t> fail_at_[kNumSites] = {};
};

}  // namespace kvmem::engine
