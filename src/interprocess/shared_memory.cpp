// Shared memory, a robust mutex, futexes and process liveness on Linux.
#include "shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <vector>

#include "vkv/error.h"

#if defined(__SANITIZE_THREAD__)  // GCC
#define VKV_THREAD_SANITIZER 1
#elif defined(__has_feature)  // Clang
#if __has_feature(thread_sanitizer)
#define VKV_THREAD_SANITIZER 1
#endif
#endif
#ifndef VKV_THREAD_SANITIZER
#define VKV_THREAD_SANITIZER 0
#endif

namespace vkv::detail {
namespace {

std::string errno_text(int error) { return std::strerror(error); }

// "owner uid 1000, mode 0600" for a permission error's message; "" when it cannot be read.
std::string owner_and_mode(const std::string& name) {
  struct stat status {};
  if (stat(("/dev/shm/" + name).c_str(), &status) != 0) return "";
  std::ostringstream text;
  text << " (owner uid " << status.st_uid << ", mode 0" << std::oct << (status.st_mode & 0777) << std::dec
       << "; this process runs as uid " << geteuid() << ")";
  return text.str();
}

std::string octal(unsigned mode) {
  std::ostringstream text;
  text << '0' << std::oct << mode;
  return text.str();
}

// The process's groups, its effective one included.
bool in_group(gid_t group) {
  if (group == getegid()) return true;
  const int count = getgroups(0, nullptr);
  if (count <= 0) return false;
  std::vector<gid_t> groups(static_cast<std::size_t>(count));
  const int got = getgroups(count, groups.data());
  return got > 0 && std::find(groups.begin(), groups.begin() + got, group) != groups.begin() + got;
}

// Refuses an object that someone outside its creator's chosen sharing could write: one of
// another user (root's aside), unless that user shares it with a group of ours and nobody else.
void expect_trusted(const struct stat& status, const std::string& what) {
  const uid_t self = geteuid();
  if (status.st_uid == self || status.st_uid == 0) return;
  const unsigned mode = status.st_mode & 0777;
  const bool group_shared = (mode & 0007) == 0 && in_group(status.st_gid);
  VKV_EXPECTS(group_shared, what, " is owned by uid ", status.st_uid, " (mode ", octal(mode), ", group ", status.st_gid,
              "), not by this user (uid ", self,
              ") or root, nor shared only with a group of this "
              "user: refusing to join it (its owner could truncate or lock it under every member); its owner or "
              "root must remove it");
}

void* map_shared(int file, std::size_t bytes, const std::string& what) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file, 0);
  if (data == MAP_FAILED) throw Error(concat(what, ": mmap of ", bytes, " bytes failed: ", errno_text(errno)));
  return data;
}

}  // namespace

void expect_valid_object_name(const std::string& name, std::size_t max_length, const std::string& what) {
  VKV_EXPECTS(!name.empty() && name.size() <= max_length, what, " '", name, "' must have 1 to ", max_length,
              " characters (it has ", name.size(), ")");
  const auto allowed = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  };
  VKV_EXPECTS(std::all_of(name.begin(), name.end(), allowed), what, " '", name,
              "' may hold only letters, digits, '.', '_' and '-'");
  VKV_EXPECTS(name != "." && name != ".." && name.front() != '-', what, " '", name,
              "' is refused: it must not be '.' or '..' nor start with '-' (a shell would read it as an option)");
}

SharedMapping SharedMapping::create(const std::string& name, std::size_t bytes, unsigned mode,
                                    const std::string& what) {
  const std::string path = "/" + name;
  const int file = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, mode & 0777);
  if (file < 0) {
    const int error = errno;
    VKV_EXPECTS(error != EEXIST, what, " exists already: open it, or remove it first");
    VKV_EXPECTS(error != EACCES, what, " cannot be created: permission denied", owner_and_mode(name));
    throw Error(concat(what, ": shm_open(", path, ") failed: ", errno_text(error)));
  }
  // The umask may have cleared bits of `mode`: set them exactly.
  if (fchmod(file, mode & 0777) != 0 || ftruncate(file, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    close(file);
    shm_unlink(path.c_str());
    throw Error(concat(what, ": sizing ", path, " to ", bytes, " bytes failed: ", errno_text(error)));
  }
  void* data = nullptr;
  try {
    data = map_shared(file, bytes, what);
  } catch (...) {
    close(file);
    shm_unlink(path.c_str());
    throw;
  }
  close(file);
  return SharedMapping(data, bytes, mode & 0777);
}

