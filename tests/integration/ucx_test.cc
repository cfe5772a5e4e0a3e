// Remote reads by UCX RMA (kvmemd --ucx, kvmem/ucx_pool.h): blocks read from the daemon's
// pool bit-exact over TCP and over shared memory, quantized blocks dequantized as a mapping
// reads them, a stale table or a read across an epoch change refused, and the remote key
// given only to a caller that may read the pool. Remote appends by active messages
// (kvmem/ucx_sender.h, AppendRequest.ucx_payload): bit-exact for every layout dtype, eager
// and rendezvous, whichever of the call and the message comes first; a message nobody
// announces, one of the wrong size, a call whose message never comes: refused, nothing
// applied, the reservation given back.
#include <ucp/api/ucp.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "kvmem/shared_pool.h"
#include "kvmem/ucx_pool.h"
#include "kvmem/ucx_sender.h"
#include "server/transport/parse_cost.h"
#include "tests/integration/daemon_fixture.h"

namespace kvmem {
namespace {

// UCX_TLS for both ends (the daemon's worker and the client's read it when made).
class UcxTest : public DaemonTest, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", GetParam(), 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    ucx_ = true;
    DaemonTest::SetUp();
    if (HasFatalFailure()) return;
    auto info = client_->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_FALSE(info->ucx.worker_address.empty());
    auto pool = client::UcxPool::Connect(*info);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
  }
  void TearDown() override {
    pool_.reset();
    DaemonTest::TearDown();
    unsetenv("UCX_TLS");
  }
  std::unique_ptr<client::UcxPool> pool_;
};

TEST_P(UcxTest, ReadsEveryStreamBitExact) {
  const uint64_t id = Create("window", {{"window", 50}});
  ASSERT_TRUE(AppendRange(id, 0, 120).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());
  auto table = client_->GetBlockTable(id);
  ASSERT_TRUE(table.ok()) << table.status();
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t h = 0; h < kH; ++h) {
      std::string k, v;
      const absl::Status read = pool_->ReadStream(*table, l, h, &k, &v);
      ASSERT_TRUE(read.ok()) << read;
      const auto& positions = table->streams[l * kH + h].positions;
      EXPECT_EQ(positions, testing::Range(70, 50));
      EXPECT_EQ(k, testing::Expected16(l * kH + h, positions, kD, 0));
      EXPECT_EQ(v, testing::Expected16(l * kH + h, positions, kD, 1));
    }
  }
  EXPECT_GT(pool_->bytes_read(), 2u * kL * kH * 50 * kD * 2);
}

TEST_P(UcxTest, QuantizedBlocksReadAsReadKvReturnsThem) {
  auto seq = client_->CreateSequence(TestLayout(), {"full", {}, client::Precision::kInt8, 16});
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(AppendRange(seq->id, 0, 80).ok());
  ASSERT_TRUE(client_->Step(seq->id, {}).ok());
  auto table = *client_->GetBlockTable(seq->id);
  auto streams = client_->ReadKv(seq->id);
  ASSERT_TRUE(streams.ok()) << streams.status();
  bool quantized = false;
  for (const client::StreamKv& kv : *streams) {
    for (const client::TableBlock& b : table.streams[kv.layer * kH + kv.kv_head].blocks) {
      quantized |= b.precision != client::Precision::kLayout;
    }
    std::string k, v;
    ASSERT_TRUE(pool_->ReadStream(table, kv.layer, kv.kv_head, &k, &v).ok());
    EXPECT_EQ(k, kv.k);
    EXPECT_EQ(v, kv.v);
  }
  EXPECT_TRUE(quantized);
}

