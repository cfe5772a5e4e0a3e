#include "kvmem/ucx_sender.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kvmem/ucx_worker.h"

namespace kvmem::client {

struct UcxSender::Handles {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  int efd = -1;
};

namespace {

// The daemon's header of a payload message (UcxPayload's wire header).
struct PayloadHeader {
  uint32_t magic = 0x4B564D55;
  uint32_t version = 1;
  uint64_t hi = 0, lo = 0;
};

// One message in flight: completed by UCX's callback on the progress thread. The header
// and a joined payload live here, so that a message left in flight (leaked with its Send)
// never reads freed memory of this side's.
struct Send {
  absl::Notification done;
  ucs_status_t status = UCS_OK;
  PayloadHeader header;
  std::string joined;
};

void OnSent(void* request, ucs_status_t status, void* user_data) {
  auto* send = static_cast<Send*>(user_data);
  send->status = status;
  ucp_request_free(request);
  send->done.Notify();
}

}  // namespace

UcxSender::UcxSender() : ucx_(std::make_unique<Handles>()) {}

absl::StatusOr<std::unique_ptr<UcxSender>> UcxSender::Connect(const Info& info) {
  if (info.ucx.append_worker_address.empty()) {
    return absl::FailedPreconditionError(
        "ucx: the daemon runs no UCX worker (kvmemd --ucx), or offers it to nobody");
  }
  std::unique_ptr<UcxSender> sender(new UcxSender());
  sender->daemon_address_ = info.ucx.append_worker_address;
  Handles& h = *sender->ucx_;
  // Serialized: every use is under mu_ (the caller's sends, the progress thread).
  if (absl::Status s = ucx::MakeWorker(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                                       UCS_THREAD_MODE_SERIALIZED, &h.context, &h.worker);
      !s.ok()) {
    return s;
  }
  if (ucs_status_t s = ucp_worker_get_efd(h.worker, &h.efd); s != UCS_OK) {
    return ucx::Failed("ucp_worker_get_efd", s);
  }
  {
    absl::MutexLock lock(&sender->mu_);
    if (absl::Status s = sender->OpenLocked(); !s.ok()) return s;
  }
  sender->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (sender->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("ucx: eventfd: ", std::strerror(errno)));
  }
  sender->progress_ = std::thread([s = sender.get()] { s->Progress(); });
  return sender;
}

absl::Status UcxSender::OpenLocked() {
  if (ucx_->ep != nullptr) return absl::OkStatus();
  // A daemon that goes away fails the sends in flight where the transport can tell (TCP).
  return ucx::Connect(ucx_->worker, daemon_address_, &ucx_->ep, &peer_errors_);
}

void UcxSender::CloseLocked() {
  if (ucx_->ep == nullptr) return;
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // By force (what is in flight is cancelled) only with peer error handling, where UCX
  // defines it; else flushed (what is in flight completes first), for a second at most.
  close.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ucx_->ep, &close);
  ucx_->ep = nullptr;
  if (closing == nullptr || UCS_PTR_IS_ERR(closing)) return;
  const absl::Time end = absl::Now() + absl::Seconds(1);
  while (ucp_request_check_status(closing) == UCS_INPROGRESS && absl::Now() < end) {
    ucp_worker_progress(ucx_->worker);
  }
  ucp_request_free(closing);
}

void UcxSender::Progress() {
  pthread_setname_np(pthread_self(), "kvmem_ucx_send");
  while (!stop_.load(std::memory_order_relaxed)) {
    {
      absl::MutexLock lock(&mu_);
      while (ucp_worker_progress(ucx_->worker) != 0) {
      }
      if (ucp_worker_arm(ucx_->worker) == UCS_ERR_BUSY) continue;
    }
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {ucx_->efd, POLLIN, 0}};
    // Armed: the descriptor wakes this on the next event (a send posted by another thread
    // signals the worker). A timeout anyway, in case a transport misses one.
    if (poll(fds, 2, 10) < 0 && errno != EINTR) return;
  }
}

