// The background thread that maps ahead and reclaims behind.
//
// Mechanism only: the thread calls `work` until it reports nothing left to do, then
// sleeps until wake(). What the work is (which slot, how many pages) is the cache's
// policy (KvCache::background_work). An exception thrown by `work` is kept, the thread
// goes on, and the owner rethrows it on its next API call (take_error()).
//
// Thread-safety: wake(), take_error() and stop() may be called from any thread.
// stop() (and the destructor) joins the thread; `work` must not call them.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace vkv {

class Mapper {
 public:
  /// Starts the thread. `work` returns true when it did something (it is called again at
  /// once), false when there is nothing to do (the thread sleeps until wake()).
  explicit Mapper(std::function<bool()> work);
  ~Mapper();
  Mapper(const Mapper&) = delete;
  Mapper& operator=(const Mapper&) = delete;

  /// There may be new work: run `work` again soon. Cheap; never blocks on `work`.
  void wake();
  /// Stops and joins the thread. Idempotent.
  void stop() noexcept;
  /// The first error `work` threw since the last call, or null.
  std::exception_ptr take_error();

 private:
  void run();

  std::function<bool()> work_;
  std::mutex mutex_;  // guards the three members below
  std::condition_variable woken_;
  bool pending_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace vkv
