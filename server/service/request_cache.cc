#include "server/service/request_cache.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/reflection.h"
#include "kvmem/v1/kvmem.pb.h"

namespace kvmem::service {
namespace {

using google::protobuf::FieldDescriptor;

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

// Every byte of `run`, eight at a time.
uint64_t MixRun(uint64_t h, absl::string_view run) {
  for (size_t i = 0; i < run.size(); i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, run.data() + i, std::min<size_t>(8, run.size() - i));
    h = Mix(h, word);
  }
  return h;
}

uint64_t MixBytes(uint64_t h, absl::string_view bytes) {
  constexpr size_t kEnd = 32;
  h = Mix(h, bytes.size());
  if (bytes.size() <= 2 * kEnd) return MixRun(h, bytes);
  return MixRun(MixRun(h, bytes.substr(0, kEnd)), bytes.substr(bytes.size() - kEnd));
}

// A repeated field's count and the elements read of it: all of them when `all` (a batch's
// entries) or when there are at most 2 x kEnds, else kEnds at each end (a long prompt's
// token ids would cost reflection calls by the million). `mix(h, i)` mixes element i.
constexpr int kEnds = 4;
template <typename MixElement>
uint64_t MixSampled(uint64_t h, int n, bool all, const MixElement& mix) {
  h = Mix(h, static_cast<uint64_t>(n));
  for (int i = 0; i < n; ++i) {
    if (!all && n > 2 * kEnds && i == kEnds) i = n - kEnds;
    h = mix(h, i);
  }
  return h;
}

uint64_t FloatBits(float v) { return absl::bit_cast<uint32_t>(v); }

uint64_t MixMessage(uint64_t h, const google::protobuf::Message& m, int depth);

// One value of `field` (element `index` of a repeated one, or -1).
uint64_t MixValue(uint64_t h, const google::protobuf::Message& m, const FieldDescriptor* f,
                  int index, int depth) {
  const google::protobuf::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return Mix(h,
                 static_cast<uint32_t>(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f)));
    case FieldDescriptor::CPPTYPE_INT64:
      return Mix(h,
                 static_cast<uint64_t>(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)));
    case FieldDescriptor::CPPTYPE_UINT32:
      return Mix(h, rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return Mix(h, rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Mix(h, FloatBits(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f)));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Mix(h, absl::bit_cast<uint64_t>(rep ? r->GetRepeatedDouble(m, f, index)
                                                 : r->GetDouble(m, f)));
    case FieldDescriptor::CPPTYPE_BOOL:
      return Mix(h, rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f));
    case FieldDescriptor::CPPTYPE_ENUM:
      return Mix(h, static_cast<uint32_t>(rep ? r->GetRepeatedEnumValue(m, f, index)
                                              : r->GetEnumValue(m, f)));
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string scratch;
      const std::string& v = rep ? r->GetRepeatedStringReference(m, f, index, &scratch)
                                 : r->GetStringReference(m, f, &scratch);
      return MixBytes(h, v);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return MixMessage(h, rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f),
                        depth + 1);
  }
  return h;
}

// A message with a map field (a policy's parameters): its deterministic serialization,
// which orders the map's entries by key (reflection would give them in an order seeded per
// parse, and reading a map through reflection rebuilds a cache inside the const message).
bool HasMap(const google::protobuf::Descriptor* d) {
  for (int i = 0; i < d->field_count(); ++i) {
    if (d->field(i)->is_map()) return true;
  }
  return false;
}

uint64_t MixMessage(uint64_t h, const google::protobuf::Message& m, int depth) {
  if (depth > 0 && HasMap(m.GetDescriptor())) {
    std::string bytes;
    {
      google::protobuf::io::StringOutputStream out(&bytes);
      google::protobuf::io::CodedOutputStream coded(&out);
      coded.SetSerializationDeterministic(true);
      m.SerializePartialToCodedStream(&coded);
    }
    return MixRun(Mix(h, bytes.size()), absl::string_view(bytes).substr(0, 4096));
  }
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);  // the set ones, by number
  for (const FieldDescriptor* f : fields) {
    if (depth == 0 && f->name() == "request_id") continue;
    h = Mix(h, static_cast<uint64_t>(f->number()));
    if (!f->is_repeated()) {
      h = MixValue(h, m, f, -1, depth);
      continue;
    }
    const bool all = depth == 0 && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    h = MixSampled(h, r->FieldSize(m, f), all,
                   [&](uint64_t acc, int i) { return MixValue(acc, m, f, i, depth); });
  }
  return h;
}

// The decode loop's calls (StepBatch, Step), by their generated accessors: the value
// ReflectedFingerprint gives (the same fields in the same order, by the same rules), at a
// fraction of the cost: the reflection walk took about 30 us of an 8k SmolLM2 step's daemon
// time (bench/RESULTS.md, session 18), and 20 us of a single confkv Step (session 20). A test
// holds the two equal on messages with every field set, so a field added to these messages
// and not here fails it.
template <typename T, typename Bits>
uint64_t MixRepeated(uint64_t h, int number, const google::protobuf::RepeatedField<T>& values,
                     Bits bits) {
  if (values.empty()) return h;
  return MixSampled(Mix(h, static_cast<uint64_t>(number)), values.size(), false,
                    [&](uint64_t acc, int i) { return Mix(acc, bits(values.Get(i))); });
}

