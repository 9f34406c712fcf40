// The cross-process primitives: named shared memory, the robust mutex, futexes, liveness.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "interprocess/shared_memory.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

std::string unique_name(const char* what) { return std::string("vkv-test-") + what + "-" + std::to_string(getpid()); }

// Runs `body` in a child process and returns its pid once it has exited (not yet reaped).
template <typename Body>
pid_t run_child_and_wait_for_exit(Body body) {
  const pid_t child = fork();
  if (child == 0) {
    body();
    _exit(0);
  }
  siginfo_t info{};
  waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT);  // a zombie: exited, not reaped
  return child;
}

TEST(SharedMappingTest, CreateOpenAndUnlinkName) {
  const std::string name = unique_name("mapping");
  SharedMapping::unlink(name, "test object");
  {
    SharedMapping created = SharedMapping::create(name, 4096, 0600, "test object");
    static_cast<char*>(created.data())[10] = 42;
    SharedMapping opened = SharedMapping::open(name, 4096, "test object");
    EXPECT_EQ(opened.size(), 4096u);
    EXPECT_EQ(static_cast<char*>(opened.data())[10], 42);  // the same bytes
    EXPECT_EQ(static_cast<char*>(opened.data())[11], 0);   // zero-filled
  }
  EXPECT_TRUE(SharedMapping::unlink(name, "test object"));
  EXPECT_FALSE(SharedMapping::unlink(name, "test object"));
}

TEST(SharedMappingTest, ErrorsNameTheObject) {
  const std::string name = unique_name("errors");
  SharedMapping::unlink(name, "test object");
  try {
    SharedMapping::open(name, 1, "shared budget 'x'");
    FAIL() << "opened an object that does not exist";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("shared budget 'x' does not exist"), std::string::npos) << error.what();
  }
  SharedMapping first = SharedMapping::create(name, 4096, 0600, "test object");
  EXPECT_THROW(SharedMapping::create(name, 4096, 0600, "test object"), InvalidArgument);  // exists
  try {
    SharedMapping::open(name, 8192, "test object");
    FAIL() << "opened an object shorter than asked";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("4096 bytes, less than the 8192"), std::string::npos) << error.what();
  }
  SharedMapping::unlink(name, "test object");
}

TEST(ObjectNameTest, ANameOfAllowedCharactersWithinTheLengthPasses) {
  EXPECT_NO_THROW(expect_valid_object_name("team-a_1.v2", 11, "shared budget name"));
}

TEST(ObjectNameTest, EachBrokenRuleIsNamedWithTheName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "must have 1 to 8 characters (it has 0)"},
      {"waytoolong", "must have 1 to 8 characters (it has 10)"},
      {"a/b", "may hold only letters, digits"},
      {"..", "must not be '.' or '..'"},
      {"-x", "nor start with '-'"},
  };
  for (const auto& [name, fragment] : cases) {
    try {
      expect_valid_object_name(name, 8, "shared budget name");
      ADD_FAILURE() << "accepted '" << name << "'";
    } catch (const InvalidArgument& error) {
      const std::string text = error.what();
      EXPECT_NE(text.find("shared budget name '" + name + "'"), std::string::npos) << text;
      EXPECT_NE(text.find(fragment), std::string::npos) << text;
    }
  }
}

TEST(RobustMutexTest, TheNextLockerLearnsThatTheOwnerDied) {
  const std::string name = unique_name("mutex");
  SharedMapping::unlink(name, "test object");
  SharedMapping memory = SharedMapping::create(name, sizeof(RobustMutex), 0600, "test object");
  SharedMapping::unlink(name, "test object");
  auto* mutex = new (memory.data()) RobustMutex;
  mutex->init();
  const pid_t child = run_child_and_wait_for_exit([&] { mutex->lock(); });  // dies holding it
  EXPECT_TRUE(mutex->lock());
  mutex->unlock();
  EXPECT_FALSE(mutex->lock());  // consistent again
  mutex->unlock();
  waitpid(child, nullptr, 0);
}

