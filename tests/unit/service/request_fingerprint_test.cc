// RequestFingerprint hashes every byte of a request: an id reused for a request that differs
// anywhere (one byte in the middle of a long K/V payload included) must be told from a
// retry, and a retry of the same request (reparsed, as after another transport, or with its
// map entries in another order) must not be.
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "gtest/gtest.h"
#include "kvmem/v1/kvmem.pb.h"
#include "server/service/request_cache.h"

namespace kvmem::service {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Sets a random selection of `m`'s fields (all of them when `all`), recursively, with
// values that probe the fingerprint's rules: repeated fields around its 2 x 4 sampled
// ends, bytes around its 2 x 32, floats with -0.0 and NaN among them.
class Filler {
 public:
  explicit Filler(uint32_t seed) : rng_(seed) {}

  void Fill(Message* m, bool all, int depth) {
    const google::protobuf::Reflection* r = m->GetReflection();
    const google::protobuf::Descriptor* d = m->GetDescriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      const FieldDescriptor* f = d->field(i);
      if (!all && Pick(3) == 0) continue;
      static constexpr int kSizes[] = {0, 1, 3, 8, 9, 20};
      const int n = !f->is_repeated() ? 1
                    : depth > 2 && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE
                        ? 2
                        : kSizes[all ? 1 + Pick(5) : Pick(6)];
      for (int k = 0; k < n; ++k) Put(m, r, f, all, depth);
    }
  }

 private:
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  uint64_t Bits() { return rng_(); }
  float Float() {
    switch (Pick(6)) {
      case 0:
        return -0.0f;
      case 1:
        return std::numeric_limits<float>::quiet_NaN();
      case 2:
        return 0.0f;
      default:
        return std::uniform_real_distribution<float>(-4, 4)(rng_);
    }
  }
  std::string Bytes() {
    static constexpr size_t kLengths[] = {0, 5, 64, 65, 200};
    std::string s(kLengths[Pick(5)], '\0');
    for (char& c : s) c = static_cast<char>(Pick(256));
    return s;
  }

