#pragma once
// UcxPlane: kvmemd's UCX worker (kvmemd --ucx). It registers memory regions once (the pool
// and the epoch board) for remote reads only — RMA get; nothing remote writes into them —
// packs their remote keys, and makes progress on a thread of its own: reads over TCP need
// the target's worker to progress (shared memory and CMA do not). The keys are handed out
// only as GetInfo's `ucx`, to callers that may read the pool (as the attach ticket). A key
// covers its whole region: like a mapping of the pool, it reads every tenant's blocks.
//
// Keys protect only where the network enforces them (RDMA hardware). Over TCP and shared
// memory UCX emulates RMA with messages that its own handlers serve without checking a key,
// a region or its protection: any process that reaches the worker can read and write any of
// kvmemd's memory. So kvmemd starts it only when told the network is trusted
// (--ucx_trusted_network), until reads are served by a protocol of kvmemd's own.
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace kvmem::transport {

class UcxPlane {
 public:
  struct Region {
    const void* base;
    uint64_t bytes;
  };
  // A registered region as a remote reader names it.
  struct Exported {
    std::string rkey;  // ucp_rkey_pack's bytes
    uint64_t address = 0;
    uint64_t bytes = 0;
  };

  // Transports come from UCX's environment as usual (UCX_TLS, UCX_NET_DEVICES).
  static absl::StatusOr<std::unique_ptr<UcxPlane>> Start(const std::vector<Region>& regions);
  // Stops progress, deregisters the regions and ends the worker.
  ~UcxPlane();
  UcxPlane(const UcxPlane&) = delete;
  UcxPlane& operator=(const UcxPlane&) = delete;

  const std::string& worker_address() const { return address_; }
  const Exported& region(size_t i) const { return exported_[i]; }

 private:
  struct Handles;
  UcxPlane();
  void Progress();

  std::unique_ptr<Handles> ucx_;
  std::string address_;
  std::vector<Exported> exported_;
  int stop_fd_ = -1;
  std::thread progress_;
};

}  // namespace kvmem::transport
