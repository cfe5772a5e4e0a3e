#include "server/service/daemon_info.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/quantize.h"
#include "kvmem/v1/attach.h"
#if KVMEM_WITH_UCX
#include "server/transport/ucx_plane.h"
#endif
#include "server/common/client_text.h"
#include "server/service/convert.h"

namespace kvmem::service {
namespace {

// A Stats page token: the last sequence id of the page before, behind a tag that keeps
// clients from taking it for an id.
constexpr absl::string_view kPageTokenTag = "after-sequence-";

std::string PageToken(uint64_t last_id) { return absl::StrCat(kPageTokenTag, last_id); }

bool ParsePageToken(absl::string_view token, uint64_t* after) {
  return absl::ConsumePrefix(&token, kPageTokenTag) && absl::SimpleAtoi(token, after);
}

}  // namespace

void DescribeDaemon(const engine::Engine& engine, absl::string_view version,
                    v1::GetInfoResponse* response, transport::AttachSocket* attach,
                    const std::string& issuer, bool read_only, uint32_t piece, bool tables) {
  const bool same_host = attach != nullptr;
  std::vector<transport::AttachSocket::Grant> grants;
  const engine::EngineConfig& config = engine.config();
  const store::Backend& backend = engine.backend();
  response->set_version(std::string(version));
  response->set_backend(std::string(backend.kind()));
  response->set_device_name(backend.device_name());
  // The pool's own figures: GetInfo never waits for a sequence.
  const store::PoolUsage pool = engine.PoolUsage();
  response->set_pool_bytes(pool.pool_bytes);
  response->set_pool_free_bytes(engine.PoolFreeBytes());
  response->set_page_bytes(pool.page_bytes);
  response->set_default_block_tokens(config.default_block_tokens);
  response->set_max_sequences(config.max_sequences);
  ToProto(config.default_lease, response->mutable_default_lease());
  ToProto(config.max_lease, response->mutable_max_lease());
  response->set_max_message_bytes(config.max_append_bytes);
  response->set_device_step(config.device_step);
  response->set_in_place_writes(config.in_place_writes);
  for (const policy::PolicyDescriptor& d : policy::AllPolicies()) {
    v1::PolicyInfo* info = response->add_policies();
    info->set_name(d.name);
    info->set_description(d.description);
    for (const policy::ParamSpec& p : d.params) {
      v1::ParamInfo* param = info->add_params();
      param->set_name(p.name);
      param->set_default_value(p.default_value);
      param->set_min_value(p.min_value);
      param->set_max_value(p.max_value);
      param->set_description(p.description);
    }
    for (const std::string& s : policy::SignalNames(d.step_signals)) info->add_step_signals(s);
    for (const std::string& s : policy::SignalNames(d.compress_signals)) {
      info->add_compress_signals(s);
    }
    for (const std::string& s : policy::SignalNames(d.append_signals)) {
      info->add_append_signals(s);
    }
  }
  std::optional<store::PoolExport> exported;
  if (same_host) exported = backend.pool_export();
  if (exported) {
    const std::vector<store::SharedMemoryExport> pieces = backend.pool_pieces();
    // A piece the backend does not have grants nothing (never another piece instead).
    if (std::holds_alternative<store::SharedMemoryExport>(*exported) && piece < pieces.size()) {
      const store::SharedMemoryExport& shm = pieces[piece];
      v1::SharedMemoryPool* out = response->mutable_shared_memory();
      out->set_segment_bytes(shm.bytes);
      out->set_piece_offset(shm.offset);
      if (auto segment = shm.segment.lock()) out->set_piece_bytes(segment->bytes());
      grants.push_back({v1::attach::kPool, shm.segment, config.in_place_writes && !read_only});
    } else if (const auto* cuda = std::get_if<store::CudaIpcExport>(&*exported)) {
      v1::CudaIpcPool* ipc = response->mutable_cuda_ipc();
      ipc->set_handle(cuda->handle);
      ipc->set_pool_bytes(cuda->bytes);
      ipc->set_device(cuda->device);
      ipc->set_device_uuid(cuda->device_uuid);
    }
  }
  for (const kernels::QuantizerDescription& q : kernels::kQuantizers) {
    v1::QuantizerInfo* info = response->add_quantizers();
    info->set_precision(ToProto(engine::ToPrecision(q.type)));
    info->set_name(q.name);
    info->set_description(q.description);
  }
  response->set_default_quantization_recent_tokens(engine::QuantConfig{}.recent_tokens);
  if (!same_host) return;
  const engine::EpochBoard& board = engine.epoch_board();
  grants.push_back({v1::attach::kEpochBoard, board.segment(), false});
  response->mutable_epoch_board()->set_stride(engine::EpochBoard::kStride);
  response->mutable_epoch_board()->set_slots(board.slots());
  if (const engine::TableBoard* board = tables ? engine.table_board() : nullptr) {
    grants.push_back({v1::attach::kTableArea, board->segment(), false});
    response->mutable_table_area()->set_bytes(board->bytes());
    response->mutable_table_area()->set_slots(board->slots());
  }
  FillAttachTicket(*attach, std::move(grants), issuer, response->mutable_attach());
}

void DescribeUcx(const transport::UcxPlane& ucx, bool keys, uint64_t max_payload_bytes,
                 v1::UcxExport* out) {
#if KVMEM_WITH_UCX
  out->set_append_worker_address(ucx.append_worker_address());
  out->set_max_payload_bytes(max_payload_bytes);
  if (!keys) return;
  out->set_worker_address(ucx.worker_address());
  out->set_pool_rkey(ucx.region(0).rkey);
  out->set_pool_address(ucx.region(0).address);
  out->set_pool_bytes(ucx.region(0).bytes);
  out->set_epoch_board_rkey(ucx.region(1).rkey);
  out->set_epoch_board_address(ucx.region(1).address);
#else
  (void)ucx;
  (void)keys;
  (void)max_payload_bytes;
  (void)out;
#endif
}

void FillAttachTicket(transport::AttachSocket& attach,
                      std::vector<transport::AttachSocket::Grant> grants, const std::string& issuer,
                      v1::AttachTicket* ticket) {
  ticket->set_socket(attach.address());
  ticket->set_daemon_uid(geteuid());
  ticket->set_ticket(attach.Issue(std::move(grants), issuer));
  ToProto(attach.ticket_life(), ticket->mutable_valid_for());
}

absl::Status ReadStatsPage(const v1::StatsRequest& request, StatsPage* page) {
  if (request.include_sequences()) {
    if (request.has_page_size()) {
      page->size = request.page_size();
      if (page->size == 0 || page->size > kMaxStatsPageSize) {
        return absl::InvalidArgumentError(
            absl::StrCat("page_size: ", page->size, " is outside [1, ", kMaxStatsPageSize,
                         "] (leave the field out for ", kDefaultStatsPageSize, ")"));
      }
    }
    if (!request.page_token().empty() && !ParsePageToken(request.page_token(), &page->after)) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token: \"", EchoClientText(request.page_token()),
                       "\" is not a next_page_token of a StatsResponse"));
    }
  }
  return absl::OkStatus();
}

void FillStatsPage(engine::EngineStats stats, const StatsPage& page, v1::StatsResponse* response) {
  ToProto(stats, response);
  // A page: the sequences after the last one of the page before, in id order.
  std::vector<engine::SequenceSummary>& sequences = stats.sequences;
  std::sort(sequences.begin(), sequences.end(),
            [](const engine::SequenceSummary& a, const engine::SequenceSummary& b) {
              return a.sequence_id < b.sequence_id;
            });
  auto first = std::upper_bound(
      sequences.begin(), sequences.end(), page.after,
      [](uint64_t id, const engine::SequenceSummary& s) { return id < s.sequence_id; });
  const size_t left = static_cast<size_t>(sequences.end() - first);
  const auto last = first + static_cast<std::ptrdiff_t>(std::min<size_t>(left, page.size));
  for (auto it = first; it != last; ++it) ToProto(*it, response->add_sequences());
  if (last != sequences.end()) {
    response->set_next_page_token(PageToken(std::prev(last)->sequence_id));
  }
}

}  // namespace kvmem::service
