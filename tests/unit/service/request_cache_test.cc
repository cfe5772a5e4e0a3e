// RequestCache: a repeat that waited for the first call with its id gets that call's answer,
// even when the cache let the entry go before the repeat woke (a cache smaller than one
// response): it never runs the call a second time.
#include "server/service/request_cache.h"

#include <atomic>
#include <chrono>
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
    EXPECT_TRUE(
        cache.Run("Step", 7, request, "id", &first_response, [&] { return call(&first_response); })
            .ok());
  });
  first_running.WaitForNotification();
  std::thread repeat([&] {
    EXPECT_TRUE(
        cache
            .Run("Step", 7, request, "id", &repeat_response, [&] { return call(&repeat_response); })
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

}  // namespace
}  // namespace kvmem::service