// A proto3 scalar is set (ListFields lists it) when it is not zero; a float by its bits.
uint64_t MixScalar(uint64_t h, int number, uint64_t bits) {
  return bits == 0 ? h : Mix(Mix(h, static_cast<uint64_t>(number)), bits);
}

uint64_t MixField(uint64_t h, int number, const std::string& bytes) {
  return bytes.empty() ? h : MixBytes(Mix(h, static_cast<uint64_t>(number)), bytes);
}

uint64_t MixTokens(uint64_t h, const v1::NewTokens& t) {
  const auto int64_bits = [](int64_t v) { return static_cast<uint64_t>(v); };
  const auto int32_bits = [](int32_t v) { return uint64_t{static_cast<uint32_t>(v)}; };
  h = MixRepeated(h, v1::NewTokens::kPositionsFieldNumber, t.positions(), int64_bits);
  h = MixRepeated(h, v1::NewTokens::kTokenIdsFieldNumber, t.token_ids(), int32_bits);
  h = MixField(h, v1::NewTokens::kKFieldNumber, t.k());
  h = MixField(h, v1::NewTokens::kVFieldNumber, t.v());
  h = MixRepeated(h, v1::NewTokens::kTokenEntropyFieldNumber, t.token_entropy(), FloatBits);
  return MixRepeated(h, v1::NewTokens::kLayerDistanceFieldNumber, t.layer_distance(), FloatBits);
}

uint64_t MixRow(uint64_t h, const v1::AttentionRow& row) {
  h = MixScalar(h, v1::AttentionRow::kLayerFieldNumber, row.layer());
  h = MixScalar(h, v1::AttentionRow::kKvHeadFieldNumber, row.kv_head());
  h = MixRepeated(h, v1::AttentionRow::kWeightsFieldNumber, row.weights(), FloatBits);
  return MixField(h, v1::AttentionRow::kWeightsF16FieldNumber, row.weights_f16());
}

uint64_t MixLogitStats(uint64_t h, const v1::LogitStats& l) {
  h = MixScalar(h, v1::LogitStats::kEntropyFieldNumber, FloatBits(l.entropy()));
  h = MixScalar(h, v1::LogitStats::kP1FieldNumber, FloatBits(l.p1()));
  h = MixScalar(h, v1::LogitStats::kP2FieldNumber, FloatBits(l.p2()));
  return MixRepeated(h, v1::LogitStats::kTopLogprobsFieldNumber, l.top_logprobs(), FloatBits);
}

// A message's attention rows, field `number`: every row when the message is the request
// itself (the reflection walk reads all elements of a top-level repeated message), else
// the sampled ends.
uint64_t MixRows(uint64_t h, int number,
                 const google::protobuf::RepeatedPtrField<v1::AttentionRow>& rows, bool all) {
  if (rows.empty()) return h;
  return MixSampled(Mix(h, static_cast<uint64_t>(number)), rows.size(), all,
                    [&](uint64_t acc, int i) { return MixRow(acc, rows.Get(i)); });
}

uint64_t MixClientTable(uint64_t h, int number, const v1::ClientTable& t) {
  h = Mix(h, static_cast<uint64_t>(number));
  h = MixScalar(h, v1::ClientTable::kVersionFieldNumber, t.version());
  return MixScalar(h, v1::ClientTable::kPositionsFieldNumber, t.positions());
}

uint64_t MixSignals(uint64_t h, const v1::StepSignals& s) {
  h = MixScalar(h, v1::StepSignals::kEpochFieldNumber, s.epoch());
  if (s.has_logit_stats()) {
    h = MixLogitStats(Mix(h, v1::StepSignals::kLogitStatsFieldNumber), s.logit_stats());
  }
  return MixRows(h, v1::StepSignals::kAttentionFieldNumber, s.attention(), /*all=*/false);
}

uint64_t MixEntry(uint64_t h, const v1::StepBatchEntry& e) {
  h = MixScalar(h, v1::StepBatchEntry::kSequenceIdFieldNumber, e.sequence_id());
  if (e.has_append()) h = MixTokens(Mix(h, v1::StepBatchEntry::kAppendFieldNumber), e.append());
  if (e.has_step()) h = MixSignals(Mix(h, v1::StepBatchEntry::kStepFieldNumber), e.step());
  if (e.has_client_table()) {
    h = MixClientTable(h, v1::StepBatchEntry::kClientTableFieldNumber, e.client_table());
  }
  return h;
}

uint64_t StepBatchFingerprint(const v1::StepBatchRequest& batch) {
  static const uint64_t kStart = Mix(0, v1::StepBatchRequest::descriptor()->index());
  if (batch.entries().empty()) return kStart;
  return MixSampled(Mix(kStart, v1::StepBatchRequest::kEntriesFieldNumber), batch.entries_size(),
                    /*all=*/true,
                    [&](uint64_t acc, int i) { return MixEntry(acc, batch.entries(i)); });
}

