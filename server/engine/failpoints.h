#pragma once
// Failpoints: a test hook that makes the N-th operation of a kind fail, so that tests can
// sweep a failure over every point of a mutation (allocation, backend call, commit step)
// and check that the sequence is either unchanged or poisoned. Production engines have
// none (EngineConfig::failpoints is null); the checks then cost one pointer test.
#include <atomic>
#include <cstdint>
#include <new>

namespace kvmem::engine {

class Failpoints {
 public:
  // kHostAlloc: a host allocation of a mutation's planning (std::bad_alloc, thrown by
  // ThrowIfHit) after it has taken pool blocks or loaded state it must give back.
  enum Site : int { kAllocate = 0, kCommit = 1, kHostAlloc = 2, kNumSites = 3 };

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
  // Throws std::bad_alloc when this hit of `site` is the one that must fail; for a null
  // hook (production) a pointer test.
  static void ThrowIfHit(Failpoints* hook, Site site) {
    if (hook != nullptr && hook->Hit(site)) throw std::bad_alloc();
  }

 private:
  std::atomic<uint64_t> hits_[kNumSites] = {};
  std::atomic<uint64_t> fail_at_[kNumSites] = {};
};

}  // namespace kvmem::engine