TEST_P(UcxTest, ReadsEveryStreamInOneBatchAsReadKvGivesThem) {
  auto seq = client_->CreateSequence(TestLayout(),
                                     {"window", {{"window", 40}}, client::Precision::kInt4, 16});
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(AppendRange(seq->id, 0, 100).ok());
  ASSERT_TRUE(client_->Step(seq->id, {}).ok());
  auto table = *client_->GetBlockTable(seq->id);
  const uint64_t gets_before = pool_->gets();
  auto read = pool_->ReadStreams(table);
  ASSERT_TRUE(read.ok()) << read.status();
  auto expected = client_->ReadKv(seq->id);
  ASSERT_TRUE(expected.ok()) << expected.status();
  ASSERT_EQ(read->size(), expected->size());
  for (size_t s = 0; s < read->size(); ++s) {
    EXPECT_EQ((*read)[s].layer, (*expected)[s].layer);
    EXPECT_EQ((*read)[s].kv_head, (*expected)[s].kv_head);
    EXPECT_EQ((*read)[s].positions, (*expected)[s].positions);
    EXPECT_EQ((*read)[s].k, (*expected)[s].k) << "stream " << s;
    EXPECT_EQ((*read)[s].v, (*expected)[s].v) << "stream " << s;
  }
  EXPECT_GT(pool_->gets() - gets_before, kL * kH);  // the blocks' gets, and two epoch reads
  // Evicted since: refused whole.
  ASSERT_TRUE(AppendRange(seq->id, 100, 30).ok());
  ASSERT_TRUE(client_->Step(seq->id, {}).ok());
  EXPECT_EQ(pool_->ReadStreams(table).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(UcxTest, AStaleTableIsRefused) {
  const uint64_t id = Create("window", {{"window", 10}});
  ASSERT_TRUE(AppendRange(id, 0, 30).ok());
  auto table = *client_->GetBlockTable(id);
  ASSERT_TRUE(pool_->BeginRead(table).ok());
  ASSERT_TRUE(client_->Step(id, {}).ok());  // evicts: a new epoch
  EXPECT_EQ(pool_->EndRead(table).code(), absl::StatusCode::kFailedPrecondition);
  std::string k, v;
  EXPECT_EQ(pool_->ReadStream(table, 0, 0, &k, &v).code(), absl::StatusCode::kFailedPrecondition);
  auto fresh = *client_->GetBlockTable(id);
  EXPECT_TRUE(pool_->ReadStream(fresh, 1, 1, &k, &v).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxTest, ::testing::Values("tcp", "sm,self"),
                         [](const auto& info) {
                           return std::string(info.param[0] == 't' ? "Tcp" : "SharedMemory");
                         });

// Remote appends: the K/V by an active message, the rest by the call.
class UcxAppendTest : public UcxTest {
 protected:
  void SetUp() override {
    limits_.ucx_payload_timeout = absl::Seconds(2);
    UcxTest::SetUp();
    if (HasFatalFailure()) return;
    auto sender = client::UcxSender::Connect(*client_->GetInfo());
    ASSERT_TRUE(sender.ok()) << sender.status();
    sender_ = *std::move(sender);
  }
  void TearDown() override {
    sender_.reset();
    UcxTest::TearDown();
  }
  absl::StatusOr<client::AppendResult> SendRange(uint64_t id, int64_t first, uint32_t n,
                                                 uint32_t streams = kL * kH) {
    positions_ = testing::Range(first, n);
    k_ = testing::Payload16(streams, first, n, kD, 0);
    v_ = testing::Payload16(streams, first, n, kD, 1);
    return sender_->Append(*client_, id, {positions_, {}, k_, v_, {}, {}});
  }
  std::unique_ptr<client::UcxSender> sender_;
};

TEST_P(UcxAppendTest, EagerAndRendezvousAppendsLandBitExact) {
  const uint64_t id = Create("full");
  // 2 tokens: 4 KiB of K/V (eager); 100 tokens: 200 KiB (rendezvous).
  ASSERT_TRUE(SendRange(id, 0, 2).ok());
  auto appended = SendRange(id, 2, 100);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->appended_tokens, 102u);
  ExpectContentMatchesPositions(id);
  EXPECT_EQ(sender_->messages(), 2u);
  EXPECT_EQ(sender_->bytes_sent(), 2u * kL * kH * 102 * kD * 2);
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
}

TEST_P(UcxAppendTest, EveryLayoutDtypeLandsAsSent) {
  for (client::DType dtype : {client::DType::kF16, client::DType::kBF16, client::DType::kF32}) {
    client::Layout layout = TestLayout();
    layout.dtype = dtype;
    auto seq = client_->CreateSequence(layout, {"full", {}});
    ASSERT_TRUE(seq.ok()) << seq.status();
    const size_t width = dtype == client::DType::kF32 ? 4 : 2;
    const uint32_t n = 40;
    std::string k(size_t{kL} * kH * n * kD * width, '\0'), v(k.size(), '\0');
    for (size_t i = 0; i < k.size(); ++i) {
      // Finite values in every dtype: the top bits of each element stay small.
      k[i] = static_cast<char>(i % width == width - 1 ? 0x3c : (i * 7) & 0xff);
      v[i] = static_cast<char>(i % width == width - 1 ? 0x3b : (i * 13) & 0xff);
    }
    const std::vector<int64_t> positions = testing::Range(0, n);
    auto appended = sender_->Append(*client_, seq->id, {positions, {}, k, v, {}, {}});
    ASSERT_TRUE(appended.ok()) << appended.status();
    auto streams = client_->ReadKv(seq->id);
    ASSERT_TRUE(streams.ok()) << streams.status();
    const size_t per_stream = size_t{n} * kD * width;
    for (const client::StreamKv& kv : *streams) {
      const size_t s = kv.layer * kH + kv.kv_head;
      EXPECT_EQ(kv.k, k.substr(s * per_stream, per_stream));
      EXPECT_EQ(kv.v, v.substr(s * per_stream, per_stream));
    }
  }
}

TEST_P(UcxAppendTest, ARefusedAppendChangesNothingAndFreesItsReservation) {
  const uint64_t id = Create("full");
  ASSERT_TRUE(SendRange(id, 0, 10).ok());
  // Positions that do not increase: the engine refuses the landed append whole.
  auto refused = SendRange(id, 5, 40);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  // K/V of the wrong size for the positions (streams of another layout).
  auto wrong = SendRange(id, 10, 40, kL * kH / 2);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong.status())) << wrong.status();
  auto table = *client_->GetBlockTable(id);
  EXPECT_EQ(table.streams[0].positions, testing::Range(0, 10));
  ExpectContentMatchesPositions(id);
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
  // The sender goes on.
  ASSERT_TRUE(SendRange(id, 10, 40).ok());
  ExpectContentMatchesPositions(id);
}

