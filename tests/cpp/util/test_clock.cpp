// The nanoseconds that stats count, from the clock's durations.
#include <gtest/gtest.h>

#include "util/clock.h"

namespace vkv::detail {
namespace {

TEST(Clock, DurationsBecomeWholeNanoseconds) {
  EXPECT_EQ(nanoseconds(std::chrono::microseconds(3)), 3000u);
  EXPECT_EQ(nanoseconds(Clock::duration::zero()), 0u);
  const Clock::time_point from = Clock::now();
  EXPECT_EQ(nanoseconds_between(from, from + std::chrono::milliseconds(2)), 2'000'000u);
}

TEST(Clock, TheTimeSinceAPointInThePastIsNeverLessThanBeforeIt) {
  const Clock::time_point from = Clock::now();
  const std::uint64_t first = nanoseconds_since(from);
  EXPECT_GE(nanoseconds_since(from), first);
  EXPECT_GE(nanoseconds_since(from - std::chrono::seconds(1)), 1'000'000'000u);
}

}  // namespace
}  // namespace vkv::detail
