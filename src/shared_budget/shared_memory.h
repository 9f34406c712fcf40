// What processes on one machine need to share state without a daemon: a named POSIX
// shared-memory object, a robust process-shared mutex inside it, futex waits on words
// inside it, and a process identity that tells a live process from a dead one (or from
// a new process that got its pid).
//
// A process may die anywhere, SIGKILL included: the robust mutex then hands its next
// locker the lock with `owner_died` set, and ProcessIdentity::alive() lets the others
// count the dead process's share back. Nothing here starts a thread or a server.
//
// Internal. Thread-safety: SharedMapping is an owning handle (not thread-safe itself;
// the memory it maps is whatever its users make it); the rest is thread- and
// process-safe.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace vkv::detail {

/// A named POSIX shared-memory object (/dev/shm/<name>), mapped read-write.
class SharedMapping {
 public:
  /// Creates the object exclusively: `bytes` long, zero-filled, permission bits `mode`
  /// (exactly, whatever the umask). `what` names it in messages ("shared budget 'x'").
  /// @throws InvalidArgument when it exists already or `mode` is denied; Error otherwise.
  static SharedMapping create(const std::string& name, std::size_t bytes, unsigned mode, const std::string& what);
  /// Maps an existing object, its whole length; at least `min_bytes` long.
  /// @throws InvalidArgument when there is none, permission is denied (naming its owner and
  ///         mode) or it is too short to be what the caller expects; Error otherwise.
  static SharedMapping open(const std::string& name, std::size_t min_bytes, const std::string& what);
  /// Removes the name; processes that have the object mapped keep it until they unmap.
  /// Returns false when there was none. @throws InvalidArgument when permission is denied.
  static bool unlink(const std::string& name, const std::string& what);

  SharedMapping() = default;
  SharedMapping(SharedMapping&& other) noexcept;
  SharedMapping& operator=(SharedMapping&& other) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping();

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  SharedMapping(void* data, std::size_t size) noexcept : data_(data), size_(size) {}
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A pthread mutex that lives in shared memory: process-shared and robust.
class RobustMutex {
 public:
  /// Once, by the process that creates the memory, before any other maps it.
  void init();
  /// Locks. Returns true when the previous owner died holding it: the mutex is consistent
  /// again, and the caller repairs what that owner may have left half-done.
  bool lock();
  void unlock() noexcept;

 private:
  pthread_mutex_t mutex_;
};

/// Scoped RobustMutex::lock().
class RobustLock {
 public:
  explicit RobustLock(RobustMutex& mutex) : mutex_(mutex), owner_died_(mutex.lock()) {}
  ~RobustLock() { mutex_.unlock(); }
  RobustLock(const RobustLock&) = delete;
  RobustLock& operator=(const RobustLock&) = delete;
  bool owner_died() const noexcept { return owner_died_; }

 private:
  RobustMutex& mutex_;
  bool owner_died_;
};

/// Blocks while `word` holds `expected`, at most `timeout`; may return early (spuriously).
/// `word` may be in memory shared between processes.
void futex_wait(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                std::chrono::nanoseconds timeout) noexcept;
/// Wakes every thread of every process waiting on `word`.
void futex_wake_all(const std::atomic<std::uint32_t>& word) noexcept;

/// A process, told apart from a later one that reuses its pid by its start time.
struct ProcessIdentity {
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;  ///< clock ticks after boot (/proc/<pid>/stat, field 22)

  /// The calling process.
  static ProcessIdentity self();
  /// False once the process has exited (a zombie has: its memory is gone) or its pid
  /// now names another process. Never throws.
  bool alive() const noexcept;
  /// The process's command name (/proc/<pid>/comm), "" when gone.
  std::string command() const;
};

}  // namespace vkv::detail
