#include "server/transport/step_channel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/rpc/status.pb.h"
#include "kernels/half_arrays.h"
#include "kvmem/v1/step_channel.h"
#include "server/common/client_text.h"
#include "server/common/mutex.h"
#include "server/transport/parse_cost.h"
#include "server/transport/segment_guard.h"

namespace kvmem::transport {

namespace layout = v1::step_channel;

StepChannelBudget::Lease::~Lease() {
  if (budget_ == nullptr) return;
  kvmem::MutexLock lock(&budget_->mu_);
  --budget_->channels_;
  budget_->bytes_ -= bytes_;
}

absl::StatusOr<StepChannelBudget::Lease> StepChannelBudget::Open(uint64_t bytes) {
  kvmem::MutexLock lock(&mu_);
  if (channels_ >= max_channels_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("OpenStepChannel: --max-step-channels=", max_channels_,
                     " channels are open; close one or use StepBatch over gRPC"));
  }
  if (bytes > max_bytes_ - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "capacity_bytes: a channel holding ", bytes, " bytes would pass --step-channel-bytes=",
        max_bytes_, " (", bytes_, " held by open channels); ask for less"));
  }
  ++channels_;
  bytes_ += bytes;
  return Lease(this, bytes);
}

uint32_t StepChannelBudget::open() const {
  kvmem::MutexLock lock(&mu_);
  return channels_;
}

uint64_t StepChannel::SegmentBytes(uint64_t capacity) {
  return layout::kHeaderBytes + 2 * capacity;
}

uint64_t StepChannel::HeldBytes(uint64_t capacity, uint64_t signal_bytes) {
  return SegmentBytes(capacity) + capacity + ArenaBlockBytes(capacity) +
         2 * MaxAnswerBytes(capacity) + 4 * signal_bytes;
}

size_t StepChannel::FitAnswer(v1::StepBatchResponse* response, uint64_t limit) {
  size_t total = response->ByteSizeLong();
  if (total <= limit) return total;
  // A result's share of the answer: its tag, its length and its bytes.
  const auto framed = [](size_t bytes) {
    return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(bytes) + bytes;
  };
  const auto trim = [&](v1::StepBatchResult* result, const auto& change) {
    const size_t before = framed(result->ByteSizeLong());
    change(result);
    total -= before - framed(result->ByteSizeLong());
  };
  for (int i = response->results_size() - 1; i >= 0 && total > limit; --i) {
    const v1::StepBatchResult& result = response->results(i);
    if (!result.has_table_update() && !result.append().has_table_update() &&
        !result.step().has_table_update()) {
      continue;
    }
    trim(response->mutable_results(i), [](v1::StepBatchResult* result) {
      result->clear_table_update();
      if (result->has_append()) result->mutable_append()->clear_table_update();
      if (result->has_step()) result->mutable_step()->clear_table_update();
    });
  }
  for (int i = response->results_size() - 1; i >= 0 && total > limit; --i) {
    trim(response->mutable_results(i), [](v1::StepBatchResult* result) {
      google::rpc::Status* status = result->mutable_status();
      status->clear_details();
      if (status->message().size() > kMaxDetailTextBytes) {
        status->set_message(CutMessage(status->message(), kMaxDetailTextBytes));
      }
    });
  }
  return response->ByteSizeLong();  // caches the sizes the serialization uses
}

absl::StatusOr<std::unique_ptr<StepChannel>> StepChannel::Create(uint64_t capacity,
                                                                 ErrorMapper to_grpc,
                                                                 uint64_t signal_bytes) {
  absl::StatusOr<std::shared_ptr<SharedSegment>> segment =
      SharedSegment::Create("kvmem-chan", SegmentBytes(capacity));
  if (!segment.ok()) return segment.status();
  // Its client writes requests into it: sizes sealed, writers not.
  if (absl::Status s = (*segment)->Seal(/*writers_too=*/false); !s.ok()) return s;
  std::shared_ptr<SharedSegment> signals;
  if (signal_bytes > 0) {
    absl::StatusOr<std::shared_ptr<SharedSegment>> created =
        SharedSegment::Create("kvmem-sig", signal_bytes);
    if (!created.ok()) return created.status();
    if (absl::Status s = (*created)->Seal(/*writers_too=*/false); !s.ok()) return s;
    signals = *std::move(created);
  }
  std::string nonce(layout::kNonceBytes, '\0');
  absl::BitGen bits;
  for (char& c : nonce) c = static_cast<char>(absl::Uniform<uint8_t>(bits));
  auto* header = new ((*segment)->data()) layout::Header{};
  header->magic = layout::kMagic;
  header->layout_version = layout::kLayoutVersion;
  header->request_offset = layout::kHeaderBytes;
  header->response_offset = layout::kHeaderBytes + capacity;
  header->capacity_bytes = capacity;
  std::memcpy(header->nonce, nonce.data(), layout::kNonceBytes);
  return std::unique_ptr<StepChannel>(new StepChannel(
      *std::move(segment), std::move(signals), capacity, std::move(nonce), std::move(to_grpc)));
}

