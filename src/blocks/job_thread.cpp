// JobThread: one job at a time on a thread of its own.
#include "job_thread.h"

#include <utility>

#include "util/internal_assert.h"

namespace vkv::detail {

JobThread::JobThread(std::function<void()> run, std::function<Idle()> idle, std::chrono::milliseconds idle_after)
    : run_(std::move(run)), idle_(std::move(idle)), idle_after_(idle_after), thread_([this] { loop(); }) {}

JobThread::~JobThread() { stop(); }

void JobThread::hand() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    VKV_ASSERT(!busy_ && !stopping_);
    busy_ = true;
  }
  changed_.notify_all();
}

void JobThread::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return !busy_; });
}

bool JobThread::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !busy_;
}

void JobThread::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) return;
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void JobThread::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  Idle idle = Idle::done;  // what the owner's idle work has left
  const auto woken = [this] { return busy_ || stopping_; };
  for (;;) {
    if (idle == Idle::done) {
      changed_.wait(lock, woken);
    } else if (idle == Idle::more_later) {
      changed_.wait_for(lock, idle_after_, woken);
    }
    if (busy_) {
      lock.unlock();
      run_();
      lock.lock();
      busy_ = false;
      changed_.notify_all();
      idle = idle_ ? Idle::more_later : Idle::done;
      continue;
    }
    if (stopping_) return;  // the job in flight is done
    if (idle == Idle::done) continue;
    lock.unlock();
    idle = idle_();
    lock.lock();
  }
}

}  // namespace vkv::detail