TEST_P(UcxAppendTest, ACallWhoseMessageNeverComesTimesOutAndChangesNothing) {
  const uint64_t id = Create("full");
  ASSERT_TRUE(AppendRange(id, 0, 4).ok());
  positions_ = testing::Range(4, 4);
  k_ = testing::Payload16(kL * kH, 4, 4, kD, 0);
  v_ = k_;
  const client::UcxTransfer never{0x1234, 0x5678, k_.size() * 2};
  const absl::Time start = absl::Now();
  auto timed_out = client_->Append(id, {positions_, {}, k_, v_, {}, {}}, never);
  EXPECT_TRUE(absl::IsDeadlineExceeded(timed_out.status())) << timed_out.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(client_->GetBlockTable(id)->streams[0].positions, testing::Range(0, 4));
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
  // A zero id, an odd or an oversized size: refused.
  auto zero = client_->Append(id, {positions_, {}, k_, v_, {}, {}}, {0, 0, k_.size() * 2});
  EXPECT_TRUE(absl::IsInvalidArgument(zero.status())) << zero.status();
  EXPECT_THAT(std::string(zero.status().message()), ::testing::HasSubstr("transfer_hi/lo"));
  auto odd = client_->Append(id, {positions_, {}, k_, v_, {}, {}}, {1, 2, 3});
  EXPECT_TRUE(absl::IsInvalidArgument(odd.status())) << odd.status();
  auto huge = client_->Append(id, {positions_, {}, k_, v_, {}, {}}, {1, 2, 1ull << 40});
  EXPECT_TRUE(absl::IsInvalidArgument(huge.status())) << huge.status();
  EXPECT_THAT(std::string(huge.status().message()), ::testing::HasSubstr("ucx_payload.bytes"));
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxAppendTest, ::testing::Values("tcp", "sm,self"),
                         [](const auto& info) {
                           return std::string(info.param[0] == 't' ? "Tcp" : "SharedMemory");
                         });

