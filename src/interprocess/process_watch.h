// Whether other processes still run, cheaply enough to ask at every engine step: one pidfd
// per process (Linux 5.3+), opened once, and one poll() of them all -- a syscall, where
// reading each one's /proc/<pid>/stat costs tens of microseconds. A process whose pidfd
// cannot be had (an older kernel, a seccomp filter, a pid another namespace gave) is asked
// through ProcessIdentity::alive() as before.
//
// Internal. Thread-safety: all_alive() may be called from any thread, concurrently.
#pragma once

#include <vector>

#include "interprocess/shared_memory.h"

namespace vkv::detail {

class ProcessWatch {
 public:
  /// Watches `processes` from now on. Never throws but for memory.
  explicit ProcessWatch(const std::vector<ProcessIdentity>& processes);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  /// False once any of them has exited (a zombie has) or, asked through /proc, its pid
  /// names another process; false too where poll() fails. Never throws.
  bool all_alive() const noexcept;

 private:
  std::vector<int> pidfds_;                 // readable once their process exits
  std::vector<ProcessIdentity> unwatched_;  // no pidfd: /proc each time
};

}  // namespace vkv::detail