template <typename Read>
absl::Status StepChannel::ReadSignals(uint64_t offset, uint64_t bytes, absl::string_view field,
                                      const Read& read) const {
  if (!signals_) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this step channel has no signal area (open it with signal_bytes)"));
  }
  const uint64_t size = signals_->bytes();
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": bytes [", offset, ", +", bytes,
                                                   ") lie outside the signal area of ", size,
                                                   " bytes"));
  }
  const auto broken = [] {
    return absl::FailedPreconditionError(
        "signal area: shrunk by the client; nothing read from it was used; open a new channel");
  };
  if (signals_broken_.load(std::memory_order_relaxed)) return broken();
  if (bytes == 0) return absl::OkStatus();
  SegmentGuard guard(signals_->data(), size);
  read(signals_->data() + offset);
  if (guard.faulted()) {
    signals_broken_.store(true, std::memory_order_release);
    return broken();
  }
  return absl::OkStatus();
}

absl::Status StepChannel::CopySignals(uint64_t offset, uint64_t bytes, void* out,
                                      absl::string_view field) const {
  return ReadSignals(offset, bytes, field,
                     [&](const uint8_t* from) { std::memcpy(out, from, bytes); });
}

absl::Status StepChannel::ReadSignalValues(uint64_t offset, uint64_t count, bool f16, float* out,
                                           absl::string_view field) const {
  const uint64_t width = f16 ? 2 : 4;
  if (count > UINT64_MAX / width) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", count, " values"));
  }
  return ReadSignals(offset, count * width, field, [&](const uint8_t* from) {
    if (f16) {
      kernels::HalfToFloat(from, count, out);
    } else {
      std::memcpy(out, from, count * width);
    }
  });
}

void StepChannel::Answer(uint32_t seq, uint32_t code, uint64_t bytes, uint64_t total,
                         Exchange& exchange, const Recorder& record) {
  exchange.code = static_cast<int>(code);
  exchange.bytes_out = bytes;
  exchange.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - exchange.seen).count();
  if (record) record(exchange);
  auto* header = reinterpret_cast<layout::Header*>(segment_->data());
  header->response_bytes.store(static_cast<uint32_t>(bytes), std::memory_order_relaxed);
  header->response_code.store(code, std::memory_order_relaxed);
  header->response_total.store(total, std::memory_order_relaxed);
  header->response_seq.store(seq, std::memory_order_release);
  layout::FutexWakeAll(&header->response_seq);
}

void StepChannel::SendChunk(uint32_t seq, Exchange& exchange, const Recorder& record) {
  const size_t n = std::min<size_t>(pending_.size() - pending_sent_, capacity_);
  std::memcpy(segment_->data() + layout::kHeaderBytes + capacity_, pending_.data() + pending_sent_,
              n);
  pending_sent_ += n;
  const uint64_t total = pending_.size();
  if (pending_sent_ == pending_.size()) {
    std::string().swap(pending_);
    pending_sent_ = 0;
  }
  Answer(seq, 0, n, total, exchange, record);
}

