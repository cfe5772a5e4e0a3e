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

namespace {

absl::Status Failed(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat("--ucx: ", what, ": ", ucs_status_string(status)));
}

}  // namespace

UcxPlane::UcxPlane() : ucx_(std::make_unique<Handles>()) {}

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Start(const std::vector<Region>& regions) {
  std::unique_ptr<UcxPlane> plane(new UcxPlane());
  Handles& h = *plane->ucx_;
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return Failed("ucp_config_read", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
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
    const uint64_t one = 1;
    (void)write(stop_fd_, &one, sizeof one);
    progress_.join();
  }
  if (stop_fd_ >= 0) close(stop_fd_);
  for (ucp_mem_h memh : ucx_->regions) ucp_mem_unmap(ucx_->context, memh);
  if (ucx_->worker != nullptr) ucp_worker_destroy(ucx_->worker);
  if (ucx_->context != nullptr) ucp_cleanup(ucx_->context);
}

}  // namespace kvmem::transport
