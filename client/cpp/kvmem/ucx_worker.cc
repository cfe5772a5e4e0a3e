#include "kvmem/ucx_worker.h"

#include "absl/strings/str_cat.h"

namespace kvmem::client::ucx {

absl::Status Failed(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat("ucx: ", what, ": ", ucs_status_string(status)));
}

absl::Status MakeWorker(uint64_t features, ucs_thread_mode_t thread_mode, ucp_context_h* context,
                        ucp_worker_h* worker) {
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
  worker_params.thread_mode = thread_mode;
  if (ucs_status_t s = ucp_worker_create(*context, &worker_params, worker); s != UCS_OK) {
    return Failed("ucp_worker_create", s);
  }
  return absl::OkStatus();
}

absl::Status Connect(ucp_worker_h worker, const std::string& address, ucp_ep_h* ep,
                     bool* peer_errors) {
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  *peer_errors = true;
  ucs_status_t created = ucp_ep_create(worker, &ep_params, ep);
  if (created == UCS_ERR_UNREACHABLE) {
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    *peer_errors = false;
    created = ucp_ep_create(worker, &ep_params, ep);
  }
  if (created != UCS_OK) {
    *ep = nullptr;
    return Failed("ucp_ep_create", created);
  }
  return absl::OkStatus();
}

}  // namespace kvmem::client::ucx
