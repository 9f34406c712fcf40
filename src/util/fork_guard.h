// Telling whether this process is a child made by fork() since some point.
//
// A fork() copies the address space but not the threads: a child that used a cache
// would wait forever for a mutex its parent's mapper held, or for a thread that does not
// exist, and (host backend) its writes would land in the parent's shared pages. So every
// public call of a cache compares the generation it was built in with the current one
// and refuses in a child, and a child's destructor leaves everything to the parent.
//
// Internal. Thread-safety: thread-safe (an atomic counter bumped in the child at fork).
#pragma once

#include <cstdint>

namespace vkv::detail {

/// Bumped in every child process right after fork(); 0 in the process that started.
std::uint64_t fork_generation() noexcept;

/// A cache's first check on every public call: @throws Error (the cache is unusable in
/// a forked child) when fork_generation() is no longer `built_in`, the generation it was
/// built in.
void expect_same_process(std::uint64_t built_in);

}  // namespace vkv::detail
