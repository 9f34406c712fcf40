// The utilities alone: the fork guard's generation and the sizes error messages print.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/fork_guard.h"
#include "util/format.h"

namespace vkv::detail {
namespace {

TEST(ForkGuard, AChildSeesANewGenerationAndTheParentKeepsItsOwn) {
  const std::uint64_t parent = fork_generation();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(fork_generation() > parent ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's generation did not move";
  EXPECT_EQ(fork_generation(), parent);
}

TEST(FormatBytes, PicksTheLargestUnitBelowTheValue) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(2 << 20), "2.00 MiB");
  EXPECT_EQ(format_bytes((std::size_t{3} << 30) / 2), "1.50 GiB");
}

}  // namespace
}  // namespace vkv::detail