// A bare UCX client of the daemon's worker: sends payload messages of any header and size.
class RawSender {
 public:
  explicit RawSender(const std::string& daemon_address) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, nullptr, &context_), UCS_OK);
    ucp_worker_params_t wp{};
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(daemon_address.data());
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  ~RawSender() {
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    Wait(ucp_ep_close_nbx(ep_, &close), absl::Seconds(1));
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  // Posts one message; Wait ends it.
  ucs_status_ptr_t Post(uint32_t magic, uint64_t hi, uint64_t lo, const std::string& data,
                        uint32_t flags) {
    header_ = {magic, 1, hi, lo};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = flags;
    return ucp_am_send_nbx(ep_, 1, &header_, sizeof header_, data.data(), data.size(), &param);
  }
  void Progress(absl::Duration d) {
    const absl::Time end = absl::Now() + d;
    while (absl::Now() < end) ucp_worker_progress(worker_);
  }
  // Progresses until `request` ends or `limit` passes; its status (UCS_INPROGRESS: not
  // ended).
  ucs_status_t Wait(ucs_status_ptr_t request, absl::Duration limit) {
    if (request == nullptr) return UCS_OK;
    if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
    const absl::Time end = absl::Now() + limit;
    ucs_status_t status;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS && absl::Now() < end) {
      ucp_worker_progress(worker_);
    }
    if (status != UCS_INPROGRESS) ucp_request_free(request);
    return status;
  }

 private:
  struct {
    uint32_t magic, version;
    uint64_t hi, lo;
  } header_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
};

// The message may come before or after its call; one that does not match is refused.
class UcxOrderTest : public UcxAppendTest {
 protected:
  void SetUp() override {
    UcxAppendTest::SetUp();
    if (HasFatalFailure()) return;
    raw_ = std::make_unique<RawSender>(client_->GetInfo()->ucx.append_worker_address);
    id_ = Create("full");
    ASSERT_TRUE(AppendRange(id_, 0, 4).ok());
    positions_ = testing::Range(4, 60);
    k_ = testing::Payload16(kL * kH, 4, 60, kD, 0);
    v_ = testing::Payload16(kL * kH, 4, 60, kD, 1);
    kv_ = k_ + v_;
  }
  void TearDown() override {
    raw_.reset();
    UcxAppendTest::TearDown();
  }
  // Announces transfer {hi, lo} of `bytes` on a thread of its own.
  std::thread Announce(uint64_t hi, uint64_t lo, uint64_t bytes,
                       absl::StatusOr<client::AppendResult>* out) {
    return std::thread([this, hi, lo, bytes, out] {
      *out = client_->Append(id_, {positions_, {}, k_, v_, {}, {}}, {hi, lo, bytes});
    });
  }
  double Metric(const std::string& sample) {
    const std::string text = server_->RenderMetrics();
    const size_t at = text.find("\n" + sample + " ");  // a sample's line, not its HELP
    return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size() + 2));
  }
  std::unique_ptr<RawSender> raw_;
  uint64_t id_ = 0;
  std::string kv_;
};

TEST_P(UcxOrderTest, TheMessageFirstThenItsCall) {
  ucs_status_ptr_t sent =
      raw_->Post(0x4B564D55, 7, 8, kv_, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY);
  ASSERT_FALSE(UCS_PTR_IS_ERR(sent));
  ASSERT_NE(sent, nullptr);
  // Held as its header only until the call comes: the data stays here.
  raw_->Progress(absl::Milliseconds(300));
  EXPECT_EQ(ucp_request_check_status(sent), UCS_INPROGRESS);
  absl::StatusOr<client::AppendResult> result;
  std::thread call = Announce(7, 8, kv_.size(), &result);
  EXPECT_EQ(raw_->Wait(sent, absl::Seconds(10)), UCS_OK);
  call.join();
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectContentMatchesPositions(id_);
  EXPECT_EQ(Metric("kvmem_ucx_transfers_total{direction=\"in\",result=\"landed\"}"), 1);
}

TEST_P(UcxOrderTest, TheCallFirstThenItsMessage) {
  absl::StatusOr<client::AppendResult> result;
  std::thread call = Announce(9, 10, kv_.size(), &result);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(
      raw_->Wait(raw_->Post(0x4B564D55, 9, 10, kv_, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY),
                 absl::Seconds(10)),
      UCS_OK);
  call.join();
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectContentMatchesPositions(id_);
  EXPECT_EQ(positions_.size(), 60u);
  EXPECT_GT(Metric("kvmem_ucx_bytes_total{direction=\"in\"}"), 0);
}

TEST_P(UcxOrderTest, AMessageOfAnotherSizeFailsItsCallAndChangesNothing) {
  absl::StatusOr<client::AppendResult> result;
  std::thread call = Announce(11, 12, kv_.size(), &result);
  const std::string shorter = kv_.substr(0, kv_.size() - 2);
  raw_->Wait(
      raw_->Post(0x4B564D55, 11, 12, shorter, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY),
      absl::Seconds(3));
  call.join();
  EXPECT_TRUE(absl::IsInvalidArgument(result.status())) << result.status();
  EXPECT_THAT(std::string(result.status().message()), ::testing::HasSubstr("ucx_payload.bytes"));
  EXPECT_EQ(client_->GetBlockTable(id_)->streams[0].positions, testing::Range(0, 4));
  EXPECT_EQ(transport::ParseBudget::Process().reserved(), 0u);
}

