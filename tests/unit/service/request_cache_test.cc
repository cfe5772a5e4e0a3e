// RequestCache: a repeat that waited for the first call with its id gets that call's answer,
// even when the cache let the entry go before the repeat woke (a cache smaller than one
// response): it never runs the call a second time. An id reused for a request that differs
// in one byte of its K/V is refused, not answered with the first call's response.
#include "server/service/request_cache.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kvmem/v1/kvmem.pb.h"

namespace kvmem::service {
namespace {

TEST(RequestCacheTest, AWaitingRepeatGetsTheFirstAnswerEvenIfTheCacheLetItGo) {
  engine::FakeClock clock;
  RequestCache cache(/*max_entries=*/16, /*max_bytes=*/1, absl::Minutes(1), &clock);
  v1::StepRequest request;
  request.set_sequence_id(7);
  std::atomic<int> runs{0};
  absl::Notification first_running, release_first;
  auto call = [&](v1::StepResponse* response) {
    if (++runs > 1) return absl::InternalError("ran twice");
    first_running.Notify();
    release_first.WaitForNotification();
    response->set_step(runs.load());
    return absl::OkStatus();
  };
  v1::StepResponse first_response, repeat_response;
  std::thread first([&] {
    EXPECT_TRUE(cache
                    .Run("Step", "", 7, request, "id", &first_response,
                         [&] { return call(&first_response); })
                    .ok());
  });
  first_running.WaitForNotification();
  std::thread repeat([&] {
    EXPECT_TRUE(cache
                    .Run("Step", "", 7, request, "id", &repeat_response,
                         [&] { return call(&repeat_response); })
                    .ok());
  });
  while (cache.waiting() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  release_first.Notify();
  first.join();
  repeat.join();
  EXPECT_EQ(runs.load(), 1) << "the repeat ran the call again";
  EXPECT_EQ(repeat_response.step(), first_response.step());
  EXPECT_EQ(cache.size(), 0u);  // one byte of room: the answer was not kept
}

TEST(RequestCacheTest, AnIdReusedWithOneOtherByteInTheMiddleOfKvIsRefused) {
  engine::FakeClock clock;
  RequestCache cache(/*max_entries=*/16, /*max_bytes=*/1 << 20, absl::Minutes(1), &clock);
  v1::AppendRequest request;
  request.set_sequence_id(7);
  request.add_positions(0);
  request.set_k(std::string(64 << 10, '\x11'));
  request.set_v(request.k());
  int runs = 0;
  auto run = [&](const v1::AppendRequest& r, v1::AppendResponse* response) {
    return cache.Run("Append", "", 7, r, "id", response, [&] {
      response->set_appended_tokens(++runs);
      return absl::OkStatus();
    });
  };
  v1::AppendResponse first, repeat, other;
  ASSERT_TRUE(run(request, &first).ok());
  ASSERT_TRUE(run(request, &repeat).ok());
  EXPECT_EQ(repeat.appended_tokens(), first.appended_tokens())
      << "the same request again is a retry";
  v1::AppendRequest changed = request;
  (*changed.mutable_k())[32 << 10] = '\x12';
  const absl::Status status = run(changed, &other);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(runs, 1) << "neither the retry nor the changed request ran the call again";
  EXPECT_EQ(other.appended_tokens(), 0u) << "no replay of the first call's response";
}

TEST(RequestCacheTest, AnIdIsItsTenantsOwn) {
  // Before, the key was (method, sequence, id): another tenant sending the same id got the
  // first tenant's answer.
  engine::FakeClock clock;
  RequestCache cache(/*max_entries=*/16, /*max_bytes=*/1 << 20, absl::Minutes(1), &clock);
  v1::AppendRequest request;
  request.set_sequence_id(7);
  int runs = 0;
  auto run = [&](absl::string_view tenant, v1::AppendResponse* response) {
    return cache.Run("Append", tenant, 7, request, "id", response, [&] {
      response->set_appended_tokens(++runs);
      return absl::OkStatus();
    });
  };
  v1::AppendResponse alice, bob, alice_again;
  ASSERT_TRUE(run("alice", &alice).ok());
  ASSERT_TRUE(run("bob", &bob).ok());
  ASSERT_TRUE(run("alice", &alice_again).ok());
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(bob.appended_tokens(), 2u) << "bob's call ran: it is not alice's retry";
  EXPECT_EQ(alice_again.appended_tokens(), 1u) << "alice's retry got her answer";
}

}  // namespace
}  // namespace kvmem::service
