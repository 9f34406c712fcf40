// JobThread: the block-backing layer's own thread, which runs one job at a time off the
// engine's thread (no Python, no GIL: the engine's thread only hands the job over).
//
// Mechanism only: what a job is, its errors and its number are the owner's; `run` must
// not throw (it keeps what it caught for the owner's next call).
//
// Thread-safety: hand(), wait(), idle() and stop() may be called from any thread; one job
// at a time (hand() while busy is a bug).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace vkv::detail {

class JobThread {
 public:
  /// Starts the thread; `run` runs each job handed over.
  explicit JobThread(std::function<void()> run);
  /// stop().
  ~JobThread();
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  /// Runs the job the owner prepared, on the thread. Precondition: idle().
  void hand();
  /// Blocks until the job handed over is done.
  void wait();
  bool idle() const;
  /// Lets the job in flight finish, then stops and joins the thread. Idempotent.
  void stop() noexcept;

 private:
  void loop();

  std::function<void()> run_;
  mutable std::mutex mutex_;  // guards the two flags below
  std::condition_variable changed_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace vkv::detail
