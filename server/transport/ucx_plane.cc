#include "server/transport/ucx_plane.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvmem::transport {

struct UcxPlane::Handles {
  ucp_context_h context = nullptr;  // reads: RMA
  ucp_worker_h worker = nullptr;
  std::vector<ucp_mem_h> regions;
  ucp_context_h am_context = nullptr;  // appends: active messages only
  ucp_worker_h am_worker = nullptr;
};

// An announced transfer: its buffer and reservation, and how far it got. State changes
// under the plane's mutex; the buffer is written by UCX only while `receiving`.
class UcxPlane::Landing final : public UcxPlane::Payload {
 public:
  Landing(UcxPlane* plane, TransferId id, uint64_t bytes, ParseBudget::Reservation reservation)
      : plane(plane),
        id(id),
        size(bytes),
        data(new char[bytes]),
        reservation(std::move(reservation)) {}
  absl::string_view bytes() const override { return {data.get(), size}; }

  UcxPlane* const plane;
  const TransferId id;
  const uint64_t size;
  const std::unique_ptr<char[]> data;
  const ParseBudget::Reservation reservation;
  bool receiving = false;   // a ucp receive in flight into `data`
  bool done = false;        // landed (status OK) or failed
  bool abandoned = false;   // its call gave up: a receive in flight is cancelled
  void* request = nullptr;  // ucp's, while receiving
  ucp_ep_h ep = nullptr;    // the sender's (reply) endpoint of that receive
  bool cancel_sent = false;
  absl::Status status;
};

// A message that arrived before its call (OnPayload returned UCS_INPROGRESS on it).
struct UcxPlane::Held {
  TransferId id;
  void* data = nullptr;  // ucp's descriptor (rendezvous) or the eager data, held
  size_t length = 0;
  bool rendezvous = false;
  ucp_ep_h ep = nullptr;  // the sender's (reply) endpoint: a rendezvous message has one
  absl::Time arrived;
};

namespace {

absl::Status Failed(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat("--ucx: ", what, ": ", ucs_status_string(status)));
}

}  // namespace

UcxPlane::UcxPlane() : ucx_(std::make_unique<Handles>()) {}

namespace {

// A context of `features` and its worker, serving one thread at a time.
absl::Status MakeWorker(uint64_t features, ucp_context_h* context, ucp_worker_h* worker,
                        std::string* address_out) {
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return Failed("ucp_config_read", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = features;
  const ucs_status_t init = ucp_init(&params, config, context);
  ucp_config_release(config);
  if (init != UCS_OK) return Failed("ucp_init", init);
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread alone, once started
  if (ucs_status_t s = ucp_worker_create(*context, &worker_params, worker); s != UCS_OK) {
    return Failed("ucp_worker_create", s);
  }
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  if (ucs_status_t s = ucp_worker_get_address(*worker, &address, &address_bytes); s != UCS_OK) {
    return Failed("ucp_worker_get_address", s);
  }
  address_out->assign(reinterpret_cast<const char*>(address), address_bytes);
  ucp_worker_release_address(*worker, address);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Start(const std::vector<Region>& regions,
                                                          Options options) {
  std::unique_ptr<UcxPlane> plane(new UcxPlane());
  plane->options_ = options;
  Handles& h = *plane->ucx_;
  // Reads: RMA on the registered regions (software RMA over TCP and shared memory arrives as
  // messages, so the worker is woken by every event).
  if (absl::Status s =
          MakeWorker(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP, &h.context, &h.worker, &plane->address_);
      !s.ok()) {
    return s;
  }
  // Appends: active messages only, on a context without RMA, whose worker serves no get or
  // put of anyone's (UCX installs its software RMA handlers only for UCP_FEATURE_RMA): its
  // address can go to every tenant.
  if (absl::Status s = MakeWorker(UCP_FEATURE_AM | UCP_FEATURE_WAKEUP, &h.am_context, &h.am_worker,
                                  &plane->append_address_);
      !s.ok()) {
    return s;
  }
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kPayloadAmId;
  // Whole messages only, and eager data that stays valid after the callback (so that a
  // message that arrives before its call can wait for it).
  am.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  am.cb = &UcxPlane::OnPayload;
  am.arg = plane.get();
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(h.am_worker, &am); s != UCS_OK) {
    return Failed("ucp_worker_set_am_recv_handler", s);
  }
  for (const Region& region : regions) {
    ucp_mem_map_params_t map{};
    map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                     UCP_MEM_MAP_PARAM_FIELD_PROT;
    map.address = const_cast<void*>(region.base);
    map.length = region.bytes;
    map.prot =
        UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(h.context, &map, &memh); s != UCS_OK) {
      return Failed("ucp_mem_map", s);
    }
    h.regions.push_back(memh);
    void* packed = nullptr;
    size_t packed_bytes = 0;
    if (ucs_status_t s = ucp_rkey_pack(h.context, memh, &packed, &packed_bytes); s != UCS_OK) {
      return Failed("ucp_rkey_pack", s);
    }
    Exported exported;
    exported.rkey.assign(static_cast<const char*>(packed), packed_bytes);
    exported.address = reinterpret_cast<uint64_t>(region.base);
    exported.bytes = region.bytes;
    ucp_rkey_buffer_release(packed);
    plane->exported_.push_back(std::move(exported));
  }
  plane->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (plane->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("--ucx: eventfd: ", std::strerror(errno)));
  }
  plane->progress_ = std::thread([p = plane.get()] { p->Progress(); });
  return plane;
}

