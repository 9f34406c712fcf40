// JobThread: the block-backing layer's own thread, which runs one job at a time off the
// engine's thread (no Python, no GIL: the engine's thread only hands the job over).
//
// Mechanism only: what a job is, its errors and its number are the owner's; `run` must
// not throw (it keeps what it caught for the owner's next call). Between jobs, once none
// came for `idle_after`, the thread runs the owner's `idle` work in short bites until it
// says it is done; a job handed meanwhile runs after the bite in flight, and wait() never
// waits for idle work.
//
// Thread-safety: hand(), wait(), idle() and stop() may be called from any thread; one job
// at a time (hand() while busy is a bug).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace vkv::detail {

class JobThread {
 public:
  /// What an idle bite left: nothing, more to do at once, or more once a while has passed.
  enum class Idle { done, more_now, more_later };

  /// Starts the thread; `run` runs each job handed over; `idle` (may be empty) after each
  /// job, once no other came for `idle_after`.
  JobThread(std::function<void()> run, std::function<Idle()> idle, std::chrono::milliseconds idle_after);
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
  std::function<Idle()> idle_;
  std::chrono::milliseconds idle_after_;
  mutable std::mutex mutex_;  // guards the two flags below
  std::condition_variable changed_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace vkv::detail
