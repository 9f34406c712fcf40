// A stream for the host backend's deferred mode: device work (zero-fill, copies) runs
// later, in order, on a worker thread, as on a GPU stream; events are positions in it.
//
// It exists so that CI, which has no GPU, catches the bugs a GPU punishes: changing a
// mapping while queued work still touches it. Each task checks, when it runs, that the
// pages it touches are mapped as it needs (the owner tells it through `PageStates`); if
// not, the stream records a sticky fault, as CUDA's illegal-address error, and every
// later wait or query throws DriverError. A GPU would kill the context there.
//
// Internal header. Thread-safety: all calls are thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace vkv::detail {

/// What each range of the host backend's reservations is mapped as. Addresses outside
/// every reservation (host buffers) are not tracked.
class PageStates {
 public:
  enum class State { reserved, real, zero };  // reserved: nothing mapped
  /// Marks [begin, end) as `state`.
  void set(std::uintptr_t begin, std::uintptr_t end, State state);
  /// Forgets [begin, end) (a reservation given back).
  void erase(std::uintptr_t begin, std::uintptr_t end);
  /// True when every reserved byte of [begin, end) is in state `one` or `other`.
  bool usable(std::uintptr_t begin, std::uintptr_t end, State one, State other) const;

 private:
  struct Segment {
    std::uintptr_t end;
    State state;
  };
  void split(std::uintptr_t at);
  std::map<std::uintptr_t, Segment> segments_;  // non-overlapping, keyed by start
};

class HostStream {
 public:
  using Task = std::function<void()>;
  HostStream();
  /// Runs what is queued, then stops the worker.
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  /// Queues a task; returns its position (1, 2, ...), an event for what precedes it.
  std::uint64_t enqueue(Task task);
  /// The position of everything queued so far (0 when nothing ever was).
  std::uint64_t tail();
  /// True once the task at `position` and all before it have run. @throws DriverError after a fault.
  bool done(std::uint64_t position);
  /// Blocks until done(position). @throws DriverError after a fault.
  void wait(std::uint64_t position);
  /// Called by a task that found its memory unusable: makes the stream's error sticky.
  void fault(const std::string& what);

 private:
  void run();
  void throw_if_faulted() const;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;
  std::uint64_t queued_ = 0;     // positions handed out
  std::uint64_t completed_ = 0;  // positions run
  std::string fault_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts once the members above exist
};

}  // namespace vkv::detail