void UcxPlane::Progress() {
  pthread_setname_np(pthread_self(), "kvmem_ucx");
  int efd = -1, am_efd = -1;
  if (ucs_status_t s = ucp_worker_get_efd(ucx_->worker, &efd); s != UCS_OK) {
    spdlog::error("--ucx: ucp_worker_get_efd: {}; remote reads over TCP will stall",
                  ucs_status_string(s));
    return;
  }
  if (ucs_status_t s = ucp_worker_get_efd(ucx_->am_worker, &am_efd); s != UCS_OK) {
    spdlog::error("--ucx: ucp_worker_get_efd: {}; remote appends will stall", ucs_status_string(s));
    return;
  }
  // At most this many progress calls per worker between two Match calls, so that a stream
  // of reads cannot keep matching, expiry and cancels from running.
  constexpr int kProgressPerRound = 256;
  while (true) {
    for (int i = 0; i < kProgressPerRound && ucp_worker_progress(ucx_->worker) != 0; ++i) {
    }
    for (int i = 0; i < kProgressPerRound && ucp_worker_progress(ucx_->am_worker) != 0; ++i) {
    }
    Match();
    for (int i = 0; i < kProgressPerRound && ucp_worker_progress(ucx_->am_worker) != 0; ++i) {
    }
    if (ucp_worker_arm(ucx_->worker) == UCS_ERR_BUSY) continue;  // more arrived meanwhile
    if (ucp_worker_arm(ucx_->am_worker) == UCS_ERR_BUSY) continue;
    pollfd fds[3] = {{stop_fd_, POLLIN, 0}, {efd, POLLIN, 0}, {am_efd, POLLIN, 0}};
    // Armed: a descriptor wakes this on the next event. A timeout anyway, in case a
    // transport misses one (and for the held messages' expiry).
    if (poll(fds, 3, 100) < 0 && errno != EINTR) {
      spdlog::error("--ucx: poll: {}; remote reads over TCP stop", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
  }
}

UcxPlane::~UcxPlane() {
  if (progress_.joinable()) {
    stopping_.store(true, std::memory_order_relaxed);
    const uint64_t one = 1;
    (void)write(stop_fd_, &one, sizeof one);
    progress_.join();
  }
  // No call waits any more (the service is gone); what is held or in flight ends here, on
  // this thread, the workers' only one now.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [landing, keep] : receiving_) landing->abandoned = true;
    for (auto& [id, landing] : announced_) landing->abandoned = true;
  }
  if (ucx_->am_worker != nullptr) {
    for (int i = 0; i < 100; ++i) {
      Match();
      ucp_worker_progress(ucx_->am_worker);
      absl::MutexLock lock(&mu_);
      if (receiving_.empty() && closing_.empty()) break;
    }
    std::vector<std::unique_ptr<Held>> held;
    {
      absl::MutexLock lock(&mu_);
      held.swap(held_);
    }
    for (std::unique_ptr<Held>& h : held) ucp_am_data_release(ucx_->am_worker, h->data);
  }
  // A receive still in flight (a sender without peer error handling that stopped sending)
  // ends with its worker.
  if (stop_fd_ >= 0) close(stop_fd_);
  if (ucx_->am_worker != nullptr) ucp_worker_destroy(ucx_->am_worker);
  if (ucx_->am_context != nullptr) ucp_cleanup(ucx_->am_context);
  for (ucp_mem_h memh : ucx_->regions) ucp_mem_unmap(ucx_->context, memh);
  if (ucx_->worker != nullptr) ucp_worker_destroy(ucx_->worker);
  if (ucx_->context != nullptr) ucp_cleanup(ucx_->context);
}

ucs_status_t UcxPlane::OnPayload(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  auto* plane = static_cast<UcxPlane*>(arg);
  PayloadHeader h;
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool persistent = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  absl::MutexLock lock(&plane->mu_);
  // A rendezvous message must name its sender's endpoint (UCP_AM_SEND_FLAG_REPLY): a
  // receive whose call gave up ends by closing it, the only end UCX gives a receive whose
  // sender stopped sending.
  const ucp_ep_h ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  bool keep = header_length == sizeof h && (rendezvous ? ep != nullptr : persistent) &&
              !plane->stopping_.load(std::memory_order_relaxed);
  if (keep) {
    std::memcpy(&h, header, sizeof h);
    keep = h.magic == kPayloadMagic && h.version == 1 && (h.hi | h.lo) != 0;
  }
  const TransferId id{h.hi, h.lo};
  if (keep) {
    // A message its call is waiting for is taken whatever else is held (Match, right after
    // this progress call, fails the call if the size is not the announced one); one that
    // comes first waits only within the bounds (and eager data of at most
    // kMaxHeldEagerBytes: a client sends more by rendezvous, where only the header comes
    // first).
    auto it = plane->announced_.find(id);
    const Landing* waiting = it == plane->announced_.end() ? nullptr : it->second.get();
    if (waiting == nullptr) {
      keep = plane->held_.size() < kMaxHeld && (rendezvous || length <= kMaxHeldEagerBytes) &&
             !plane->refused_.contains(id);
    } else {
      keep = !waiting->receiving && !waiting->done;
    }
  }
  for (size_t i = 0; keep && i < plane->held_.size(); ++i) {
    keep = !(plane->held_[i]->id == id);  // a second message of an id
  }
  std::unique_ptr<Held> held(keep ? new (std::nothrow) Held : nullptr);
  bool stored = false;
  if (held != nullptr) {
    held->id = id;
    held->data = data;
    held->length = length;
    held->rendezvous = rendezvous;
    held->ep = ep;
    held->arrived = absl::Now();
    try {  // nothing may throw through UCX
      plane->held_.push_back(std::move(held));
      stored = true;
    } catch (const std::bad_alloc&) {
    }
  }
  if (!stored) {
    ++plane->counters_.dropped;
    // Released (UCX asserts that a handler returns no error: an eager message's status is
    // not for the sender anyway); a rendezvous sender's request ends, and its call says why.
    return UCS_OK;
  }
  return UCS_INPROGRESS;  // Match takes it on, after this progress call
}

void UcxPlane::OnReceived(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* landing = static_cast<Landing*>(user_data);
  UcxPlane* plane = landing->plane;
  absl::MutexLock lock(&plane->mu_);
  auto it = plane->receiving_.find(landing);
  if (it == plane->receiving_.end()) {  // not posted by Match (cannot happen): freed anyway
    ucp_request_free(request);
    return;
  }
  std::shared_ptr<Landing> keep = std::move(it->second);
  plane->receiving_.erase(it);
  landing->receiving = false;
  landing->request = nullptr;
  ucp_request_free(request);
  if (status == UCS_OK && length != landing->size) status = UCS_ERR_MESSAGE_TRUNCATED;
  plane->Finish(*landing, status == UCS_OK ? absl::OkStatus()
                                           : absl::AbortedError(absl::StrCat(
                                                 "ucx_payload: receiving the message failed (",
                                                 ucs_status_string(status), ")")));
}

void UcxPlane::Finish(Landing& landing, absl::Status status) {
  if (landing.done) return;
  landing.done = true;
  if (landing.abandoned) {
    // Counted when its call gave up.
  } else if (status.ok()) {
    ++counters_.landed;
    counters_.landed_bytes += landing.size;
  } else {
    ++counters_.failed;
  }
  landing.status = std::move(status);
}

void UcxPlane::Match() {
  struct Start {
    std::unique_ptr<Held> held;
    std::shared_ptr<Landing> landing;  // null: drop the message
  };
  std::vector<Start> starts;
  std::vector<void*> cancels;
  std::vector<ucp_ep_h> closes;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    absl::erase_if(refused_, [&](const auto& r) { return now - r.second > options_.held_ttl; });
    for (size_t i = 0; i < held_.size();) {
      auto it = announced_.find(held_[i]->id);
      const bool expired =
          now - held_[i]->arrived > options_.held_ttl || refused_.contains(held_[i]->id);
      if ((it == announced_.end() || it->second->receiving || it->second->done) && !expired) {
        ++i;
        continue;
      }
      Start start{std::move(held_[i]), nullptr};
      held_[i] = std::move(held_.back());
      held_.pop_back();
      bool failed_its_call = false;
      if (it != announced_.end() && !it->second->receiving && !it->second->done) {
        if (start.held->length != it->second->size) {
          failed_its_call = true;
          Finish(*it->second,
                 absl::InvalidArgumentError(absl::StrCat(
                     "ucx_payload.bytes: the call announced ", it->second->size,
                     " bytes and the message carried ", start.held->length, " (dropped)")));
        } else {
          start.landing = it->second;
        }
      }
      if (start.landing == nullptr && !failed_its_call) ++counters_.dropped;
      starts.push_back(std::move(start));
    }
    for (auto& [landing, keep] : receiving_) {
      if (landing->abandoned && landing->request != nullptr && !landing->cancel_sent) {
        landing->cancel_sent = true;
        cancels.push_back(landing->request);
        if (landing->ep != nullptr && !closed_.contains(landing->ep)) {
          closed_.insert(landing->ep);
          closes.push_back(landing->ep);
        }
      }
    }
    // The messages still held from an endpoint about to close go first (their descriptors
    // are its).
    for (size_t i = 0; i < held_.size();) {
      if (held_[i]->ep == nullptr || !closed_.contains(held_[i]->ep)) {
        ++i;
        continue;
      }
      starts.push_back({std::move(held_[i]), nullptr});
      held_[i] = std::move(held_.back());
      held_.pop_back();
      ++counters_.dropped;
    }
  }
  for (void* request : cancels) ucp_request_cancel(ucx_->am_worker, request);
  for (Start& start : starts) {
    bool closing;
    {
      absl::MutexLock lock(&mu_);
      closing = start.landing == nullptr && closed_.contains(start.held->ep);
    }
    if (closing) {
      ucp_am_data_release(ucx_->am_worker, start.held->data);
      start.held.reset();
    }
  }
  // A receive whose call gave up waits for data its sender may never send (a client killed
  // mid-transfer); cancelling does not end it. Closing the sender's endpoint by force does
  // (its requests end as cancelled): the sender's other transfers on it fail with it.
  for (ucp_ep_h ep : closes) {
    spdlog::warn(
        "--ucx: closing the endpoint of a sender whose remote append's call gave up with its "
        "data still coming");
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &close);
    if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) {
      closing_.push_back({closing, ep});
    } else {
      absl::MutexLock lock(&mu_);
      closed_.erase(ep);
    }
  }
  for (size_t i = 0; i < closing_.size();) {
    if (ucp_request_check_status(closing_[i].first) == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    ucp_request_free(closing_[i].first);
    {
      absl::MutexLock lock(&mu_);
      closed_.erase(closing_[i].second);
    }
    closing_[i] = closing_.back();
    closing_.pop_back();
  }
  for (Start& start : starts) {
    if (start.held == nullptr) continue;
    Held& held = *start.held;
    if (start.landing == nullptr) {
      ucp_am_data_release(ucx_->am_worker, held.data);
      continue;
    }
    Landing& landing = *start.landing;
    bool abandoned;
    {
      absl::MutexLock lock(&mu_);
      abandoned = landing.abandoned;  // its call gave up meanwhile
      if (!abandoned && held.rendezvous) {
        landing.receiving = true;
        landing.ep = held.ep;
        receiving_[&landing] = start.landing;
      }
    }
    if (abandoned) {
      ucp_am_data_release(ucx_->am_worker, held.data);
      continue;
    }
    if (!held.rendezvous) {
      std::memcpy(landing.data.get(), held.data, held.length);
      ucp_am_data_release(ucx_->am_worker, held.data);
      absl::MutexLock lock(&mu_);
      Finish(landing, absl::OkStatus());
      continue;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = &UcxPlane::OnReceived;
    param.user_data = &landing;
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(ucx_->am_worker, held.data, landing.data.get(), held.length, &param);
    absl::MutexLock lock(&mu_);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
      landing.request = request;  // OnReceived ends it (in a later progress call)
      continue;
    }
    receiving_.erase(&landing);
    landing.receiving = false;
    landing.request = nullptr;
    const ucs_status_t status = UCS_PTR_STATUS(request);
    Finish(landing, status == UCS_OK ? absl::OkStatus()
                                     : absl::AbortedError(absl::StrCat(
                                           "ucx_payload: receiving the message failed (",
                                           ucs_status_string(status), ")")));
  }
}