TEST_P(UcxOrderTest, MessagesNobodyCanTakeAreDropped) {
  // A header that is not a payload's; an eager message too large to hold unannounced.
  raw_->Wait(raw_->Post(0xdeadbeef, 1, 2, "abcd", 0), absl::Seconds(3));
  ASSERT_GT(kv_.size(), client::UcxSender::kRendezvousBytes * 2);  // past the 64 KiB held
  raw_->Wait(raw_->Post(0x4B564D55, 3, 4, kv_, UCP_AM_SEND_FLAG_EAGER), absl::Seconds(3));
  for (int i = 0;
       i < 50 && Metric("kvmem_ucx_transfers_total{direction=\"in\",result=\"dropped\"}") < 2;
       ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Metric("kvmem_ucx_transfers_total{direction=\"in\",result=\"dropped\"}"), 2);
  // A call for the eager one's id finds nothing and times out; the daemon goes on.
  absl::StatusOr<client::AppendResult> result;
  Announce(3, 4, kv_.size(), &result).join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(result.status())) << result.status();
  EXPECT_EQ(client_->GetBlockTable(id_)->streams[0].positions, testing::Range(0, 4));
  ASSERT_TRUE(sender_->Append(*client_, id_, {positions_, {}, k_, v_, {}, {}}).ok());
  ExpectContentMatchesPositions(id_);
}

TEST_P(UcxOrderTest, ARefusedCallsMessageIsDroppedAtOnce) {
  ucs_status_ptr_t sent =
      raw_->Post(0x4B564D55, 13, 14, kv_, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY);
  ASSERT_FALSE(UCS_PTR_IS_ERR(sent));
  raw_->Progress(absl::Milliseconds(100));  // held for its call
  absl::StatusOr<client::AppendResult> result;
  Announce(13, 14, kv_.size() + 2, &result).join();  // not the positions' K+V: refused
  EXPECT_TRUE(absl::IsInvalidArgument(result.status())) << result.status();
  EXPECT_THAT(std::string(result.status().message()), ::testing::HasSubstr("ucx_payload.bytes"));
  // Dropped at once, not at the end of its 10 s: the sender hears of it.
  const absl::Time start = absl::Now();
  EXPECT_NE(raw_->Wait(sent, absl::Seconds(5)), UCS_INPROGRESS);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(Metric("kvmem_ucx_transfers_total{direction=\"in\",result=\"dropped\"}"), 1);
  EXPECT_EQ(Metric("kvmem_ucx_held_messages"), 0);
  EXPECT_EQ(client_->GetBlockTable(id_)->streams[0].positions, testing::Range(0, 4));
}

TEST_P(UcxOrderTest, ASecondMessageOfAnIdIsDroppedAndHeldOnesEndWithTheDaemon) {
  ucs_status_ptr_t first =
      raw_->Post(0x4B564D55, 15, 16, kv_, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY);
  ucs_status_ptr_t second =
      raw_->Post(0x4B564D55, 15, 16, kv_, UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY);
  EXPECT_NE(raw_->Wait(second, absl::Seconds(5)), UCS_INPROGRESS);
  EXPECT_EQ(Metric("kvmem_ucx_held_messages"), 1);
  EXPECT_EQ(Metric("kvmem_ucx_transfers_total{direction=\"in\",result=\"dropped\"}"), 1);
  // The first stays held; the daemon stops with it (TearDown): no hang, no leak (ASan).
  EXPECT_EQ(ucp_request_check_status(first), UCS_INPROGRESS);
  server_.reset();
  EXPECT_NE(raw_->Wait(first, absl::Seconds(5)), UCS_INPROGRESS);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxOrderTest, ::testing::Values("tcp", "sm,self"),
                         [](const auto& info) {
                           return std::string(info.param[0] == 't' ? "Tcp" : "SharedMemory");
                         });

