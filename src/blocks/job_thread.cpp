// JobThread: one job at a time on a thread of its own.
#include "job_thread.h"

#include <utility>

#include "util/internal_assert.h"

namespace vkv::detail {

JobThread::JobThread(std::function<void()> run) : run_(std::move(run)), thread_([this] { loop(); }) {}

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
  for (;;) {
    changed_.wait(lock, [this] { return busy_ || stopping_; });
    if (busy_) {
      lock.unlock();
      run_();
      lock.lock();
      busy_ = false;
      changed_.notify_all();
      continue;
    }
    return;  // stopping, and the job in flight is done
  }
}

}  // namespace vkv::detail
