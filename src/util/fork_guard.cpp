// The fork generation: a pthread_atfork child handler registered once, before any cache.
#include "fork_guard.h"

#include <pthread.h>

#include <atomic>

#include "vkv/error.h"

namespace vkv::detail {
namespace {

std::atomic<std::uint64_t> generation{0};

void bump_in_child() { generation.fetch_add(1, std::memory_order_relaxed); }

const bool registered = [] { return pthread_atfork(nullptr, nullptr, &bump_in_child) == 0; }();

}  // namespace

std::uint64_t fork_generation() noexcept {
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

void expect_same_process(std::uint64_t built_in) {
  if (fork_generation() == built_in) return;
  throw Error(
      "this vkv cache was created before fork() and cannot be used in the child process: its mapper thread, "
      "device context and pages belong to the parent. Create a new cache in the child, or start workers with "
      "the 'spawn' method");
}

}  // namespace vkv::detail
