// The fork generation: a pthread_atfork child handler registered once, before any cache.
#include "fork_guard.h"

#include <pthread.h>

#include <atomic>

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

}  // namespace vkv::detail
