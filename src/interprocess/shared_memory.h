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

/// Checks a name a user chose for a shared-memory object (the part after the object's
/// fixed prefix): 1 to `max_length` of [A-Za-z0-9._-], neither '.' nor '..', not starting
/// with '-' (a shell would read it as an option). `what` names it in messages ("shared
/// budget name"). @throws InvalidArgument naming the name and the rule it breaks.
void expect_valid_object_name(const std::string& name, std::size_t max_length, const std::string& what);

/// A named POSIX shared-memory object (/dev/shm/<name>), mapped read-write.
class SharedMapping {
 public:
  /// Creates the object exclusively: `bytes` long, zero-filled, permission bits `mode`
  /// (exactly, whatever the umask). `what` names it in messages ("shared budget 'x'").
  /// @throws InvalidArgument when it exists already or `mode` is denied; Error otherwise.
  static SharedMapping create(const std::string& name, std::size_t bytes, unsigned mode, const std::string& what);
  /// Maps an existing object, its whole length; at least `min_bytes` long (checked with
  /// fstat before mapping: touching a mapping past the object's end raises SIGBUS).
  /// Only an object this user or root owns is trusted, or one another user shares with a
  /// group this process is in and with no one else (mode ---rw----, no bits for others):
  /// whoever can write the object can truncate it under every member (SIGBUS) or hold
  /// its lock, so the object must be no more writable than its creator chose. A trusted
  /// user who truncates it after it is mapped still raises SIGBUS in every member that
  /// touches it: MAP_POPULATE or mlock cannot prevent that (truncation takes the pages out
  /// of every mapping), and shm_open objects cannot be sealed like a memfd.
  /// @throws InvalidArgument when there is none, permission is denied, its owner or mode is
  ///         not trusted (naming owner, mode and this process's uid) or it is too short to
  ///         be what the caller expects; Error otherwise.
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
  /// The object's permission bits when it was created or opened.
  unsigned mode() const noexcept { return mode_; }

 private:
  SharedMapping(void* data, std::size_t size, unsigned mode) noexcept : data_(data), size_(size), mode_(mode) {}
  void* data_ = nullptr;
  std::size_t size_ = 0;
  unsigned mode_ = 0;
};

/// How long a RobustMutex::lock() waits for a holder before it throws: the environment's
/// VKV_SHARED_LOCK_TIMEOUT (seconds, > 0), else 10 s. A process stopped while it holds
/// a lock (SIGSTOP, a debugger) then costs the others an error, not a hang.
std::chrono::nanoseconds shared_lock_timeout();

/// A pthread mutex that lives in shared memory: process-shared and robust, and it records
/// the pid of the process that holds it (for the message of a lock that timed out).
class RobustMutex {
 public:
  /// Once, by the process that creates the memory, before any other maps it.
  void init();
  /// Locks, waiting at most `timeout`. Returns true when the previous owner died holding
  /// it: the mutex is consistent again, and the caller repairs what that owner may have
  /// left half-done. @throws Error naming `what` and the holder's pid on a timeout.
  bool lock(std::chrono::nanoseconds timeout = shared_lock_timeout(), const std::string& what = "a shared lock");
  void unlock() noexcept;
  /// The pid of the process that holds it; 0 when none (a hint: it may change at once).
  std::int32_t holder() const noexcept { return holder_.load(std::memory_order_relaxed); }

 private:
  pthread_mutex_t mutex_;
  std::atomic<std::int32_t> holder_;
};

/// Scoped RobustMutex::lock().
class RobustLock {
 public:
  explicit RobustLock(RobustMutex& mutex, const std::string& what = "a shared lock")
      : mutex_(mutex), owner_died_(mutex.lock(shared_lock_timeout(), what)) {}
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
  /// Alive and able to run: not stopped by a signal (SIGSTOP, a shell's ^Z) or a debugger.
  /// Never throws (false when it cannot tell).
  bool running() const noexcept;
  /// The process's command name (/proc/<pid>/comm), "" when gone.
  std::string command() const;
};

}  // namespace vkv::detail
