// ProcessWatch: a watched process that exits (a zombie, then reaped) is seen gone at the
// next all_alive(); a pid that names another process is never taken for the one watched.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include "interprocess/process_watch.h"

namespace vkv::detail {
namespace {

TEST(ProcessWatchTest, AProcessThatExitsIsGoneAtTheNextLook) {
  // The child's identity, written by itself, in memory both processes see.
  void* shared = mmap(nullptr, sizeof(ProcessIdentity), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  auto* child_identity = new (shared) ProcessIdentity();
  int go[2], ready[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(go[1]);  // or its own copy keeps the read below from ever ending
    close(ready[0]);
    *child_identity = ProcessIdentity::self();
    char byte = 0;
    if (write(ready[1], &byte, 1) != 1) _exit(2);
    if (read(go[0], &byte, 1) < 0) _exit(3);  // until the parent closes its end
    _exit(0);
  }
  close(go[0]);
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  const ProcessWatch watch({ProcessIdentity::self(), *child_identity});
  EXPECT_TRUE(watch.all_alive());
  EXPECT_TRUE(watch.all_alive()) << "a look changes nothing";
  close(go[1]);  // the child exits
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);  // a zombie, not reaped
  EXPECT_FALSE(watch.all_alive()) << "a zombie has exited";
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(watch.all_alive());
  close(ready[0]);
  munmap(shared, sizeof(ProcessIdentity));
}

TEST(ProcessWatchTest, APidThatNamesAnotherProcessIsNotTheOneWatched) {
  ProcessIdentity other = ProcessIdentity::self();
  other.start_time += 1;  // this pid, another process's start
  EXPECT_FALSE(ProcessWatch({other}).all_alive());
  EXPECT_TRUE(ProcessWatch({ProcessIdentity::self()}).all_alive());
  EXPECT_TRUE(ProcessWatch(std::vector<ProcessIdentity>{}).all_alive());
}

}  // namespace
}  // namespace vkv::detail