// A squatter: an object of another user, open to users outside its group, is refused;
// one that user shares with our group only is trusted. Needs root to give it away.
TEST(SharedMappingTest, AnotherUsersObjectIsRefusedUnlessSharedWithOurGroupOnly) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make an object another user's";
  const std::string name = unique_name("squatted");
  SharedMapping::unlink(name, "test object");
  SharedMapping created = SharedMapping::create(name, 4096, 0666, "test object");
  const std::string path = "/dev/shm/" + name;
  ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
  try {
    SharedMapping::open(name, 4096, "shared budget 'x'");
    FAIL() << "joined another user's world-writable object";
  } catch (const InvalidArgument& error) {
    const std::string text = error.what();
    EXPECT_NE(text.find("shared budget 'x' is owned by uid 65534 (mode 0666"), std::string::npos) << text;
    EXPECT_NE(text.find("not by this user (uid 0)"), std::string::npos) << text;
  }
  ASSERT_EQ(chown(path.c_str(), 65534, getegid()), 0);
  ASSERT_EQ(chmod(path.c_str(), 0660), 0);
  EXPECT_NO_THROW(SharedMapping::open(name, 4096, "test object"));  // shared with our group only
  ASSERT_EQ(chmod(path.c_str(), 0664), 0);
  EXPECT_THROW(SharedMapping::open(name, 4096, "test object"), InvalidArgument);  // others may read
  SharedMapping::unlink(name, "test object");
}

// A truncated object is refused before it is mapped (mapping it would SIGBUS later).
TEST(SharedMappingTest, ATruncatedObjectIsRefusedBeforeMapping) {
  const std::string name = unique_name("truncated");
  SharedMapping::unlink(name, "test object");
  SharedMapping created = SharedMapping::create(name, 8192, 0600, "test object");
  ASSERT_EQ(truncate(("/dev/shm/" + name).c_str(), 100), 0);
  try {
    SharedMapping::open(name, 8192, "test object");
    FAIL() << "mapped a truncated object";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("is 100 bytes, less than the 8192"), std::string::npos) << error.what();
  }
  SharedMapping::unlink(name, "test object");
}

// A holder that stops (SIGSTOP, a debugger) costs the next locker an error naming it.
TEST(RobustMutexTest, AStoppedHolderTimesOutNamingItsPid) {
  const std::string name = unique_name("stopped");
  SharedMapping::unlink(name, "test object");
  SharedMapping memory =
      SharedMapping::create(name, sizeof(RobustMutex) + sizeof(std::atomic<int>), 0600, "test object");
  SharedMapping::unlink(name, "test object");
  auto* mutex = new (memory.data()) RobustMutex;
  mutex->init();
  auto* locked = new (static_cast<char*>(memory.data()) + sizeof(RobustMutex)) std::atomic<int>(0);
  const pid_t child = fork();
  if (child == 0) {
    mutex->lock();
    locked->store(1);
    raise(SIGSTOP);
    _exit(0);
  }
  while (locked->load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(mutex->holder(), child);
  const auto begin = std::chrono::steady_clock::now();
  try {
    mutex->lock(std::chrono::milliseconds(200), "shared budget 'x'");
    FAIL() << "locked a mutex a stopped process holds";
  } catch (const Error& error) {
    const std::string text = error.what();
    EXPECT_NE(text.find("shared budget 'x': waited 0.2 s for its lock, held by pid " + std::to_string(child)),
              std::string::npos)
        << text;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(5));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(mutex->lock(std::chrono::seconds(5)));  // its death freed it
  mutex->unlock();
  EXPECT_EQ(mutex->holder(), 0);
}

TEST(ProcessIdentityTest, ADeadProcessIsNotAlive) {
  const ProcessIdentity self = ProcessIdentity::self();
  EXPECT_TRUE(self.alive());
  EXPECT_FALSE(self.command().empty());
  ProcessIdentity reused = self;
  reused.start_time += 1;  // the same pid, another process
  EXPECT_FALSE(reused.alive());
  SharedMapping::unlink(unique_name("identity"), "test object");
  SharedMapping memory = SharedMapping::create(unique_name("identity"), sizeof(ProcessIdentity), 0600, "test object");
  SharedMapping::unlink(unique_name("identity"), "test object");
  auto* identity = static_cast<ProcessIdentity*>(memory.data());
  const pid_t child = run_child_and_wait_for_exit([&] { *identity = ProcessIdentity::self(); });
  EXPECT_EQ(identity->pid, child);
  EXPECT_FALSE(identity->alive());  // a zombie counts as gone
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(identity->alive());
}

TEST(FutexTest, WakeEndsAWaitAndATimeoutEndsItToo) {
  std::atomic<std::uint32_t> word{0};
  const auto begin = std::chrono::steady_clock::now();
  futex_wait(word, 0, std::chrono::milliseconds(20));
  EXPECT_GE(std::chrono::steady_clock::now() - begin, std::chrono::milliseconds(15));
  futex_wait(word, 1, std::chrono::seconds(10));  // the word differs: returns at once
  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    word.store(1);
    futex_wake_all(word);
  });
  while (word.load() == 0) futex_wait(word, 0, std::chrono::seconds(10));
  EXPECT_EQ(word.load(), 1u);
  waker.join();
}

}  // namespace
}  // namespace vkv::detail
