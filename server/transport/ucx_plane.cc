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
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<ucp_mem_h> regions;
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
  bool cancel_sent = false;
  absl::Status status;
};

// A message that arrived before its call (OnPayload returned UCS_INPROGRESS on it).
struct UcxPlane::Held {
  TransferId id;
  void* data = nullptr;  // ucp's descriptor (rendezvous) or the eager data, held
  size_t length = 0;
  bool rendezvous = false;
  absl::Time arrived;
};

namespace {

absl::Status Failed(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat("--ucx: ", what, ": ", ucs_status_string(status)));
}

}  // namespace

UcxPlane::UcxPlane() : ucx_(std::make_unique<Handles>()) {}

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Start(const std::vector<Region>& regions,
                                                          Options options) {
  std::unique_ptr<UcxPlane> plane(new UcxPlane());
  plane->options_ = options;
  Handles& h = *plane->ucx_;
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return Failed("ucp_config_read", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  const ucs_status_t init = ucp_init(&params, config, &h.context);
  ucp_config_release(config);
  if (init != UCS_OK) return Failed("ucp_init", init);
  ucp_worker_params_t worker_params{};
  // Woken by every event (software RMA over TCP and shared memory arrives as messages).
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread alone, once started
  if (ucs_status_t s = ucp_worker_create(h.context, &worker_params, &h.worker); s != UCS_OK) {
    return Failed("ucp_worker_create", s);
  }
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  if (ucs_status_t s = ucp_worker_get_address(h.worker, &address, &address_bytes); s != UCS_OK) {
    return Failed("ucp_worker_get_address", s);
  }
  plane->address_.assign(reinterpret_cast<const char*>(address), address_bytes);
  ucp_worker_release_address(h.worker, address);
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kPayloadAmId;
  // Whole messages only, and eager data that stays valid after the callback (so that a
  // message that arrives before its call can wait for it).
  am.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  am.cb = &UcxPlane::OnPayload;
  am.arg = plane.get();
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(h.worker, &am); s != UCS_OK) {
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
  int efd = -1;
  if (ucs_status_t s = ucp_worker_get_efd(ucx_->worker, &efd); s != UCS_OK) {
    spdlog::error("--ucx: ucp_worker_get_efd: {}; remote reads over TCP will stall",
                  ucs_status_string(s));
    return;
  }
  while (true) {
    while (ucp_worker_progress(ucx_->worker) != 0) {
    }
    Match();
    while (ucp_worker_progress(ucx_->worker) != 0) {
    }
    const ucs_status_t armed = ucp_worker_arm(ucx_->worker);
    if (armed == UCS_ERR_BUSY) continue;  // more arrived meanwhile
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {efd, POLLIN, 0}};
    // Armed: the descriptor wakes this on the next event. A timeout anyway, in case a
    // transport misses one.
    if (poll(fds, 2, 100) < 0 && errno != EINTR) {
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
  // this thread, the worker's only one now.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [landing, keep] : receiving_) landing->abandoned = true;
    for (auto& [id, landing] : announced_) landing->abandoned = true;
  }
  if (ucx_->worker != nullptr) {
    for (int i = 0; i < 100; ++i) {
      Match();
      ucp_worker_progress(ucx_->worker);
      absl::MutexLock lock(&mu_);
      if (receiving_.empty()) break;
    }
    absl::MutexLock lock(&mu_);
    for (std::unique_ptr<Held>& held : held_) ucp_am_data_release(ucx_->worker, held->data);
    held_.clear();
  }
  if (stop_fd_ >= 0) close(stop_fd_);
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
  bool keep = header_length == sizeof h && (rendezvous || persistent) &&
              plane->held_.size() < kMaxHeld && !plane->stopping_.load(std::memory_order_relaxed);
  if (keep) {
    std::memcpy(&h, header, sizeof h);
    keep = h.magic == kPayloadMagic && h.version == 1 && (h.hi | h.lo) != 0;
  }
  // Eager data that no call has announced yet is held only up to a bound: a client that
  // announces large payloads sends them by rendezvous (only the header travels first).
  if (keep && !rendezvous && length > kMaxHeldEagerBytes) {
    auto it = plane->announced_.find(TransferId{h.hi, h.lo});
    keep = it != plane->announced_.end();
  }
  for (size_t i = 0; keep && i < plane->held_.size(); ++i) {
    keep = !(plane->held_[i]->id == TransferId{h.hi, h.lo});  // a second message of an id
  }
  if (!keep) {
    ++plane->counters_.dropped;
    return UCS_OK;  // UCX releases it
  }
  auto held = std::make_unique<Held>();
  held->id = {h.hi, h.lo};
  held->data = data;
  held->length = length;
  held->rendezvous = rendezvous;
  held->arrived = absl::Now();
  plane->held_.push_back(std::move(held));
  return UCS_INPROGRESS;  // Match takes it on, after this progress call
}

void UcxPlane::OnReceived(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* landing = static_cast<Landing*>(user_data);
  UcxPlane* plane = landing->plane;
  absl::MutexLock lock(&plane->mu_);
  auto it = plane->receiving_.find(landing);
  if (it == plane->receiving_.end()) return;
  std::shared_ptr<Landing> keep = std::move(it->second);
  plane->receiving_.erase(it);
  landing->receiving = false;
  landing->request = nullptr;
  ucp_request_free(request);
  if (status == UCS_OK && length != landing->size) status = UCS_ERR_MESSAGE_TRUNCATED;
  plane->Finish(*landing, status == UCS_OK ? absl::OkStatus()
                                           : absl::UnavailableError(absl::StrCat(
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
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < held_.size();) {
      auto it = announced_.find(held_[i]->id);
      const bool expired = now - held_[i]->arrived > options_.held_ttl;
      if ((it == announced_.end() || it->second->receiving || it->second->done) && !expired) {
        ++i;
        continue;
      }
      Start start{std::move(held_[i]), nullptr};
      held_[i] = std::move(held_.back());
      held_.pop_back();
      if (it != announced_.end() && !it->second->receiving && !it->second->done) {
        if (start.held->length != it->second->size) {
          Finish(*it->second,
                 absl::InvalidArgumentError(absl::StrCat(
                     "ucx_payload.bytes: the call announced ", it->second->size,
                     " bytes and the message carried ", start.held->length, " (dropped)")));
        } else {
          start.landing = it->second;
        }
      }
      if (start.landing == nullptr) ++counters_.dropped;
      starts.push_back(std::move(start));
    }
    for (auto& [landing, keep] : receiving_) {
      if (landing->abandoned && landing->request != nullptr && !landing->cancel_sent) {
        landing->cancel_sent = true;
        cancels.push_back(landing->request);
      }
    }
  }
  for (void* request : cancels) ucp_request_cancel(ucx_->worker, request);
  for (Start& start : starts) {
    Held& held = *start.held;
    if (start.landing == nullptr) {
      ucp_am_data_release(ucx_->worker, held.data);
      continue;
    }
    Landing& landing = *start.landing;
    if (!held.rendezvous) {
      std::memcpy(landing.data.get(), held.data, held.length);
      ucp_am_data_release(ucx_->worker, held.data);
      absl::MutexLock lock(&mu_);
      Finish(landing, absl::OkStatus());
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      landing.receiving = true;
      receiving_[&landing] = start.landing;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = &UcxPlane::OnReceived;
    param.user_data = &landing;
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(ucx_->worker, held.data, landing.data.get(), held.length, &param);
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
                                     : absl::UnavailableError(absl::StrCat(
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
  ucp_worker_signal(ucx_->worker);  // Match, now that the call has come
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
    ucp_worker_signal(ucx_->worker);  // a receive in flight is cancelled by Match
    return status;
  }
  return std::shared_ptr<const Payload>(std::move(landing));
}

UcxPlane::Counters UcxPlane::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace kvmem::transport
