#pragma once
// UcxSender: remote appends by UCX (kvmemd --ucx; AppendRequest.ucx_payload). An Append's
// K/V goes to the daemon's worker as one active message (rendezvous above
// kRendezvousBytes: only its header travels until the daemon, once the call has announced
// it, pulls the data), while the gRPC call carries the positions and signals and answers
// when the K/V has landed and the append applied, whole or not at all. Transports come
// from UCX's environment (UCX_TLS: tcp, shared memory, CMA, ...). A progress thread of its
// own serves the daemon's pulls while the caller waits for the call. Thread-safe; sends
// from several threads share the one endpoint.
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvmem/client.h"

namespace kvmem::client {

class UcxSender {
 public:
  // Above this, a payload goes by rendezvous (the daemon holds an early eager message of
  // at most 64 KiB).
  static constexpr uint64_t kRendezvousBytes = 32 << 10;

  // `info`: the daemon's GetInfo (its ucx.worker_address).
  static absl::StatusOr<std::unique_ptr<UcxSender>> Connect(const Info& info);
  ~UcxSender();
  UcxSender(const UcxSender&) = delete;
  UcxSender& operator=(const UcxSender&) = delete;

  // Client::Append with `args`' k and v sent by UCX (args.ucx_payload is set here). A
  // message still unsent when the call fails is cancelled by closing the endpoint; the
  // next Append opens a new one.
  absl::StatusOr<AppendResult> Append(Client& client, uint64_t sequence_id, const AppendArgs& args,
                                      BlockTable* table = nullptr);
  // K/V bytes whose message completed, and those messages.
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  uint64_t messages() const { return messages_.load(std::memory_order_relaxed); }

 private:
  struct Handles;
  UcxSender();
  void Progress();
  // Opens the endpoint to the daemon's worker if there is none.
  absl::Status OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the endpoint: by force with peer error handling (cancelling what is in flight on
  // it), else flushed within a second.
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<Handles> ucx_;
  std::string daemon_address_;
  mutable absl::Mutex mu_;                         // every use of the worker
  bool peer_errors_ ABSL_GUARDED_BY(mu_) = false;  // the endpoint has peer error handling
  std::atomic<bool> stop_{false};
  int stop_fd_ = -1;
  std::thread progress_;
  std::atomic<uint64_t> bytes_sent_{0}, messages_{0};
  // A message neither completed nor cancelled by its endpoint's forced close (which UCX
  // does not leave): the sender is not used again.
  std::atomic<bool> broken_{false};
};

}  // namespace kvmem::client