UcxSender::~UcxSender() {
  if (progress_.joinable()) {
    stop_.store(true, std::memory_order_relaxed);
    const uint64_t one = 1;
    (void)write(stop_fd_, &one, sizeof one);
    progress_.join();
  }
  if (stop_fd_ >= 0) close(stop_fd_);
  {
    absl::MutexLock lock(&mu_);
    if (ucx_->worker != nullptr) CloseLocked();
  }
  if (ucx_->worker != nullptr) ucp_worker_destroy(ucx_->worker);
  if (ucx_->context != nullptr) ucp_cleanup(ucx_->context);
}

absl::StatusOr<AppendResult> UcxSender::Append(Client& client, uint64_t sequence_id,
                                               const AppendArgs& args, BlockTable* table) {
  if (broken_.load(std::memory_order_relaxed)) {
    return absl::UnavailableError("ucx: an earlier message never ended; connect a new sender");
  }
  if (args.k.size() != args.v.size() || args.k.empty()) {
    return absl::InvalidArgumentError("ucx: k and v must be non-empty and of one size");
  }
  auto owned = std::make_unique<Send>();
  Send& send = *owned;
  PayloadHeader& header = send.header;
  uint64_t id[2] = {0, 0};
  while ((id[0] | id[1]) == 0) {
    if (getrandom(id, sizeof id, 0) != static_cast<ssize_t>(sizeof id)) {
      return absl::InternalError(absl::StrCat("ucx: getrandom: ", std::strerror(errno)));
    }
  }
  header.hi = id[0];
  header.lo = id[1];
  const UcxTransfer transfer{id[0], id[1], args.k.size() + args.v.size()};
  // K and V contiguous when they lie so (one buffer: UCX's zero-copy rendezvous takes
  // contiguous buffers only), else joined here.
  const char* payload = args.k.data();
  if (args.v.data() != args.k.data() + args.k.size()) {
    send.joined.reserve(args.k.size() + args.v.size());
    send.joined.append(args.k).append(args.v);
    payload = send.joined.data();
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = OpenLocked(); !s.ok()) return s;
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &OnSent;
    param.user_data = &send;
    // The daemon takes a rendezvous message only with this endpoint named (REPLY): it ends
    // a receive whose call gave up by closing it.
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    if (transfer.bytes > kRendezvousBytes) param.flags |= UCP_AM_SEND_FLAG_RNDV;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ucx_->ep, 1, &header, sizeof header, payload, transfer.bytes, &param);
    if (UCS_PTR_IS_ERR(request)) {
      CloseLocked();
      return ucx::Failed("ucp_am_send_nbx", UCS_PTR_STATUS(request));
    }
    if (request == nullptr) send.done.Notify();  // sent at once (callback not called)
  }
  ucp_worker_signal(ucx_->worker);  // the progress thread serves it from here
  absl::StatusOr<AppendResult> result = client.Append(sequence_id, args, transfer, table);
  // Answered OK: the daemon has the data, so the message completes at once. Failed: the
  // daemon dropped the message (a refused call's at once; any within 10 s) or is gone. One
  // still pending after a grace is cancelled by closing the endpoint by force, where it has
  // peer error handling (other threads' messages on it fail too; the next Append opens a
  // new one); UCX leaves a forced close undefined without it (shared memory), so there the
  // sender waits out the daemon's 10 s and, failing that, is left broken.
  bool peer_errors;
  {
    absl::MutexLock lock(&mu_);
    peer_errors = peer_errors_;
  }
  const absl::Duration grace =
      result.ok() ? absl::Seconds(5) : (peer_errors ? absl::Seconds(2) : absl::Seconds(11));
  if (!send.done.WaitForNotificationWithTimeout(grace) && peer_errors) {
    absl::MutexLock lock(&mu_);
    CloseLocked();  // cancels it: its callback runs in the close's progress
  }
  if (!send.done.WaitForNotificationWithTimeout(peer_errors ? absl::Seconds(5)
                                                            : absl::ZeroDuration())) {
    // Neither completed nor cancelled: its state is left to it (leaked, with the header and
    // any joined copy; the caller's k and v are the caller's), the sender broken.
    broken_.store(true, std::memory_order_relaxed);
    (void)owned.release();
    return absl::UnavailableError("ucx: a message neither completed nor was cancelled");
  }
  if (result.ok() && send.status == UCS_OK) {
    bytes_sent_.fetch_add(transfer.bytes, std::memory_order_relaxed);
    messages_.fetch_add(1, std::memory_order_relaxed);
  }
  return result;
}

}  // namespace kvmem::client
