// Mapper: a worker thread that runs the cache's background work until told to stop.
#include "mapper.h"

namespace vkv {

Mapper::Mapper(std::function<bool()> work) : work_(std::move(work)), thread_([this] { run(); }) {}

Mapper::~Mapper() { stop(); }

void Mapper::wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = true;
  }
  woken_.notify_one();
}

void Mapper::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  woken_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::exception_ptr Mapper::take_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::exception_ptr error = error_;
  error_ = nullptr;
  return error;
}

void Mapper::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      woken_.wait(lock, [this] { return pending_ || stopping_; });
      if (stopping_) return;
      pending_ = false;
    }
    try {
      // Keep going while there is work, but look at stop requests between units.
      while (work_()) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

}  // namespace vkv
