#pragma once
// UcxPool: a daemon's pool read from another process — on another host, or here — by UCX
// RMA get (kvmemd --ucx; GetInfo's `ucx`, offered to callers that may read the pool), under
// the same epoch protocol as a mapping (shared_pool.h): the sequence's epoch word is read
// remotely before and after the blocks, and a read across an epoch change is refused, never
// used. Transports come from UCX's environment (UCX_TLS: tcp, shared memory, CMA, ...).
// Reads only: the daemon registers nothing for remote writes. One read at a time per pool
// (its worker is single-threaded); a peer that goes away fails a read within `deadline`,
// and the pool with it (connect a new one).
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvmem/client.h"
#include "kvmem/shared_pool.h"

namespace kvmem::client {

// Privately a MappedPool: its block views would hold the daemon's addresses, which are not
// this process's to dereference; ReadStream copies the bytes out.
class UcxPool final : private MappedPool {
 public:
  using MappedPool::ReadStream;
  using MappedPool::ReadStreams;
  static absl::StatusOr<std::unique_ptr<UcxPool>> Connect(
      const Info& info, absl::Duration deadline = absl::Seconds(10));
  ~UcxPool() override;

  // The epoch checks, read remotely (shared_pool.h's protocol).
  absl::Status BeginRead(const BlockTable& table) const override;
  absl::Status EndRead(const BlockTable& table) const override;
  // Copies each read's pool bytes [offset, offset + bytes) into its destination, every get
  // posted before any is waited for (a kvmemd moving another's sequence to itself reads its
  // blocks so: MoveSequence). OUT_OF_RANGE for bytes outside the pool, nothing read.
  using PoolRead = client::PoolRead;
  absl::Status ReadPool(absl::Span<const PoolRead> reads) const;
  // Bytes read from the daemon so far, and the gets that read them.
  uint64_t bytes_read() const;
  uint64_t gets() const;
  // A read failed (the daemon went away, or a read outlasted its deadline): every read
  // fails from then on; connect a new pool. A read that fails ABORTED left a get in flight
  // (its endpoint's forced close did not complete within a second): a transport may still
  // write into that read's destinations, which must never be used or reused (a software
  // transport writes only while the worker progresses, which it never does again; a
  // hardware one may).
  bool broken() const;
  // While one lives, every read on this thread ends by `until` at the latest (a daemon
  // reading for a call ends by the call's deadline, not the pool's `deadline` later);
  // scopes nest, the earliest applies. A scope ends on the thread it began on (nothing
  // suspends inside one). A read found past it fails with DEADLINE_EXCEEDED before posting
  // anything (the pool stays whole); one that outlasts it fails so too, and ends the pool
  // as any read past its deadline does.
  class Deadline {
   public:
    explicit Deadline(absl::Time until);
    ~Deadline();
    Deadline(const Deadline&) = delete;
    Deadline& operator=(const Deadline&) = delete;

   private:
    absl::Time outer_;
  };
  // The most memory a pool holds for its reads besides their destinations: CopyOutMany's
  // staging buffer (a daemon that keeps pools reserves it from its budget: PeerLinks).
  static constexpr uint64_t kStagingBytes = 16ull << 20;

 private:
  struct Handles;
  UcxPool();
  absl::Status CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const override;
  absl::Status CopyOutMany(absl::Span<const OutCopy> copies) const override;
  // One get of `bytes` at the daemon's `address` in the region of `rkey` (a ucp_rkey_h),
  // waited for.
  absl::Status Get(void* dst, uint64_t address, uint64_t bytes, void* rkey) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct GetOp {
    void* dst;
    uint64_t address, bytes;
    void* rkey;
  };
  // The most bytes one get of CopyOutMany's reads.
  static constexpr uint64_t kMaxRunBytes = 8ull << 20;
  // Gets, all posted before any is waited for; the deadline covers them all.
  absl::Status Gets(absl::Span<const GetOp> ops) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> EpochWord(uint32_t slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<Handles> ucx_;
  absl::Duration deadline_;
  uint64_t board_address_ = 0;
  uint32_t stride_ = 0, slots_ = 0;
  mutable absl::Mutex mu_;
  mutable uint64_t bytes_read_ ABSL_GUARDED_BY(mu_) = 0;
  mutable uint64_t gets_ ABSL_GUARDED_BY(mu_) = 0;
  // Set under mu_; read without it (whether to connect anew must not wait for a read).
  mutable std::atomic<bool> broken_{false};
  mutable std::vector<uint8_t> staging_ ABSL_GUARDED_BY(mu_);  // CopyOutMany's
};

}  // namespace kvmem::client