absl::StatusOr<std::shared_ptr<const UcxPlane::Payload>> UcxPlane::Receive(
    TransferId id, uint64_t bytes, ParseBudget::Reservation reservation, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  auto landing = std::make_shared<Landing>(this, id, bytes, std::move(reservation));
  {
    absl::MutexLock lock(&mu_);
    if (!announced_.try_emplace(id, landing).second) {
      return absl::InvalidArgumentError(
          "ucx_payload.transfer_hi/lo: a transfer with this id is already announced and has "
          "not landed (draw a new id for every transfer)");
    }
  }
  ucp_worker_signal(ucx_->am_worker);  // Match, now that the call has come
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    const auto landed = [&] { return landing->done; };
    while (!landing->done) {
      const absl::Time now = absl::Now();
      if (now >= deadline || cancelled()) break;
      mu_.AwaitWithDeadline(absl::Condition(&landed),
                            std::min(deadline, now + absl::Milliseconds(50)));
    }
    announced_.erase(id);
    if (landing->done) {
      status = landing->status;
    } else {
      landing->abandoned = true;
      ++counters_.failed;
      status = absl::Now() >= deadline
                   ? absl::DeadlineExceededError(
                         "ucx_payload: the message did not land in time (no active message "
                         "named this transfer, or it was still arriving)")
                   : absl::CancelledError("ucx_payload: the call was cancelled");
    }
  }
  if (!status.ok()) {
    ucp_worker_signal(ucx_->am_worker);  // a receive in flight is cancelled by Match
    return status;
  }
  return std::shared_ptr<const Payload>(std::move(landing));
}

void UcxPlane::Refuse(TransferId id) {
  {
    absl::MutexLock lock(&mu_);
    if (refused_.size() >= 4 * kMaxHeld) return;  // bounded; the TTL drops the rest
    refused_[id] = absl::Now();
  }
  ucp_worker_signal(ucx_->am_worker);
}

UcxPlane::Counters UcxPlane::counters() const {
  absl::MutexLock lock(&mu_);
  Counters c = counters_;
  c.receiving = receiving_.size();
  c.held = held_.size();
  return c;
}

}  // namespace kvmem::transport