SharedMapping SharedMapping::open(const std::string& name, std::size_t min_bytes, const std::string& what) {
  const std::string path = "/" + name;
  const int file = shm_open(path.c_str(), O_RDWR, 0);
  if (file < 0) {
    const int error = errno;
    VKV_EXPECTS(error != ENOENT, what, " does not exist (no /dev/shm", path, "): create it first");
    VKV_EXPECTS(error != EACCES, what, " cannot be opened: permission denied", owner_and_mode(name));
    throw Error(concat(what, ": shm_open(", path, ") failed: ", errno_text(error)));
  }
  struct stat status {};
  if (fstat(file, &status) != 0) {
    const int error = errno;
    close(file);
    throw Error(concat(what, ": fstat failed: ", errno_text(error)));
  }
  try {
    expect_trusted(status, what);
  } catch (...) {
    close(file);
    throw;
  }
  const auto bytes = static_cast<std::size_t>(status.st_size);
  if (bytes < min_bytes) {
    close(file);
    throw InvalidArgument(concat(what, " is ", bytes, " bytes, less than the ", min_bytes,
                                 " this version of vkv expects: it is not a vkv object, or another version's"));
  }
  void* data = nullptr;
  try {
    data = map_shared(file, bytes, what);
  } catch (...) {
    close(file);
    throw;
  }
  close(file);
  return SharedMapping(data, bytes, status.st_mode & 0777);
}

bool SharedMapping::unlink(const std::string& name, const std::string& what) {
  if (shm_unlink(("/" + name).c_str()) == 0) return true;
  const int error = errno;
  if (error == ENOENT) return false;
  VKV_EXPECTS(error != EACCES, what, " cannot be removed: permission denied", owner_and_mode(name));
  throw Error(concat(what, ": shm_unlink failed: ", errno_text(error)));
}

