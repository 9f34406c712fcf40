// HostStream: a FIFO of tasks on a worker thread, with positions as events and a
// sticky fault; PageStates: an interval map of what is mapped where.
#include "host_stream.h"

#include "vkv/error.h"

namespace vkv::detail {

void PageStates::split(std::uintptr_t at) {
  auto next = segments_.upper_bound(at);
  if (next == segments_.begin()) return;
  auto segment = std::prev(next);
  if (segment->first < at && segment->second.end > at) {
    segments_[at] = {segment->second.end, segment->second.state};
    segment->second.end = at;
  }
}

void PageStates::erase(std::uintptr_t begin, std::uintptr_t end) {
  if (begin >= end) return;
  split(begin);
  split(end);
  segments_.erase(segments_.lower_bound(begin), segments_.lower_bound(end));
}

void PageStates::set(std::uintptr_t begin, std::uintptr_t end, State state) {
  if (begin >= end) return;
  erase(begin, end);
  segments_[begin] = {end, state};
}

bool PageStates::usable(std::uintptr_t begin, std::uintptr_t end, State one, State other) const {
  auto segment = segments_.upper_bound(begin);
  if (segment != segments_.begin() && std::prev(segment)->second.end > begin) --segment;
  for (; segment != segments_.end() && segment->first < end; ++segment)
    if (segment->second.state != one && segment->second.state != other) return false;
  return true;
}

HostStream::HostStream() : worker_([this] { run(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

std::uint64_t HostStream::enqueue(Task task) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(task));
  const std::uint64_t position = ++queued_;
  changed_.notify_all();
  return position;
}

std::uint64_t HostStream::tail() {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_;
}

bool HostStream::done(std::uint64_t position) {
  std::lock_guard<std::mutex> lock(mutex_);
  throw_if_faulted();
  return completed_ >= position;
}

void HostStream::wait(std::uint64_t position) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return completed_ >= position || !fault_.empty(); });
  throw_if_faulted();
}

void HostStream::fault(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fault_.empty()) fault_ = what;
  changed_.notify_all();
}

void HostStream::throw_if_faulted() const {
  if (!fault_.empty()) throw DriverError("host stream (deferred)", 700, "illegal address: " + fault_);
}

void HostStream::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return !queue_.empty() || stopping_; });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    Task task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    ++completed_;
    changed_.notify_all();
  }
}

}  // namespace vkv::detail
