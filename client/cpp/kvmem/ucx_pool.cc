#include "kvmem/ucx_pool.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvmem/ucx_worker.h"

namespace kvmem::client {

struct UcxPool::Handles {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h pool = nullptr;
  ucp_rkey_h board = nullptr;
  bool abandoned = false;  // a request left in flight: the worker is never progressed again
};

namespace {

using ucx::Failed;

// Waits for `request` (a ucp request, or an immediate status) within `deadline`; past it,
// returns UCS_ERR_TIMED_OUT with the request still in flight in `*pending` (the caller ends
// it: a transport may still write into its buffer).
ucs_status_t Wait(ucp_worker_h worker, ucs_status_ptr_t request, absl::Time deadline,
                  ucs_status_ptr_t* pending) {
  *pending = nullptr;
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ucs_status_t status;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    ucp_worker_progress(worker);
    if (absl::Now() > deadline) {
      *pending = request;
      return UCS_ERR_TIMED_OUT;
    }
  }
  ucp_request_free(request);
  return status;
}

// The earliest end of the Deadline scopes alive on this thread.
thread_local absl::Time call_deadline = absl::InfiniteFuture();

}  // namespace

UcxPool::Deadline::Deadline(absl::Time until) : outer_(call_deadline) {
  call_deadline = std::min(outer_, until);
}

UcxPool::Deadline::~Deadline() { call_deadline = outer_; }

UcxPool::UcxPool() : ucx_(std::make_unique<Handles>()) {}

absl::StatusOr<std::unique_ptr<UcxPool>> UcxPool::Connect(const Info& info,
                                                          absl::Duration deadline) {
  if (info.ucx.worker_address.empty()) {
    return absl::FailedPreconditionError(
        "ucx: the daemon offers no UCX worker to this caller (kvmemd --ucx, and a caller that "
        "may read the pool)");
  }
  if (info.ucx.pool_rkey.empty() || info.ucx.epoch_board_rkey.empty() ||
      info.ucx.pool_address == 0 || info.ucx.epoch_board_address == 0) {
    return absl::FailedPreconditionError(
        "ucx: the daemon gives this caller no keys to its pool (a caller that may read the "
        "pool gets them)");
  }
  if (info.epoch_slots == 0 || info.epoch_stride < sizeof(uint64_t)) {
    return absl::FailedPreconditionError("ucx: the daemon describes no epoch board");
  }
  std::unique_ptr<UcxPool> pool(new UcxPool());
  pool->deadline_ = deadline;
  Handles& h = *pool->ucx_;
  // Serialized: every use is under mu_, from whichever thread reads (a daemon's PeerLinks
  // shares a pool between its calls' threads).
  if (absl::Status s =
          ucx::MakeWorker(UCP_FEATURE_RMA, UCS_THREAD_MODE_SERIALIZED, &h.context, &h.worker);
      !s.ok()) {
    return s;
  }
  // A peer that goes away fails the requests in flight instead of hanging them, where the
  // transports can tell (TCP); shared memory cannot, and there a read that outlasts the
  // deadline ends the pool instead.
  bool peer_errors = false;
  if (absl::Status s = ucx::Connect(h.worker, info.ucx.worker_address, &h.ep, &peer_errors);
      !s.ok()) {
    return s;
  }
  if (ucs_status_t s = ucp_ep_rkey_unpack(h.ep, info.ucx.pool_rkey.data(), &h.pool); s != UCS_OK) {
    return Failed("the pool's rkey", s);
  }
  if (ucs_status_t s = ucp_ep_rkey_unpack(h.ep, info.ucx.epoch_board_rkey.data(), &h.board);
      s != UCS_OK) {
    return Failed("the epoch board's rkey", s);
  }
  // The daemon's addresses stand for the mapping's: StreamBlocks computes offsets from
  // base_, CopyOut turns them back into the daemon's addresses.
  pool->base_ = reinterpret_cast<const uint8_t*>(info.ucx.pool_address);
  pool->bytes_ = info.ucx.pool_bytes;
  pool->hi_ = pool->bytes_;
  pool->board_address_ = info.ucx.epoch_board_address;
  pool->stride_ = info.epoch_stride;
  pool->slots_ = info.epoch_slots;
  return pool;
}

UcxPool::~UcxPool() {
  Handles& h = *ucx_;
  if (h.pool != nullptr) ucp_rkey_destroy(h.pool);
  if (h.board != nullptr) ucp_rkey_destroy(h.board);
  if (h.ep != nullptr) {
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t closing = nullptr;
    Wait(h.worker, ucp_ep_close_nbx(h.ep, &close), absl::Now() + absl::Seconds(1), &closing);
    h.abandoned |= closing != nullptr;
  }
  // With a request abandoned in flight the worker, the context and the staging buffer (a
  // destination) are left as they are (a small leak) rather than progressed or destroyed
  // under it.
  if (h.abandoned) {
    internal::KeepForever(std::move(staging_));
    return;
  }
  if (h.worker != nullptr) ucp_worker_destroy(h.worker);
  if (h.context != nullptr) ucp_cleanup(h.context);
}

