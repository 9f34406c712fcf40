// The clock vkv times its calls with, and its durations as the nanoseconds stats count.
//
// Internal. Thread-safety: pure functions of their arguments and the clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace vkv::detail {

using Clock = std::chrono::steady_clock;

/// `elapsed` in whole nanoseconds (a negative duration, which a steady clock never gives, wraps).
inline std::uint64_t nanoseconds(Clock::duration elapsed) noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count());
}
inline std::uint64_t nanoseconds_between(Clock::time_point from, Clock::time_point to) noexcept {
  return nanoseconds(to - from);
}
inline std::uint64_t nanoseconds_since(Clock::time_point from) noexcept { return nanoseconds(Clock::now() - from); }

}  // namespace vkv::detail
