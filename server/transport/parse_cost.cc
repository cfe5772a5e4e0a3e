#include "server/transport/parse_cost.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "google/protobuf/wire_format_lite.h"
#include "server/common/mutex.h"

namespace kvmem::transport {
namespace {

namespace pb = google::protobuf;
using Wire = pb::internal::WireFormatLite;

// protobuf's own default nesting limit.
constexpr int kMaxDepth = 100;
// What a string or bytes field holds besides its bytes (the std::string and its heap block's
// rounding), a repeated field's header, an unknown field's record, a map entry's node, and
// what the allocator takes per heap block besides what was asked.
constexpr uint64_t kStringBytes = 48, kRepeatedBytes = 32, kUnknownBytes = 96, kMapNodeBytes = 64,
                   kHeapBlockBytes = 16;
// A string longer than this arriving in pieces is reserved at this size, then grown by
// doubling: it may hold up to twice its length, and three times while it grows
// (protobuf's kSafeStringSize).
constexpr uint64_t kSafeStringBytes = 50000000;

// Past this, the allocator maps pages of their own for a block and rounds it up to a page.
constexpr uint64_t kMappedBlockBytes = 128 << 10, kPageRoundingBytes = 8 << 10;

uint64_t StringBytes(uint64_t length) {
  return (length > kSafeStringBytes ? 3 * length : length) + kStringBytes + kHeapBlockBytes +
         (length >= kMappedBlockBytes ? kPageRoundingBytes : 0);
}

// The bytes one element of a repeated scalar `field` takes in its array.
uint64_t ElementBytes(const pb::FieldDescriptor* field) {
  switch (field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return 1;
    case pb::FieldDescriptor::CPPTYPE_INT32:
    case pb::FieldDescriptor::CPPTYPE_UINT32:
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return 4;
    default:
      return 8;
  }
}

// An empty object of `type`: as protobuf measures it, but for a type with a map field,
// whose measure reads through a null pointer in some builds (seen under TSan with Debian's
// protobuf 3.21): there a generous count per field (no field takes more than 48 bytes in an
// object).
uint64_t EmptyObjectBytes(const pb::Descriptor* type) {
  for (int i = 0; i < type->field_count(); ++i) {
    if (type->field(i)->is_map()) return 64 + 48 * static_cast<uint64_t>(type->field_count());
  }
  const pb::Message* prototype = pb::MessageFactory::generated_factory()->GetPrototype(type);
  return prototype != nullptr ? prototype->SpaceUsedLong() : 64 + 48 * type->field_count();
}

// What the walk needs of a message type, read from its descriptor once (the descriptor's
// own lookups cost more than the walk itself).
struct TypeInfo {
  struct Field {
    enum Kind : uint8_t { kNone, kMessage, kString, kScalar } kind = kNone;
    bool repeated = false;
    bool map = false;
    uint8_t element_bytes = 0;        // kScalar
    Wire::WireType element_wire{};    // kScalar: one element's wire type
    const TypeInfo* child = nullptr;  // kMessage
  };
  const pb::Descriptor* descriptor = nullptr;
  uint64_t object_bytes = 0;  // an empty object of the type
  // By field number, for numbers up to kDense; others through the descriptor.
  static constexpr int kDense = 256;
  std::vector<Field> dense;

  Field Find(int number) const;
};

class TypeInfos {
 public:
  static const TypeInfo* For(const pb::Descriptor* type) {
    static absl::Mutex mu(absl::kConstInit);
    static auto* infos =
        new absl::flat_hash_map<const pb::Descriptor*, std::unique_ptr<TypeInfo>>();
    kvmem::MutexLock lock(&mu);
    return Build(type, *infos);
  }
  static TypeInfo::Field Describe(
      const pb::FieldDescriptor* field,
      absl::flat_hash_map<const pb::Descriptor*, std::unique_ptr<TypeInfo>>* infos) {
    TypeInfo::Field f;
    f.repeated = field->is_repeated();
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        f.kind = TypeInfo::Field::kMessage;
        f.map = field->is_map();
        f.child = infos != nullptr ? Build(field->message_type(), *infos) : nullptr;
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        f.kind = TypeInfo::Field::kString;
        break;
      default:
        f.kind = TypeInfo::Field::kScalar;
        f.element_bytes = static_cast<uint8_t>(ElementBytes(field));
        f.element_wire = Wire::WireTypeForFieldType(static_cast<Wire::FieldType>(field->type()));
        break;
    }
    return f;
  }

