#pragma once
// What GetInfo and Stats report: the daemon's description (backend, pool, limits, policies
// with their parameters and signals, quantizers, same-host exports, the epoch board), and a
// page of Stats' sequences.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/engine/engine.h"
#include "server/transport/attach_socket.h"

namespace kvmem::transport {
class UcxPlane;
}  // namespace kvmem::transport

namespace kvmem::service {

// With `attach` (the same-host attach, one trust domain: kvmemd with identities offers it to
// admins and peers only): the shared pool, the epoch board and the table area, and a ticket
// for their descriptors (the pool read-write with in-place writes unless `read_only`, the
// rest read-only), counted as `issuer`'s (the caller's tenant).
// `piece`: which of the pool's pieces (store::Backend::pool_pieces) the ticket maps: 0, the
// whole pool or its shared part, or a tenant's arena. `tables`: the table area too (every
// sequence's table: not for a tenant that may see only its own).
void DescribeDaemon(const engine::Engine& engine, absl::string_view version,
                    v1::GetInfoResponse* response, transport::AttachSocket* attach,
                    const std::string& issuer = "", bool read_only = false, uint32_t piece = 0,
                    bool tables = true);

// A new ticket of `attach` for `grants`, counted as `issuer`'s, with what a client needs to
// redeem it (the socket, the daemon's uid, how long it holds).
void FillAttachTicket(transport::AttachSocket& attach,
                      std::vector<transport::AttachSocket::Grant> grants, const std::string& issuer,
                      v1::AttachTicket* ticket);

// kvmemd's UCX worker as a remote reader needs it (regions: the pool, then the epoch board).
void DescribeUcx(const transport::UcxPlane& ucx, bool keys, uint64_t max_payload_bytes,
                 v1::UcxExport* out);

inline constexpr uint32_t kDefaultStatsPageSize = 100;
inline constexpr uint32_t kMaxStatsPageSize = 1000;
// The page a StatsRequest asks for: at most `size` sequences with ids past `after`.
struct StatsPage {
  uint32_t size = kDefaultStatsPageSize;
  uint64_t after = 0;  // sequence ids start at 1
};
// INVALID_ARGUMENT naming page_size or page_token.
absl::Status ReadStatsPage(const v1::StatsRequest& request, StatsPage* page);
// The daemon-wide figures and the page's sequences, in id order, with the next page's token.
void FillStatsPage(engine::EngineStats stats, const StatsPage& page, v1::StatsResponse* response);

}  // namespace kvmem::service
