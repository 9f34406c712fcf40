// CallProfile: the phases of the last step() and the counters of the cache's calls.
#include "call_profile.h"

namespace vkv::detail {

void CallProfile::begin_step(Clock::time_point entered, bool mapper_busy) {
  lap_start_ = Clock::now();
  step_entered_ = entered;
  step_ = {};
  step_.lock_wait_ns = nanoseconds_between(entered, lap_start_);
  step_.mapper_busy = mapper_busy;
  step_event_wait_before_ = event_wait_ns_;
}

void CallProfile::lap(std::uint64_t StepProfile::*phase) {
  const Clock::time_point now = Clock::now();
  step_.*phase += nanoseconds_between(lap_start_, now);
  lap_start_ = now;
}

void CallProfile::count_step_pages(std::size_t pages) noexcept {
  steps_.units += pages;
  step_.pages_mapped += static_cast<std::uint32_t>(pages);
}

void CallProfile::end_step(Clock::time_point end) noexcept {
  step_.finish_ns = nanoseconds_between(lap_start_, end);
  step_.total_ns = nanoseconds_between(step_entered_, end);
  step_.event_wait_ns = event_wait_ns_ - step_event_wait_before_;
  steps_.calls += 1;
  steps_.nanoseconds += step_.total_ns;
}

void CallProfile::count_prepared(std::size_t pages, Clock::time_point entered) noexcept {
  steps_.units += pages;
  steps_.nanoseconds += nanoseconds_since(entered);
}

void CallProfile::count_mapped_ahead(std::size_t pages, Clock::duration elapsed) noexcept {
  mapped_ahead_.calls += 1;
  mapped_ahead_.units += pages;
  mapped_ahead_.nanoseconds += nanoseconds(elapsed);
}

void CallProfile::record_free(Clock::time_point entered, Clock::time_point locked) noexcept {
  free_ = {nanoseconds_since(entered), nanoseconds_between(entered, locked)};
}

void CallProfile::record_alloc(Clock::time_point entered, Clock::time_point locked) noexcept {
  alloc_ = {nanoseconds_since(entered), nanoseconds_between(entered, locked)};
}

StepProfile CallProfile::last_step() const noexcept {
  StepProfile profile = step_;
  profile.free_ns = free_.total_ns;
  profile.free_lock_wait_ns = free_.lock_wait_ns;
  profile.alloc_ns = alloc_.total_ns;
  profile.alloc_lock_wait_ns = alloc_.lock_wait_ns;
  profile.wake_ns = profile.woke_mapper ? last_wake_ns_.load(std::memory_order_relaxed) : 0;
  return profile;
}

}  // namespace vkv::detail