 private:
  // Made once per type; a type that contains itself finds its own (already in the map).
  static const TypeInfo* Build(
      const pb::Descriptor* type,
      absl::flat_hash_map<const pb::Descriptor*, std::unique_ptr<TypeInfo>>& infos) {
    auto [it, inserted] = infos.try_emplace(type, nullptr);
    if (!inserted) return it->second.get();
    it->second = std::make_unique<TypeInfo>();
    TypeInfo* info = it->second.get();  // stays where it is (the map holds a pointer)
    info->descriptor = type;
    info->object_bytes = EmptyObjectBytes(type);
    int top = 0;
    for (int i = 0; i < type->field_count(); ++i) {
      if (type->field(i)->number() < TypeInfo::kDense) {
        top = std::max(top, type->field(i)->number());
      }
    }
    info->dense.resize(top + 1);
    for (int i = 0; i < type->field_count(); ++i) {
      const pb::FieldDescriptor* field = type->field(i);
      if (field->number() < TypeInfo::kDense) {
        info->dense[field->number()] = Describe(field, &infos);
      } else if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        Build(field->message_type(), infos);  // Find's answer for it, made ahead
      }
    }
    return info;
  }
};

TypeInfo::Field TypeInfo::Find(int number) const {
  if (number < static_cast<int>(dense.size())) return dense[number];
  if (number < kDense) return Field{};
  const pb::FieldDescriptor* field = descriptor->FindFieldByNumber(number);
  if (field == nullptr) return Field{};
  Field f = TypeInfos::Describe(field, nullptr);
  if (f.kind == Field::kMessage) f.child = TypeInfos::For(field->message_type());
  return f;
}

class Walker {
 public:
  // Repeated fields grow by doubling: while an array grows, the old one and the new one of
  // twice its size are both held (3 times the elements); on an arena the old arrays stay
  // until the arena goes (4 times).
  Walker(pb::io::CodedInputStream* in, bool on_arena) : in_(in), growth_(on_arena ? 4 : 3) {}

  // Walks fields of `type` up to the current limit (or the end), adding to cost_.
  bool Message(const TypeInfo& type, int depth) {
    while (true) {
      const uint32_t tag = in_->ReadTag();
      if (tag == 0) return in_->ConsumedEntireMessage();
      const TypeInfo::Field field = type.Find(Wire::GetTagFieldNumber(tag));
      const Wire::WireType wire = Wire::GetTagWireType(tag);
      if (field.kind == TypeInfo::Field::kNone ||
          (wire != Wire::WIRETYPE_LENGTH_DELIMITED &&
           (field.kind != TypeInfo::Field::kScalar || wire != field.element_wire))) {
        if (!Unknown(tag)) return false;
        continue;
      }
      const uint64_t repeated = field.repeated ? growth_ : 1;
      if (wire != Wire::WIRETYPE_LENGTH_DELIMITED) {  // one scalar element
        cost_ += field.repeated ? repeated * field.element_bytes : 0;
        if (!Wire::SkipField(in_, tag)) return false;
        continue;
      }
      uint32_t length = 0;
      if (!in_->ReadVarint32(&length)) return false;
      switch (field.kind) {
        case TypeInfo::Field::kMessage: {
          if (depth + 1 >= kMaxDepth) return false;
          cost_ += field.child->object_bytes + kHeapBlockBytes +
                   (field.repeated ? growth_ * sizeof(void*) : 0) + (field.map ? kMapNodeBytes : 0);
          const pb::io::CodedInputStream::Limit limit = in_->PushLimit(static_cast<int>(length));
          if (!Message(*field.child, depth + 1)) return false;
          in_->PopLimit(limit);
          break;
        }
        case TypeInfo::Field::kString:
          cost_ += StringBytes(length) + (field.repeated ? growth_ * sizeof(void*) : 0);
          if (!in_->Skip(static_cast<int>(length))) return false;
          break;
        default: {
          if (!field.repeated) {  // a length-delimited record for a singular scalar
            if (!Unknown(tag, length)) return false;
            break;
          }
          // Packed: at most one element per byte for varints, exactly one per 4 or 8 bytes
          // for fixed widths.
          const uint64_t count = field.element_wire == Wire::WIRETYPE_FIXED32   ? length / 4
                                 : field.element_wire == Wire::WIRETYPE_FIXED64 ? length / 8
                                                                                : length;
          cost_ += kRepeatedBytes + kHeapBlockBytes + repeated * count * field.element_bytes;
          if (!in_->Skip(static_cast<int>(length))) return false;
          break;
        }
      }
    }
  }

