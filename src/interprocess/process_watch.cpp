// ProcessWatch: pidfds, polled together; /proc where a process has none.
#include "process_watch.h"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>

namespace vkv::detail {
namespace {

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture Linux has
#endif

// The process's pidfd, -1 where there is none to have.
int open_pidfd(const ProcessIdentity& process) noexcept {
  if (process.pid <= 0) return -1;
  const long fd = syscall(SYS_pidfd_open, process.pid, 0);
  if (fd < 0) return -1;
  // Opened first, checked second: if the pid still names the process that started then,
  // the pidfd is that process's, whatever reuses the pid later.
  if (!process.alive()) {
    close(static_cast<int>(fd));
    return -1;
  }
  return static_cast<int>(fd);
}

}  // namespace

ProcessWatch::ProcessWatch(const std::vector<ProcessIdentity>& processes) {
  for (const ProcessIdentity& process : processes) {
    const int fd = open_pidfd(process);
    if (fd >= 0) {
      pidfds_.push_back(fd);
    } else {
      unwatched_.push_back(process);
    }
  }
}

ProcessWatch::~ProcessWatch() {
  for (int fd : pidfds_) close(fd);
}

bool ProcessWatch::all_alive() const noexcept {
  for (const ProcessIdentity& process : unwatched_)
    if (!process.alive()) return false;
  constexpr std::size_t kBatch = 64;  // poll() writes revents: a copy on the stack per batch
  std::array<pollfd, kBatch> batch;
  for (std::size_t first = 0; first < pidfds_.size(); first += kBatch) {
    const std::size_t count = std::min(kBatch, pidfds_.size() - first);
    for (std::size_t i = 0; i < count; ++i) batch[i] = pollfd{pidfds_[first + i], POLLIN, 0};
    int ready = -1;
    do {
      ready = poll(batch.data(), count, 0);
    } while (ready < 0 && errno == EINTR);
    if (ready != 0) return false;  // one exited (or poll() failed: false sends the caller the long way)
  }
  return true;
}

}  // namespace vkv::detail