absl::Status UcxPool::Get(void* dst, uint64_t address, uint64_t bytes, void* rkey) const {
  const GetOp op{dst, address, bytes, rkey};
  return Gets(absl::MakeConstSpan(&op, 1));
}

absl::Status UcxPool::Gets(absl::Span<const GetOp> ops) const {
  if (broken_) {
    return absl::UnavailableError(
        "ucx: an earlier read failed or outlasted its deadline; connect a new pool");
  }
  const absl::Time by_call = call_deadline;
  if (absl::Now() >= by_call) {
    return absl::DeadlineExceededError("ucx: the call's deadline passed before its gets");
  }
  // All posted, then all waited for: one round trip's latency for the batch, not one each.
  std::vector<ucs_status_ptr_t> requests;
  requests.reserve(ops.size());
  ucs_status_t status = UCS_OK;
  uint64_t bytes = 0;
  for (const GetOp& op : ops) {
    ucp_request_param_t param{};
    ucs_status_ptr_t request = ucp_get_nbx(ucx_->ep, op.dst, op.bytes, op.address,
                                           static_cast<ucp_rkey_h>(op.rkey), &param);
    if (UCS_PTR_IS_ERR(request)) {
      status = UCS_PTR_STATUS(request);
      break;
    }
    if (request != nullptr) requests.push_back(request);
    bytes += op.bytes;
  }
  const absl::Time deadline = std::min(absl::Now() + deadline_, by_call);
  std::vector<ucs_status_ptr_t> pending;
  for (ucs_status_ptr_t request : requests) {
    ucs_status_ptr_t left = nullptr;
    const ucs_status_t s = Wait(ucx_->worker, request, deadline, &left);
    if (left != nullptr) pending.push_back(left);
    if (status == UCS_OK) status = s;
  }
  bool left_in_flight = false;  // by this read
  if (!pending.empty()) {
    // Past the deadline: the endpoint is closed by force, which flushes what is in flight
    // on it (a hardware transport's write into a destination completes or is cancelled)
    // before the destinations are handed back. A software transport writes only while
    // this worker progresses: a request still pending after a second is left unfreed and
    // the worker is never progressed again (the pool is broken from here on).
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    const absl::Time end = absl::Now() + absl::Seconds(1);
    ucs_status_ptr_t closing = nullptr;
    Wait(ucx_->worker, ucp_ep_close_nbx(ucx_->ep, &close), end, &closing);
    ucx_->ep = nullptr;
    for (ucs_status_ptr_t request : pending) {
      ucs_status_ptr_t still = nullptr;
      Wait(ucx_->worker, request, end, &still);
      left_in_flight |= still != nullptr;
    }
    left_in_flight |= closing != nullptr;
    ucx_->abandoned |= left_in_flight;
  }
  // A failed endpoint (the peer went away) and a read past its deadline both end the pool.
  if (status != UCS_OK) {
    broken_ = true;
    if (left_in_flight) {
      return absl::AbortedError(absl::StrCat(
          "ucx: gets of ", bytes, " bytes were left in flight (", ucs_status_string(status),
          "); their destinations may still be written: never use or reuse them"));
    }
    if (status == UCS_ERR_TIMED_OUT && absl::Now() >= by_call) {
      return absl::DeadlineExceededError(
          absl::StrCat("ucx: gets of ", bytes,
                       " bytes outlasted the call's deadline; nothing read may be used"));
    }
    return absl::UnavailableError(absl::StrCat("ucx: gets of ", bytes, " bytes failed (",
                                               ucs_status_string(status),
                                               "); nothing read may be used"));
  }
  bytes_read_ += bytes;
  gets_ += ops.size();
  return absl::OkStatus();
}

absl::Status UcxPool::ReadPool(absl::Span<const PoolRead> reads) const {
  std::vector<OutCopy> copies;
  copies.reserve(reads.size());
  for (const PoolRead& r : reads) {
    if (r.offset > bytes_) {
      return absl::OutOfRangeError(
          absl::StrCat("ucx: offset ", r.offset, " is outside the pool of ", bytes_));
    }
    copies.push_back({r.dst, base_ + r.offset, r.bytes});
  }
  return CopyOutMany(copies);
}

