// Which pages the device work in flight may still read, so that a page's mapping is
// changed only after its last reader (the driver does not wait for running kernels).
//
// With zero backing on, kernels may read beyond a slot's tokens (padded batches): the
// contract is that the work an engine enqueues after step(k) reads, in every slot that
// was allocated at step k, only pages below the horizon of step k (the pages its largest
// seq_len needs). A window is that horizon plus an event recorded behind the work at the
// next step(): once the event completes, the window is closed. A mapping below the
// horizon of an open window, of a slot allocated during it, must wait for it.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vkv/backend.h"

namespace vkv::detail {

class ReadWindows {
 public:
  explicit ReadWindows(Backend& backend) : backend_(backend) {}
  /// Destroys the events of the windows still open (the owner has synchronized).
  ~ReadWindows();
  ReadWindows(const ReadWindows&) = delete;
  ReadWindows& operator=(const ReadWindows&) = delete;

  /// Steps so far; a slot allocated now is read by the windows of later steps only.
  std::uint64_t steps() const noexcept { return steps_; }

  /// Forgets the windows whose events have completed. @throws DriverError.
  void forget_completed();
  /// An engine call on `stream` is about to change mappings: an event is recorded
  /// behind the work enqueued since the last step(), so that wait() covers it too (the
  /// work enqueued after this call still counts as that step's). Windows whose events
  /// completed are forgotten. @throws DriverError.
  void close_current(Stream stream);
  /// A step() begins on `stream`: close_current(), and a new window starts.
  void begin_step(Stream stream) {
    close_current(stream);
    ++steps_;
  }
  /// The step() that began is done: work enqueued from now on reads below `horizon_pages`.
  void end_step(std::size_t horizon_pages) noexcept { current_horizon_ = horizon_pages; }

  /// The highest page (exclusive) that work still in flight may read in a slot allocated
  /// after `allocated_at` steps; `include_current`: also the work enqueued since the last
  /// step(), which no event covers yet (what the mapper must assume).
  std::size_t horizon(std::uint64_t allocated_at, bool include_current) const noexcept;
  /// Forgets every event without waiting or destroying (teardown after a device
  /// synchronize, or a forked child, where the events are the parent's).
  void abandon() noexcept { closed_.clear(); }
  /// Blocks until the work behind every recorded event has completed, then forgets them.
  /// Work enqueued after the last close_current() is not covered: engine calls close
  /// first, and the engine enqueues nothing while they run. @throws DriverError.
  void wait();

 private:
  struct Window {
    std::uint64_t step;   // the step() whose work it is
    std::size_t horizon;  // pages its work may read
    Event end;            // recorded behind its work
  };
  Backend& backend_;
  std::vector<Window> closed_;  // oldest first; events not known complete
  std::uint64_t steps_ = 0;
  std::size_t current_horizon_ = 0;  // of the work since the last step()
};

}  // namespace vkv::detail