  uint64_t cost() const { return cost_; }

 private:
  // A field parsing keeps among the unknown ones: its record (a slot of the unknown field
  // set, which grows by doubling, and the set itself at the first), its bytes and, for a
  // group, each field inside it in a set of its own. `length`: the length of a
  // length-delimited field whose tag and length were read already.
  bool Unknown(uint32_t tag, std::optional<uint32_t> length = std::nullopt, int depth = 0) {
    cost_ += kUnknownBytes;
    if (length) {
      cost_ += StringBytes(*length);
      return in_->Skip(static_cast<int>(*length));
    }
    switch (Wire::GetTagWireType(tag)) {
      case Wire::WIRETYPE_LENGTH_DELIMITED: {
        uint32_t n = 0;
        return in_->ReadVarint32(&n) && Unknown(tag, n, depth);
      }
      case Wire::WIRETYPE_START_GROUP: {
        if (depth + 1 >= kMaxDepth) return false;
        cost_ += kUnknownBytes;  // the group's own set
        while (true) {
          const uint32_t inner = in_->ReadTag();
          if (inner == 0) return false;  // the group never ends
          if (Wire::GetTagWireType(inner) == Wire::WIRETYPE_END_GROUP) {
            return Wire::GetTagFieldNumber(inner) == Wire::GetTagFieldNumber(tag);
          }
          if (!Unknown(inner, std::nullopt, depth + 1)) return false;
        }
      }
      case Wire::WIRETYPE_END_GROUP:
        return false;  // outside a group
      default:
        return Wire::SkipField(in_, tag);
    }
  }

  pb::io::CodedInputStream* in_;
  const uint64_t growth_;
  uint64_t cost_ = 0;
};

}  // namespace

absl::StatusOr<uint64_t> ParseCost(const pb::Descriptor* type, pb::io::ZeroCopyInputStream* wire,
                                   bool on_arena) {
  pb::io::CodedInputStream in(wire);
  in.SetTotalBytesLimit(INT32_MAX);
  Walker walker(&in, on_arena);
  const TypeInfo* info = TypeInfos::For(type);
  if (!walker.Message(*info, 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request does not parse as a ", type->full_name()));
  }
  return walker.cost() + info->object_bytes + kHeapBlockBytes;
}

absl::StatusOr<uint64_t> ParseCost(const pb::Descriptor* type, absl::string_view wire,
                                   bool on_arena) {
  pb::io::ArrayInputStream stream(wire.data(), static_cast<int>(wire.size()));
  return ParseCost(type, &stream, on_arena);
}

uint64_t StringParseBytes(uint64_t length) { return StringBytes(length); }

ParseBudget& ParseBudget::Process() {
  static ParseBudget* budget = new ParseBudget(1ull << 30);
  return *budget;
}

absl::StatusOr<ParseBudget::Reservation> ParseBudget::Reserve(uint64_t bytes,
                                                              absl::string_view what) {
  uint64_t held = reserved_.load(std::memory_order_relaxed);
  const uint64_t limit = capacity();
  do {
    if (bytes > limit || held > limit - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": parsing it may take up to ", bytes, " bytes; requests being served hold ", held,
          " of --parse-memory-bytes=", limit,
          bytes > limit ? " (send it in smaller parts)" : " (retry shortly)"));
    }
  } while (!reserved_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
  Reservation reservation;
  reservation.budget_ = this;
  reservation.bytes_ = bytes;
  return reservation;
}

void ParseBudget::Reservation::Release() {
  if (budget_ != nullptr) {
    budget_->reserved_.fetch_sub(bytes_, std::memory_order_relaxed);
    budget_ = nullptr;
    bytes_ = 0;
  }
}

}  // namespace kvmem::transport