// The single-sequence Step, the same way: its rows are the request's own repeated message,
// so all of them count, as in the reflection walk.
uint64_t StepFingerprint(const v1::StepRequest& step) {
  static const uint64_t kStart = Mix(0, v1::StepRequest::descriptor()->index());
  uint64_t h = MixScalar(kStart, v1::StepRequest::kSequenceIdFieldNumber, step.sequence_id());
  h = MixScalar(h, v1::StepRequest::kEpochFieldNumber, step.epoch());
  if (step.has_logit_stats()) {
    h = MixLogitStats(Mix(h, v1::StepRequest::kLogitStatsFieldNumber), step.logit_stats());
  }
  h = MixRows(h, v1::StepRequest::kAttentionFieldNumber, step.attention(), /*all=*/true);
  if (step.has_client_table()) {
    h = MixClientTable(h, v1::StepRequest::kClientTableFieldNumber, step.client_table());
  }
  return h;
}

}  // namespace

uint64_t ReflectedFingerprint(const google::protobuf::Message& request) {
  return MixMessage(Mix(0, request.GetDescriptor()->index()), request, 0);
}

uint64_t RequestFingerprint(const google::protobuf::Message& request) {
  if (const auto* batch =
          google::protobuf::DynamicCastToGenerated<v1::StepBatchRequest>(&request)) {
    return StepBatchFingerprint(*batch);
  }
  if (const auto* step = google::protobuf::DynamicCastToGenerated<v1::StepRequest>(&request)) {
    return StepFingerprint(*step);
  }
  return ReflectedFingerprint(request);
}

// A finished call's answer copied into `response` (*entry stays null: replayed).
absl::Status RequestCache::Replay(const Entry& done, google::protobuf::Message* response) {
  if (!response->ParseFromString(done.response)) {
    return absl::InternalError("request_id: the stored response does not parse");
  }
  return absl::OkStatus();
}

absl::Status RequestCache::Claim(const std::string& key, uint64_t fingerprint,
                                 google::protobuf::Message* response,
                                 std::shared_ptr<Entry>* entry) {
  kvmem::MutexLock lock(&mu_);
  EvictLocked();
  for (;;) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      *entry = std::make_shared<Entry>();
      (*entry)->fingerprint = fingerprint;
      entries_.emplace(key, *entry);
      return absl::OkStatus();
    }
    std::shared_ptr<Entry> found = it->second;
    if (found->fingerprint != fingerprint && !(found->done && !found->ok)) {
      return absl::InvalidArgumentError(
          "request_id: already used for a different request (a retry must resend the same "
          "request; a new request needs a new id)");
    }
    if (found->done) {
      if (!found->ok) {  // failed calls are not kept: Finish removed it; run again
        entries_.erase(it);
        continue;
      }
      return Replay(*found, response);
    }
    // The first call with this id is still running: wait for it, for a while.
    TsanRelease(&mu_);
    ++waiting_;
    const bool done = mu_.AwaitWithTimeout(absl::Condition(
                                               +[](Entry* e) { return e->done; }, found.get()),
                                           kMaxWait);
    TsanAcquire(&mu_);
    --waiting_;
    if (!done) {
      return absl::AbortedError(
          "request_id: the first call with this id is still running; retry later");
    }
    // The first call's own entry answers, even if the cache let it go meanwhile (a small
    // cache, a large response): looking the key up again would run the call twice.
    if (found->ok) return Replay(*found, response);
  }
}

void RequestCache::Finish(const std::string& key, const std::shared_ptr<Entry>& entry,
                          const absl::Status& status, const google::protobuf::Message& response) {
  std::string bytes;
  if (status.ok()) response.SerializeToString(&bytes);
  kvmem::MutexLock lock(&mu_);
  entry->ok = status.ok();
  entry->response = std::move(bytes);
  entry->stored = clock_->Now();
  entry->done = true;  // wakes the waiters
  if (!entry->ok) {
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second == entry) entries_.erase(it);
    return;
  }
  order_.push_back(key);
  bytes_ += key.size() + entry->response.size();
  EvictLocked();
}

void RequestCache::EvictLocked() {
  const absl::Time now = clock_->Now();
  while (!order_.empty()) {
    auto it = entries_.find(order_.front());
    const bool stale = it == entries_.end() || !it->second->done ||
                       now - it->second->stored > ttl_ || order_.size() > max_entries_ ||
                       bytes_ > max_bytes_;
    if (!stale) break;
    if (it != entries_.end() && it->second->done) {
      bytes_ -= std::min<uint64_t>(bytes_, it->first.size() + it->second->response.size());
      entries_.erase(it);
    }
    order_.pop_front();
  }
}

uint64_t RequestCache::bytes() const {
  kvmem::MutexLock lock(&mu_);
  return bytes_;
}

size_t RequestCache::waiting() const {
  kvmem::MutexLock lock(&mu_);
  return waiting_;
}

size_t RequestCache::size() const {
  kvmem::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace kvmem::service