SharedMapping::SharedMapping(SharedMapping&& other) noexcept
    : data_(other.data_), size_(other.size_), mode_(other.mode_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

SharedMapping& SharedMapping::operator=(SharedMapping&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = other.data_;
    size_ = other.size_;
    mode_ = other.mode_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

SharedMapping::~SharedMapping() {
  if (data_ != nullptr) munmap(data_, size_);
}

void RobustMutex::init() {
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  const int result = pthread_mutex_init(&mutex_, &attributes);
  pthread_mutexattr_destroy(&attributes);
  if (result != 0) throw Error(concat("pthread_mutex_init (robust, process-shared) failed: ", errno_text(result)));
}

std::chrono::nanoseconds shared_lock_timeout() {
  // Read at each lock (a getenv: far less than the lock's own cost when contended), so
  // that a process can change it while it runs.
  const char* text = std::getenv("VKV_SHARED_LOCK_TIMEOUT");
  char* end = nullptr;
  const double seconds = text != nullptr ? std::strtod(text, &end) : 0.0;
  if (text == nullptr || end == text || *end != '\0' || !(seconds > 0.0) || seconds > 1e6)
    return std::chrono::seconds(10);
  return std::chrono::nanoseconds(static_cast<std::int64_t>(seconds * 1e9));
}

// Locks `mutex`, waiting until `deadline` (CLOCK_MONOTONIC) at most: 0, EOWNERDEAD or
// ETIMEDOUT. ThreadSanitizer's runtime does not intercept pthread_mutex_clocklock (it would
// then report every unlock as one of an unlocked mutex): under it the wait polls
// pthread_mutex_trylock, which it does see.
namespace {
int lock_before(pthread_mutex_t* mutex, const timespec& deadline) {
#if VKV_THREAD_SANITIZER
  for (long pause_ns = 10000;; pause_ns = std::min(pause_ns * 2, 1000000L)) {
    const int result = pthread_mutex_trylock(mutex);
    if (result != EBUSY) return result;
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec > deadline.tv_sec || (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec))
      return ETIMEDOUT;
    const timespec pause{0, pause_ns};
    nanosleep(&pause, nullptr);
  }
#else
  return pthread_mutex_clocklock(mutex, CLOCK_MONOTONIC, &deadline);
#endif
}
}  // namespace

bool RobustMutex::lock(std::chrono::nanoseconds timeout, const std::string& what) {
  // CLOCK_MONOTONIC: a wall-clock step must not end the wait early or stretch it.
  timespec deadline{};
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  const std::int64_t nanoseconds = deadline.tv_nsec + timeout.count() % 1000000000;
  deadline.tv_sec += static_cast<time_t>(timeout.count() / 1000000000 + nanoseconds / 1000000000);
  deadline.tv_nsec = static_cast<long>(nanoseconds % 1000000000);
  const int result = lock_before(&mutex_, deadline);
  if (result == 0 || result == EOWNERDEAD) {
    holder_.store(static_cast<std::int32_t>(getpid()), std::memory_order_relaxed);
    if (result == 0) return false;
    pthread_mutex_consistent(&mutex_);
    return true;
  }
  if (result == ETIMEDOUT) {
    const ProcessIdentity owner{holder(), 0};
    const std::string command = owner.pid > 0 ? owner.command() : "";
    throw Error(concat(what, ": waited ", std::chrono::duration<double>(timeout).count(),
                       " s for its lock, held by pid ", owner.pid, command.empty() ? "" : " (" + command + ")",
                       ": that process is stopped (SIGSTOP, a debugger) or stuck; resume or kill it "
                       "(VKV_SHARED_LOCK_TIMEOUT sets the wait, in seconds)"));
  }
  throw Error(concat(what, ": locking its shared mutex failed: ", errno_text(result)));
}

void RobustMutex::unlock() noexcept {
  holder_.store(0, std::memory_order_relaxed);
  pthread_mutex_unlock(&mutex_);
}

void futex_wait(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                std::chrono::nanoseconds timeout) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "a futex is a plain 32-bit word");
  if (timeout.count() <= 0) return;
  timespec relative{};
  relative.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  relative.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE_FLAG: the word may be shared with other processes.
  syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word), FUTEX_WAIT, expected, &relative, nullptr, 0);
}

void futex_wake_all(const std::atomic<std::uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

namespace {

// Field 22 (start time) and field 3 (state) of /proc/<pid>/stat; false when unreadable.
bool read_stat(std::int32_t pid, std::uint64_t& start_time, char& state) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(file, line)) return false;
  // The command (field 2) is in parentheses and may hold spaces: read after the last ')'.
  const std::size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  rest >> state;  // field 3
  std::string skipped;
  for (int field = 4; field < 22; ++field) rest >> skipped;
  rest >> start_time;
  return static_cast<bool>(rest);
}

}  // namespace

ProcessIdentity ProcessIdentity::self() {
  ProcessIdentity identity;
  identity.pid = static_cast<std::int32_t>(getpid());
  char state = 0;
  if (!read_stat(identity.pid, identity.start_time, state))
    throw Error("cannot read /proc/self/stat: vkv's shared objects need Linux's /proc");
  return identity;
}

namespace {

// '?' when the process is gone or its pid names another one, 0 when it cannot tell.
char state_of(const ProcessIdentity& process) noexcept {
  if (process.pid <= 0) return '?';
  std::uint64_t started = 0;
  char state = 0;
  try {
    if (!read_stat(process.pid, started, state)) return '?';
  } catch (...) {
    return 0;  // out of memory
  }
  return started == process.start_time ? state : '?';
}

// Gone, or exited (a zombie's memory is gone already).
bool gone(char state) noexcept { return state == '?' || state == 'Z' || state == 'X'; }

}  // namespace

bool ProcessIdentity::alive() const noexcept {
  return !gone(state_of(*this));  // cannot tell (0): keep its share rather than count it twice
}

bool ProcessIdentity::running() const noexcept {
  const char state = state_of(*this);
  return state != 0 && !gone(state) && state != 'T' && state != 't';
}

std::string ProcessIdentity::command() const {
  std::ifstream file("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(file, name);
  return name;
}

}  // namespace vkv::detail
