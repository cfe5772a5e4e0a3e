#pragma once
// RemotePayload: bytes a remote transfer landed in memory the daemon reserved for it (a UCX
// remote append's K/V: transport::UcxPlane::Receive), kept as long as a holder needs them.
#include "absl/strings/string_view.h"

namespace kvmem::transport {

class RemotePayload {
 public:
  virtual ~RemotePayload() = default;
  virtual absl::string_view bytes() const = 0;
};

}  // namespace kvmem::transport