// The remote key reads every tenant's blocks: only an admin (or anyone, in one trust
// domain) is given it.
TEST(UcxAuthTest, OnlyACallerThatMayReadThePoolGetsTheKey) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/kvmem_ucx_tokens.", getpid());
  std::ofstream(tokens) << "alice alice-token-0123456789\nops admin-token-0123456789 admin\n"
                        << "fleet peer-token-0123456789ab peer\n";
  service::ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.engine.pool_bytes = 8ull << 20;
  config.engine.in_place_writes = true;  // an admin may map the pool writable; a peer not
  config.auth_tokens = tokens;
  config.ucx = true;
  // Refused unless the network is said to be trusted (software RMA checks no key).
  auto refused = service::Server::Start(config);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("--ucx_trusted_network"));
  config.ucx_trusted_network = true;
  auto server = service::Server::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  auto info_of = [&](const std::string& token) {
    client::ClientOptions options;
    options.auth_token = token;
    auto client = *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
    return *client->GetInfo();
  };
  const client::Info alice = info_of("alice-token-0123456789");
  EXPECT_FALSE(alice.ucx.append_worker_address.empty());  // remote appends
  EXPECT_TRUE(alice.ucx.worker_address.empty());          // reads: software RMA, unchecked
  EXPECT_TRUE(alice.ucx.pool_rkey.empty());
  EXPECT_TRUE(alice.ucx.epoch_board_rkey.empty());
  EXPECT_EQ(alice.ucx.pool_address, 0u);
  EXPECT_EQ(client::UcxPool::Connect(alice).status().code(), absl::StatusCode::kFailedPrecondition);
  {  // Alice appends by UCX to her own sequence; ops's is NOT_FOUND to her, nothing taken.
    client::ClientOptions options;
    options.auth_token = "alice-token-0123456789";
    auto alice_client =
        *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
    options.auth_token = "admin-token-0123456789";
    auto ops_client =
        *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
    const client::Layout layout{2, 2, 64, client::DType::kF16, 16, 1000};
    const uint64_t mine = alice_client->CreateSequence(layout, {"full", {}})->id;
    const uint64_t theirs = ops_client->CreateSequence(layout, {"full", {}})->id;
    auto sender = client::UcxSender::Connect(alice);
    ASSERT_TRUE(sender.ok()) << sender.status();
    const std::vector<int64_t> positions = testing::Range(0, 20);
    const std::string k = testing::Payload16(4, 0, 20, 64, 0),
                      v = testing::Payload16(4, 0, 20, 64, 1);
    auto appended = (*sender)->Append(*alice_client, mine, {positions, {}, k, v, {}, {}});
    EXPECT_TRUE(appended.ok()) << appended.status();
    auto refused = (*sender)->Append(*alice_client, theirs, {positions, {}, k, v, {}, {}});
    EXPECT_TRUE(absl::IsNotFound(refused.status())) << refused.status();
    EXPECT_TRUE(ops_client->GetBlockTable(theirs)->streams[0].positions.empty());
    // A peer (another kvmemd's --cluster-peer-token-file) is given the pool's keys, and the
    // pool read-only on this host (a move maps it), and nothing else of an admin's: no
    // writable mapping, no other tenant's sequence, its own Stats.
    const client::Info peer = info_of("peer-token-0123456789ab");
    EXPECT_FALSE(peer.ucx.worker_address.empty());
    EXPECT_FALSE(peer.ucx.pool_rkey.empty());
    EXPECT_FALSE(peer.attach.ticket.empty());
    EXPECT_FALSE(client::SharedPool::Attach(peer, /*writable=*/true).ok());
    EXPECT_TRUE(client::SharedPool::Attach(info_of("admin-token-0123456789"), true).ok());
    EXPECT_TRUE(client::SharedPool::Attach(info_of("peer-token-0123456789ab")).ok());
    EXPECT_TRUE(client::UcxPool::Connect(peer).ok());  // the epoch board's shape comes too
    options.auth_token = "peer-token-0123456789ab";
    auto peer_client =
        *client::Client::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), options);
    EXPECT_TRUE(absl::IsNotFound(peer_client->GetBlockTable(mine).status()));
    EXPECT_TRUE(absl::IsNotFound(peer_client->Release(theirs).status()));
    auto stats = peer_client->GetStats(true);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_TRUE(stats->sequences.empty());
  }
  const client::Info ops = info_of("admin-token-0123456789");
  EXPECT_FALSE(ops.ucx.worker_address.empty());
  EXPECT_FALSE(ops.ucx.pool_rkey.empty());
  std::remove(tokens.c_str());
}

}  // namespace
}  // namespace kvmem