  // One value of field `f`: set, or added to a repeated field.
  void Put(Message* m, const google::protobuf::Reflection* r, const FieldDescriptor* f, bool all,
           int depth) {
    const bool rep = f->is_repeated();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32: {
        const auto v = static_cast<int32_t>(Bits());
        rep ? r->AddInt32(m, f, v) : r->SetInt32(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        const auto v = static_cast<int64_t>(Bits());
        rep ? r->AddInt64(m, f, v) : r->SetInt64(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT32: {
        const auto v = static_cast<uint32_t>(Bits());
        rep ? r->AddUInt32(m, f, v) : r->SetUInt32(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT64: {
        const uint64_t v = Bits();
        rep ? r->AddUInt64(m, f, v) : r->SetUInt64(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_FLOAT: {
        const float v = Float();
        rep ? r->AddFloat(m, f, v) : r->SetFloat(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_DOUBLE: {
        const double v = Float();
        rep ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL: {
        const bool v = Pick(2) == 1;
        rep ? r->AddBool(m, f, v) : r->SetBool(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_ENUM: {
        const int v = Pick(3);
        rep ? r->AddEnumValue(m, f, v) : r->SetEnumValue(m, f, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING:
        rep ? r->AddString(m, f, Bytes()) : r->SetString(m, f, Bytes());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        Fill(rep ? r->AddMessage(m, f) : r->MutableMessage(m, f), all, depth + 1);
        break;
    }
  }

  std::mt19937_64 rng_;
};

// A checker for changes to `request`: each change must move its fingerprint. Checks first
// that a copy and a reparse of its serialization keep it.
template <typename Request>
auto ChangesCount(Request request) {
  request.set_request_id("retry-7");  // a string field must hold UTF-8 to parse again
  const uint64_t base = RequestFingerprint(request);
  EXPECT_EQ(RequestFingerprint(Request(request)), base);
  Request reparsed;
  EXPECT_TRUE(reparsed.ParseFromString(request.SerializeAsString()));
  EXPECT_EQ(RequestFingerprint(reparsed), base) << "a retry through another transport";
  return [request, base](const char* what, auto&& change) {
    Request c = request;
    change(&c);
    EXPECT_NE(RequestFingerprint(c), base) << what;
  };
}

// A change in any one field of a batch with every field set changes the fingerprint.
TEST(RequestFingerprintTest, EachFieldOfABatchCounts) {
  v1::StepBatchRequest batch;
  Filler(7).Fill(&batch, /*all=*/true, 0);
  const auto changes = ChangesCount(batch);
  auto expect_changed = [&](const char* what, auto&& change) {
    changes(what, [&](v1::StepBatchRequest* c) { change(c->mutable_entries(0)); });
  };
  expect_changed("sequence_id",
                 [](v1::StepBatchEntry* e) { e->set_sequence_id(e->sequence_id() + 1); });
  expect_changed("append.positions", [](v1::StepBatchEntry* e) {
    e->mutable_append()->set_positions(0, e->append().positions(0) + 1);
  });
  expect_changed("append.k's length", [](v1::StepBatchEntry* e) {
    std::string* k = e->mutable_append()->mutable_k();
    k->push_back('\x01');
  });
  expect_changed("append.layer_distance",
                 [](v1::StepBatchEntry* e) { e->mutable_append()->add_layer_distance(1.5f); });
  expect_changed("step.epoch", [](v1::StepBatchEntry* e) {
    e->mutable_step()->set_epoch(e->step().epoch() + 1);
  });
  expect_changed("step.logit_stats.p2", [](v1::StepBatchEntry* e) {
    e->mutable_step()->mutable_logit_stats()->set_p2(0.125f);
  });
  expect_changed("step.attention[0].weights_f16", [](v1::StepBatchEntry* e) {
    e->mutable_step()->mutable_attention(0)->mutable_weights_f16()->append("zz");
  });
  expect_changed("client_table.version", [](v1::StepBatchEntry* e) {
    e->mutable_client_table()->set_version(e->client_table().version() + 1);
  });
  expect_changed("client_table.positions", [](v1::StepBatchEntry* e) {
    e->mutable_client_table()->set_positions(!e->client_table().positions());
  });
  // Same lengths, other content: every byte is read, not only the sizes.
  expect_changed("append.k's last byte", [](v1::StepBatchEntry* e) {
    std::string* k = e->mutable_append()->mutable_k();
    k->back() = static_cast<char>(k->back() ^ 1);
  });
  expect_changed("append.v's first byte", [](v1::StepBatchEntry* e) {
    std::string* v = e->mutable_append()->mutable_v();
    v->front() = static_cast<char>(v->front() ^ 1);
  });
  expect_changed("append.token_ids' last", [](v1::StepBatchEntry* e) {
    auto* ids = e->mutable_append()->mutable_token_ids();
    ids->Set(ids->size() - 1, ids->Get(ids->size() - 1) + 1);
  });
  expect_changed("append.token_entropy's last", [](v1::StepBatchEntry* e) {
    auto* x = e->mutable_append()->mutable_token_entropy();
    x->Set(x->size() - 1, x->Get(x->size() - 1) + 8.0f);
  });
  expect_changed("step.logit_stats.entropy", [](v1::StepBatchEntry* e) {
    e->mutable_step()->mutable_logit_stats()->set_entropy(3.25f);
  });
  expect_changed("step.logit_stats.top_logprobs' first", [](v1::StepBatchEntry* e) {
    auto* x = e->mutable_step()->mutable_logit_stats()->mutable_top_logprobs();
    x->Set(0, x->Get(0) + 8.0f);
  });
  expect_changed("the last attention row's kv_head", [](v1::StepBatchEntry* e) {
    v1::AttentionRow* row = e->mutable_step()->mutable_attention(e->step().attention_size() - 1);
    row->set_kv_head(row->kv_head() + 1);
  });
  expect_changed("step.attention[0].weights' last", [](v1::StepBatchEntry* e) {
    auto* w = e->mutable_step()->mutable_attention(0)->mutable_weights();
    w->Set(w->size() - 1, w->Get(w->size() - 1) + 8.0f);
  });
  expect_changed("step.attention[0].weights_f16's last byte", [](v1::StepBatchEntry* e) {
    std::string* w = e->mutable_step()->mutable_attention(0)->mutable_weights_f16();
    w->back() = static_cast<char>(w->back() ^ 1);
  });
}

// As for a batch, rows in the middle included.
TEST(RequestFingerprintTest, EachFieldOfAStepCounts) {
  v1::StepRequest step;
  Filler(11).Fill(&step, /*all=*/true, 0);
  while (step.attention_size() < 9) *step.add_attention() = step.attention(0);
  const auto expect_changed = ChangesCount(step);
  expect_changed("sequence_id",
                 [](v1::StepRequest* s) { s->set_sequence_id(s->sequence_id() + 1); });
  expect_changed("epoch", [](v1::StepRequest* s) { s->set_epoch(s->epoch() + 1); });
  expect_changed("logit_stats.p1",
                 [](v1::StepRequest* s) { s->mutable_logit_stats()->set_p1(0.375f); });
  expect_changed("the middle attention row's layer", [](v1::StepRequest* s) {
    v1::AttentionRow* row = s->mutable_attention(s->attention_size() / 2);
    row->set_layer(row->layer() + 1);
  });
  expect_changed("the middle attention row's weights_f16", [](v1::StepRequest* s) {
    s->mutable_attention(s->attention_size() / 2)->mutable_weights_f16()->append("zz");
  });
  expect_changed("client_table.version", [](v1::StepRequest* s) {
    s->mutable_client_table()->set_version(s->client_table().version() + 1);
  });
}

// One flipped bit anywhere in a long payload, its middle included, changes the fingerprint;
// so does one middle element of a long repeated field.
TEST(RequestFingerprintTest, EveryByteOfALongPayloadCounts) {
  v1::StepBatchRequest batch;
  v1::NewTokens* t = batch.add_entries()->mutable_append();
  for (int i = 0; i < 1000; ++i) t->add_token_ids(i);
  t->set_k(std::string(90 * 64 * 4 * 8, '\x11'));
  t->set_v(t->k());
  const uint64_t base = RequestFingerprint(batch);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    v1::StepBatchRequest c = batch;
    std::string* k = c.mutable_entries(0)->mutable_append()->mutable_k();
    const size_t at = std::uniform_int_distribution<size_t>(0, k->size() - 1)(rng);
    (*k)[at] = static_cast<char>((*k)[at] ^ (1 << (trial % 8)));
    ASSERT_NE(RequestFingerprint(c), base) << "byte " << at << " of " << k->size();
  }
  v1::StepBatchRequest c = batch;
  c.mutable_entries(0)->mutable_append()->set_token_ids(500, 7);
  EXPECT_NE(RequestFingerprint(c), base) << "the middle token id";
}

// A map's entries in another insertion order are the same request.
TEST(RequestFingerprintTest, MapOrderIsNoPartOfIt) {
  v1::CreateSequenceRequest a, b;
  (*a.mutable_policy()->mutable_params())["alpha"] = 0.5;
  (*a.mutable_policy()->mutable_params())["beta"] = 2;
  (*b.mutable_policy()->mutable_params())["beta"] = 2;
  (*b.mutable_policy()->mutable_params())["alpha"] = 0.5;
  EXPECT_EQ(RequestFingerprint(a), RequestFingerprint(b));
  (*b.mutable_policy()->mutable_params())["alpha"] = 0.25;
  EXPECT_NE(RequestFingerprint(a), RequestFingerprint(b));
}

// Two message types with the same bytes are different requests.
TEST(RequestFingerprintTest, TheMessageTypeCounts) {
  v1::ReleaseRequest release;
  v1::PublishRequest publish;
  release.set_sequence_id(3);
  publish.set_sequence_id(3);
  ASSERT_EQ(release.SerializeAsString(), publish.SerializeAsString());
  EXPECT_NE(RequestFingerprint(release), RequestFingerprint(publish));
}

}  // namespace
}  // namespace kvmem::service