StepChannel::Served StepChannel::ServeOne(absl::Duration wait, const Handler& handler,
                                          const Recorder& record) {
  Exchange ex;
  uint8_t* const data = segment_->data();
  auto* header = reinterpret_cast<layout::Header*>(data);
  // What the parse may allocate (reserved before it parses); released after the arena
  // (declared first).
  ParseBudget::Reservation parse_held;
  google::protobuf::ArenaOptions options;
  options.initial_block = arena_block_.get();
  options.initial_block_size = ArenaBlockBytes(capacity_);
  google::protobuf::Arena arena(options);
  v1::StepBatchRequest& request =
      *google::protobuf::Arena::CreateMessage<v1::StepBatchRequest>(&arena);
  grpc::Status status;
  uint32_t seq = 0;
  uint32_t kind = layout::kBatch;
  {
    SegmentGuard guard(data, segment_->bytes());
    seq = header->request_seq.load(std::memory_order_acquire);
    if (seq == served_seq_ && !guard.faulted()) {
      layout::FutexWait(&header->request_seq, seq, absl::ToInt64Nanoseconds(wait));
      seq = header->request_seq.load(std::memory_order_acquire);
    }
    if (guard.faulted()) return Served::kBroken;
    if (seq == served_seq_) return Served::kIdle;
    ex.seen = std::chrono::steady_clock::now();
    kind = header->request_kind.load(std::memory_order_relaxed);
    const uint32_t bytes = header->request_bytes.load(std::memory_order_relaxed);
    // A call, unless it asks for a chunk that is pending (a malformed request is a failed call).
    ex.batch = kind != layout::kMore || pending_.empty();
    if (kind == layout::kMore) {
      if (pending_.empty()) {
        status =
            to_grpc_(absl::InvalidArgumentError("request_kind: kMore, but no answer is pending"));
      } else {
        served_seq_ = seq;
        SendChunk(seq, ex, record);
        return guard.faulted() ? Served::kBrokenAfterRun : Served::kServed;
      }
    } else if (kind != layout::kBatch) {
      status = to_grpc_(absl::InvalidArgumentError(
          absl::StrCat("request_kind: ", kind, " is neither kBatch nor kMore")));
    } else if (bytes > capacity_) {
      status = to_grpc_(absl::InvalidArgumentError(absl::StrCat(
          "request_bytes: ", bytes, " is past the channel's capacity of ", capacity_)));
    } else {
      // Parse a private copy: the client can write the segment at any time, and a parse
      // of memory changing under it could combine two requests.
      std::memcpy(request_copy_.get(), data + layout::kHeaderBytes, bytes);
      ex.bytes_in = bytes;  // only what was read: a refused length is the client's claim
      // What was read from a segment that faulted is zeros, not the client's bytes.
      if (guard.faulted()) return Served::kBroken;
      std::atomic_thread_fence(std::memory_order_acquire);  // the copy's reads come first
      const uint32_t seq_after = header->request_seq.load(std::memory_order_relaxed);
      if (guard.faulted()) return Served::kBroken;  // a zero read there is no new request
      if (seq_after != seq) {
        served_seq_ = seq;  // another request posted while it was copied: its client moved on
        std::string().swap(pending_);
        pending_sent_ = 0;
        return Served::kIdle;
      }
      const absl::string_view copy(request_copy_.get(), bytes);
      // All of it: the arena's own block holds the objects, but strings' bytes (K/V) and
      // unknown fields go to the heap beside it.
      absl::StatusOr<uint64_t> cost =
          ParseCost(v1::StepBatchRequest::descriptor(), copy, /*on_arena=*/true);
      absl::StatusOr<ParseBudget::Reservation> held =
          cost.ok() ? ParseBudget::Process().Reserve(*cost, "the step channel's StepBatchRequest")
                    : cost.status();
      if (!held.ok()) {
        status = to_grpc_(absl::IsInvalidArgument(held.status())
                              ? absl::InvalidArgumentError(
                                    "request: the request area does not hold a StepBatchRequest")
                              : held.status());
      } else {
        parse_held = *std::move(held);
        if (!request.ParseFromArray(copy.data(), static_cast<int>(bytes))) {
          status = to_grpc_(absl::InvalidArgumentError(
              "request: the request area does not hold a StepBatchRequest"));
        }
      }
    }
    if (guard.faulted()) return Served::kBroken;
  }
  served_seq_ = seq;
  if (kind == layout::kBatch) {
    std::string().swap(pending_);  // a new batch: the client gave up the rest of the last
    pending_sent_ = 0;
  }
  if (status.ok() && request.request_id().empty()) {
    status = to_grpc_(absl::InvalidArgumentError(
        "request_id: required on a step channel (a batch whose answer is lost with its channel "
        "is repeated by gRPC under it)"));
  }
  v1::StepBatchResponse& response =
      *google::protobuf::Arena::CreateMessage<v1::StepBatchResponse>(&arena);
  const bool ran = status.ok();
  if (ran) status = handler(request, &response);

  SegmentGuard guard(data, segment_->bytes());
  uint8_t* const out = data + layout::kHeaderBytes + capacity_;
  const size_t bytes = status.ok() ? FitAnswer(&response, MaxAnswerBytes(capacity_)) : 0;
  if (bytes > MaxAnswerBytes(capacity_)) {
    // FitAnswer's trimmed results cannot add up to this (a static_assert in the service
    // checks it for the largest batch); should they ever, the batch ran and its client
    // gets its answer by repeating it over gRPC under the same request_id.
    status = grpc::Status(grpc::StatusCode::INTERNAL,
                          "step channel: the answer is longer than the channel can hold; "
                          "repeat the batch over gRPC with the same request_id");
  }
  if (status.ok()) {
    if (bytes <= capacity_) {
      response.SerializeWithCachedSizesToArray(out);
      Answer(seq, 0, bytes, bytes, ex, record);
    } else {
      pending_.resize(bytes);  // under MaxAnswerBytes: below 2 GiB
      response.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(pending_.data()));
      SendChunk(seq, ex, record);
    }
  } else {
    google::rpc::Status rich;
    if (!status.error_details().empty()) rich.ParseFromString(status.error_details());
    rich.set_code(status.error_code());
    rich.set_message(status.error_message());
    if (rich.ByteSizeLong() > capacity_) {  // a message can't be this long, but stay inside
      rich.clear_details();
      rich.set_message(CutMessage(rich.message(), 1024));
    }
    const size_t bytes = rich.ByteSizeLong();
    rich.SerializeWithCachedSizesToArray(out);
    Answer(seq, static_cast<uint32_t>(status.error_code()), bytes, bytes, ex, record);
  }
  if (!guard.faulted()) return Served::kServed;
  return ran ? Served::kBrokenAfterRun : Served::kBroken;
}

}  // namespace kvmem::transport
