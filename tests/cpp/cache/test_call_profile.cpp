// CallProfile alone: a step's phases add up to its total, the counters follow the calls,
// and the last step's profile carries the last free, alloc and wake-up. No timing is
// asserted, only how the durations it reads compose.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "cache/call_profile.h"

namespace vkv {
namespace {

using detail::CallProfile;
using detail::Clock;

std::uint64_t phases(const StepProfile& step) {
  return step.lock_wait_ns + step.fills_ns + step.windows_ns + step.plan_ns + step.mapper_wait_ns + step.map_ns +
         step.finish_ns;
}

TEST(CallProfileTest, AStepsPhasesAddUpToItsTotal) {
  CallProfile profile;
  const Clock::time_point entered = Clock::now() - std::chrono::microseconds(50);
  profile.begin_step(entered, /*mapper_busy=*/true);
  profile.lap(&StepProfile::plan_ns);
  profile.lap(&StepProfile::fills_ns);
  profile.lap(&StepProfile::plan_ns);  // a phase met twice adds up
  profile.lap(&StepProfile::map_ns);
  profile.end_step(Clock::now());
  const StepProfile step = profile.last_step();
  EXPECT_TRUE(step.mapper_busy);
  EXPECT_GE(step.lock_wait_ns, 50'000u);
  EXPECT_EQ(phases(step), step.total_ns);
  EXPECT_EQ(profile.steps().calls, 1u);
  EXPECT_EQ(profile.steps().nanoseconds, step.total_ns);
}

TEST(CallProfileTest, EachStepStartsAFreshProfileAndTheCountersAddUp) {
  CallProfile profile;
  profile.begin_step(Clock::now(), false);
  profile.step().fills = 3;
  profile.count_step_pages(5);
  profile.end_step(Clock::now());
  EXPECT_EQ(profile.last_step().pages_mapped, 5u);
  profile.begin_step(Clock::now(), false);
  profile.count_step_pages(2);
  profile.end_step(Clock::now());
  EXPECT_EQ(profile.last_step().fills, 0u);
  EXPECT_EQ(profile.last_step().pages_mapped, 2u);
  EXPECT_EQ(profile.steps().calls, 2u);
  EXPECT_EQ(profile.steps().units, 7u);
}

TEST(CallProfileTest, AStepsEventWaitIsWhatItWaitedItself) {
  CallProfile profile;
  profile.add_event_wait(Clock::now() - std::chrono::milliseconds(2));
  const std::uint64_t before = profile.event_wait_ns();
  EXPECT_GE(before, 2'000'000u);
  profile.begin_step(Clock::now(), false);
  profile.add_event_wait(Clock::now() - std::chrono::milliseconds(1));
  profile.end_step(Clock::now());
  EXPECT_EQ(profile.last_step().event_wait_ns, profile.event_wait_ns() - before);
  EXPECT_GE(profile.last_step().event_wait_ns, 1'000'000u);
}

TEST(CallProfileTest, PreparedPagesCountAsStepPagesButNotAsACall) {
  CallProfile profile;
  profile.count_prepared(4, Clock::now());
  EXPECT_EQ(profile.steps().units, 4u);
  EXPECT_EQ(profile.steps().calls, 0u);
}

TEST(CallProfileTest, MappedAheadCountsUnitsPagesAndTime) {
  CallProfile profile;
  profile.count_mapped_ahead(16, std::chrono::microseconds(3));
  profile.count_mapped_ahead(8, std::chrono::microseconds(1));
  EXPECT_EQ(profile.mapped_ahead().calls, 2u);
  EXPECT_EQ(profile.mapped_ahead().units, 24u);
  EXPECT_EQ(profile.mapped_ahead().nanoseconds, 4'000u);
  EXPECT_EQ(profile.steps().calls, 0u);
}

TEST(CallProfileTest, TheLastStepCarriesTheLastFreeAllocAndWakeUp) {
  CallProfile profile;
  const Clock::time_point entered = Clock::now() - std::chrono::microseconds(30);
  profile.record_free(entered, entered + std::chrono::microseconds(10));
  profile.record_alloc(entered, entered + std::chrono::microseconds(20));
  bool woken = false;
  profile.time_wake([&] { woken = true; });
  EXPECT_TRUE(woken);
  StepProfile step = profile.last_step();
  EXPECT_EQ(step.free_lock_wait_ns, 10'000u);
  EXPECT_EQ(step.alloc_lock_wait_ns, 20'000u);
  EXPECT_GE(step.free_ns, 30'000u);
  EXPECT_GE(step.alloc_ns, 30'000u);
  EXPECT_EQ(step.wake_ns, 0u);  // the last step woke nobody
  profile.begin_step(Clock::now(), false);
  profile.step().woke_mapper = true;
  profile.end_step(Clock::now());
  profile.time_wake([] { std::this_thread::sleep_for(std::chrono::microseconds(100)); });
  EXPECT_GE(profile.last_step().wake_ns, 100'000u);
}

}  // namespace
}  // namespace vkv