absl::Status UcxPool::CopyOutMany(absl::Span<const OutCopy> copies) const {
  for (const OutCopy& c : copies) {
    const uint64_t offset = static_cast<uint64_t>(c.src - base_);
    if (offset > bytes_ || c.bytes > bytes_ - offset) {
      return absl::OutOfRangeError(absl::StrCat("ucx: bytes [", offset, ", ", offset + c.bytes,
                                                ") are outside the pool of ", bytes_));
    }
  }
  // In the pool's order, copies whose bytes follow each other there are one get: a
  // prefilled sequence's blocks lie side by side (every stream's block in turn), so a read
  // of it is a few large gets, not one per block and plane. A run whose destinations follow
  // each other too lands in place; another lands in the staging buffer (kept for the next
  // read, at most kStagingBytes) and is copied out from there.
  std::vector<size_t> order(copies.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return copies[a].src < copies[b].src; });
  struct Run {
    size_t begin, end;  // into `order`
    uint64_t bytes;
    bool in_place;  // the destinations follow each other
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < order.size(); ++i) {
    const OutCopy& c = copies[order[i]];
    if (c.bytes == 0) continue;
    if (!runs.empty()) {
      Run& r = runs.back();
      const OutCopy& last = copies[order[r.end - 1]];
      if (last.src + last.bytes == c.src && r.bytes + c.bytes <= kMaxRunBytes) {
        r.in_place = r.in_place && static_cast<uint8_t*>(last.dst) + last.bytes == c.dst;
        r.bytes += c.bytes;
        r.end = i + 1;
        continue;
      }
    }
    runs.push_back({i, i + 1, c.bytes, true});
  }
  std::vector<GetOp> ops;
  absl::MutexLock lock(&mu_);
  for (size_t next = 0; next < runs.size();) {
    // The runs of one round: the in-place ones, and staged ones up to kStagingBytes.
    ops.clear();
    uint64_t staged = 0;
    size_t end = next;
    for (; end < runs.size(); ++end) {
      const Run& r = runs[end];
      const OutCopy& first = copies[order[r.begin]];
      if (r.in_place) {
        ops.push_back({first.dst, reinterpret_cast<uint64_t>(first.src), r.bytes, ucx_->pool});
        continue;
      }
      if (staged > 0 && staged + r.bytes > kStagingBytes) break;
      staged += r.bytes;
    }
    if (staging_.size() < staged) staging_.resize(staged);
    uint64_t at = 0;
    for (size_t i = next; i < end; ++i) {
      if (runs[i].in_place) continue;
      ops.push_back({staging_.data() + at,
                     reinterpret_cast<uint64_t>(copies[order[runs[i].begin]].src), runs[i].bytes,
                     ucx_->pool});
      at += runs[i].bytes;
    }
    if (absl::Status s = Gets(ops); !s.ok()) return s;
    at = 0;
    for (size_t i = next; i < end; ++i) {
      if (runs[i].in_place) continue;
      for (size_t j = runs[i].begin; j < runs[i].end; ++j) {
        const OutCopy& c = copies[order[j]];
        std::memcpy(c.dst, staging_.data() + at, c.bytes);
        at += c.bytes;
      }
    }
    next = end;
  }
  return absl::OkStatus();
}

absl::Status UcxPool::CopyOut(void* dst, const uint8_t* src, uint64_t bytes) const {
  const uint64_t offset = static_cast<uint64_t>(src - base_);
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("ucx: bytes [", offset, ", ", offset + bytes,
                                              ") are outside the pool of ", bytes_));
  }
  absl::MutexLock lock(&mu_);
  return Get(dst, reinterpret_cast<uint64_t>(src), bytes, ucx_->pool);
}

absl::StatusOr<uint64_t> UcxPool::EpochWord(uint32_t slot) const {
  uint64_t word = 0;
  if (absl::Status s =
          Get(&word, board_address_ + uint64_t{slot} * stride_, sizeof word, ucx_->board);
      !s.ok()) {
    return s;
  }
  return word;  // the daemon and this host share byte order (UCX moves bytes as they are)
}

absl::Status UcxPool::BeginRead(const BlockTable& table) const {
  if (table.epoch_slot >= slots_) return EpochReader::CheckBefore(table, slots_, 0);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<uint64_t> word = EpochWord(table.epoch_slot);
  if (!word.ok()) return word.status();
  return EpochReader::CheckBefore(table, slots_, *word);
}

absl::Status UcxPool::EndRead(const BlockTable& table) const {
  if (table.epoch_slot >= slots_) return EpochReader::CheckBefore(table, slots_, 0);
  absl::MutexLock lock(&mu_);
  // Every get of the blocks completed before this one was posted (each is waited for).
  absl::StatusOr<uint64_t> word = EpochWord(table.epoch_slot);
  if (!word.ok()) return word.status();
  return EpochReader::CheckAfter(table, *word);
}

uint64_t UcxPool::bytes_read() const {
  absl::MutexLock lock(&mu_);
  return bytes_read_;
}

uint64_t UcxPool::gets() const {
  absl::MutexLock lock(&mu_);
  return gets_;
}

bool UcxPool::broken() const { return broken_.load(); }

}  // namespace kvmem::client
