// What the cache's calls cost: the counters CacheStats reports (step, mapped_ahead) and
// the phases of the last step() that last_step_profile() reports, with the last
// free_reqid()'s and alloc_reqid()'s times and the host's waits for device events.
//
// The cache tells it when a phase ends; it reads the clock (util/clock.h) and keeps the
// sums, so that no call converts durations by hand.
//
// Internal. Thread-safety: none but time_wake() and the wake time it keeps (an atomic:
// step() wakes the mapper after releasing the cache's mutex); the cache serializes
// every other call under its mutex.
#pragma once

#include <atomic>
#include <cstdint>

#include "util/clock.h"
#include "vkv/stats.h"

namespace vkv::detail {

class CallProfile {
 public:
  // ---- step() ---------------------------------------------------------------------
  /// step() holds the lock from now on (it was entered at `entered`): a new profile, its
  /// lock wait measured, the first phase starting now.
  void begin_step(Clock::time_point entered, bool mapper_busy);
  /// The step's profile so far, for the counts it keeps (fills, waits, pages mapped...).
  StepProfile& step() noexcept { return step_; }
  /// The phase since the last lap (or begin_step()) ends: its time goes to `phase`.
  void lap(std::uint64_t StepProfile::*phase);
  /// The step mapped `pages` pages.
  void count_step_pages(std::size_t pages) noexcept;
  /// The step ends at `end`: the finish phase, its total, the event waits made meanwhile,
  /// and the step counters.
  void end_step(Clock::time_point end) noexcept;
  /// Runs `wake` (the mapper's wake-up, after the lock is released) and keeps its time.
  template <typename Wake>
  void time_wake(Wake&& wake) {
    const Clock::time_point start = Clock::now();
    wake();
    last_wake_ns_.store(nanoseconds_since(start), std::memory_order_relaxed);
  }

  // ---- the other calls ---------------------------------------------------------------
  /// prepare_step() mapped `pages` pages, entered at `entered`: counted as step()'s.
  void count_prepared(std::size_t pages, Clock::time_point entered) noexcept;
  /// The mapper mapped `pages` pages ahead in one unit that took `elapsed`.
  void count_mapped_ahead(std::size_t pages, Clock::duration elapsed) noexcept;
  /// free_reqid() and alloc_reqid(), entered at `entered`, held the lock from `locked` on.
  void record_free(Clock::time_point entered, Clock::time_point locked) noexcept;
  void record_alloc(Clock::time_point entered, Clock::time_point locked) noexcept;
  /// The host waited for device events from `start` until now.
  void add_event_wait(Clock::time_point start) noexcept { event_wait_ns_ += nanoseconds_since(start); }
  /// Host waits for events so far, in nanoseconds.
  std::uint64_t event_wait_ns() const noexcept { return event_wait_ns_; }

  // ---- what is reported --------------------------------------------------------------
  /// The last step()'s profile, with the last free, alloc and (if it woke it) wake-up.
  StepProfile last_step() const noexcept;
  const CallStats& steps() const noexcept { return steps_; }
  const CallStats& mapped_ahead() const noexcept { return mapped_ahead_; }

 private:
  struct CallTiming {
    std::uint64_t total_ns = 0, lock_wait_ns = 0;
  };
  CallStats steps_;
  CallStats mapped_ahead_;  // the mapper's grow units (CacheStats::mapped_ahead)
  StepProfile step_;        // the last step()'s, filled as it goes
  Clock::time_point lap_start_{};
  Clock::time_point step_entered_{};
  std::uint64_t step_event_wait_before_ = 0;
  std::atomic<std::uint64_t> last_wake_ns_{0};  // its wake-up of the mapper, made after the lock
  CallTiming free_, alloc_;                     // the last free_reqid()'s and alloc_reqid()'s
  std::uint64_t event_wait_ns_ = 0;             // host waits for events so far
};

}  // namespace vkv::detail
