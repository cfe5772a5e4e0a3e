#pragma once
// Parsed<T>: a KvCache request as its handler receives it, parsed only for a caller that
// authenticates and only after what the parse may allocate was counted
// (transport::ParseCost) and reserved from the process's ParseBudget; the reservation is
// held while the request lives. gRPC hands a request over through SerializationTraits
// before any handler runs: these traits only keep its bytes (Hold), and KvCacheService,
// which registers its methods with Parsed<T> as the request type (RegisterMethods), parses
// them once the call has authenticated (so that a caller without a token can neither make
// kvmemd parse nor take from the budget). A request that does not parse is
// INVALID_ARGUMENT naming its type; one past the budget is RESOURCE_EXHAUSTED naming
// --parse-memory-bytes.
#include <cstdint>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/impl/serialization_traits.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/sync_stream.h"
#include "server/service/error_details.h"
#include "server/transport/parse_cost.h"

namespace kvmem::service {

// What every Parsed<T> shares, at its start (the RPC interceptor reads a received message
// through it: Parsed<T> has it as its only base, at offset 0).
class ParsedBase {
 public:
  ParsedBase(const ParsedBase&) = delete;
  ParsedBase& operator=(const ParsedBase&) = delete;

  // Takes `buffer`'s bytes (their slices, not a copy), dropping any held before and the
  // message parsed from them; nothing is parsed or reserved.
  void Hold(grpc::ByteBuffer* buffer);
  // Counts, reserves and parses the held bytes into the message, then lets them go. On a
  // refusal the message is empty and status() says why. Nothing held: an empty message.
  absl::Status Parse();
  // The request's size on the wire (0 before Hold).
  uint64_t wire_bytes() const { return wire_bytes_; }
  // Why the last Parse refused (OK when it did not, or none ran).
  const absl::Status& status() const { return status_; }
  // Bytes held from the ParseBudget for this request.
  uint64_t reserved_bytes() const { return reservation_.bytes(); }

 protected:
  explicit ParsedBase(google::protobuf::Message* message) : message_(message) {}
  ~ParsedBase() = default;

 private:
  google::protobuf::Message* const message_;
  grpc::ByteBuffer held_;
  transport::ParseBudget::Reservation reservation_;
  uint64_t wire_bytes_ = 0;
  absl::Status status_;
};

template <class T>
class Parsed final : public ParsedBase {
 public:
  Parsed() : ParsedBase(&message) {}
  T message;
};

// A client stream's messages as a handler reads them. Read is false at the stream's end,
// when the client cancels, and when a message was refused: then refused() says why, and the
// stream must not be applied (a message that fails to parse is not the stream's end).
template <class T>
class MessageReader {
 public:
  virtual ~MessageReader() = default;
  virtual bool Read(T* message) = 0;
  virtual const absl::Status& refused() const = 0;
};

// A gRPC client stream's messages, each through Parsed<T>; the one last read keeps its
// reservation until the next Read.
template <class T>
class ParsedReader final : public MessageReader<T> {
 public:
  explicit ParsedReader(grpc::ServerReader<Parsed<T>>* reader) : reader_(reader) {}
  bool Read(T* message) override {
    // What the caller's last message holds (cleared, its capacity kept) goes before the
    // next parse: only counted buffers are held.
    T().Swap(message);
    if (!reader_->Read(&current_)) return false;
    if (absl::Status parsed = current_.Parse(); !parsed.ok()) {
      refused_ = parsed;
      return false;
    }
    message->Swap(&current_.message);
    return true;
  }
  const absl::Status& refused() const override { return refused_; }

 private:
  grpc::ServerReader<Parsed<T>>* reader_;
  Parsed<T> current_;  // the last message's reservation (its message swapped out)
  absl::Status refused_;
};

}  // namespace kvmem::service

namespace grpc {

template <class T>
class SerializationTraits<kvmem::service::Parsed<T>, void> {
 public:
  static Status Serialize(const kvmem::service::Parsed<T>& /*message*/, ByteBuffer* /*buffer*/,
                          bool* /*own_buffer*/) {
    return Status(StatusCode::INTERNAL, "a Parsed request is never sent");
  }
  static Status Deserialize(ByteBuffer* buffer, kvmem::service::Parsed<T>* parsed) {
    parsed->Hold(buffer);
    return Status::OK;
  }
};

}  // namespace grpc
