#pragma once
// What kvmem's UCX clients (UcxPool: reads, UcxSender: appends) share: a context and worker
// of the features they use, and an endpoint to the daemon's worker. Internal to the client
// library.
#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvmem::client::ucx {

// UNAVAILABLE naming the UCX call that failed and why.
absl::Status Failed(absl::string_view what, ucs_status_t status);

// A context of `features` (UCX_TLS and the rest from the environment) and its worker.
absl::Status MakeWorker(uint64_t features, ucs_thread_mode_t thread_mode, ucp_context_h* context,
                        ucp_worker_h* worker);

// An endpoint to the worker at `address` (a daemon's packed address) that fails the requests
// in flight when the peer goes away, where the transports can tell (TCP); shared memory
// cannot (UCX refuses peer error handling there), and there it has none: `*peer_errors`
// says which.
absl::Status Connect(ucp_worker_h worker, const std::string& address, ucp_ep_h* ep,
                     bool* peer_errors);

}  // namespace kvmem::client::ucx
