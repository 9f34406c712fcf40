// HostAllReduce: MAX over every rank's vector, its barrier reused round after round, by
// threads and by processes; a rank that exits or never comes makes the others raise.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "vkv/error.h"
#include "vkv/host_all_reduce.h"

namespace vkv {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::string unique_name(const char* what) {
  return std::string("vkv-test-all-reduce-") + what + "-" + std::to_string(getpid());
}

// What rank `rank` contributes at `index` in `round`: each index's maximum comes from
// another rank from round to round, negative values included.
std::int64_t contribution(std::size_t rank, std::size_t ranks, std::uint64_t round, std::size_t index) {
  const auto winner = static_cast<std::size_t>((round + index) % ranks);
  const auto base = static_cast<std::int64_t>(round * 1000 + index) - 500;
  return rank == winner ? base + 7 : base - static_cast<std::int64_t>(rank) - 1;
}

// The message of the `Exception` that `call` throws; "" when it throws none.
template <typename Exception, typename Call>
std::string message_of(Call call) {
  try {
    call();
  } catch (const Exception& error) {
    return error.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The number of values of a round: varies, the same on every rank.
std::size_t count_of(std::uint64_t round, std::size_t capacity) { return 1 + round % capacity; }

// Runs `rounds` rounds as `rank`; returns how many rounds gave the expected maximum.
std::size_t run_rounds(HostAllReduce& all_reduce, std::uint64_t rounds) {
  std::size_t correct = 0;
  std::vector<std::int64_t> values(all_reduce.capacity());
  for (std::uint64_t round = 1; round <= rounds; ++round) {
    const std::size_t count = count_of(round, all_reduce.capacity());
    for (std::size_t index = 0; index < count; ++index)
      values[index] = contribution(all_reduce.rank(), all_reduce.ranks(), round, index);
    all_reduce.reduce_max(values.data(), count, seconds(60));
    bool right = true;
    for (std::size_t index = 0; index < count; ++index)
      right = right && values[index] == static_cast<std::int64_t>(round * 1000 + index) - 500 + 7;
    correct += right;
  }
  return correct;
}

TEST(HostAllReduceTest, ThreadsGetTheMaximumRoundAfterRound) {
  const std::string name = unique_name("threads");
  HostAllReduce::unlink(name);
  constexpr std::size_t kRanks = 4;
  constexpr std::uint64_t kRounds = 3000;
  std::vector<HostAllReduce> handles;
  handles.push_back(HostAllReduce::create(name, kRanks, 5));
  for (std::size_t rank = 1; rank < kRanks; ++rank) handles.push_back(HostAllReduce::join(name, rank));
  EXPECT_TRUE(handles[0].peers_visible());
  std::vector<std::size_t> correct(kRanks);
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < kRanks; ++rank)
    threads.emplace_back([&, rank] { correct[rank] = run_rounds(handles[rank], kRounds); });
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(correct, std::vector<std::size_t>(kRanks, kRounds));
}

TEST(HostAllReduceTest, ProcessesGetTheMaximumRoundAfterRound) {
  const std::string name = unique_name("processes");
  HostAllReduce::unlink(name);
  constexpr std::size_t kRanks = 3;
  constexpr std::uint64_t kRounds = 2000;
  HostAllReduce first = HostAllReduce::create(name, kRanks, 4);
  std::vector<pid_t> children;
  for (std::size_t rank = 1; rank < kRanks; ++rank) {
    const pid_t child = fork();
    if (child == 0) {
      HostAllReduce joined = HostAllReduce::join(name, rank);
      _exit(run_rounds(joined, kRounds) == kRounds ? 0 : 1);
    }
    children.push_back(child);
  }
  EXPECT_EQ(run_rounds(first, kRounds), kRounds);
  for (const pid_t child : children) {
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a child rank got a wrong maximum";
  }
}

TEST(HostAllReduceTest, TheNameIsGoneOnceEveryRankJoined) {
  const std::string name = unique_name("unlink");
  HostAllReduce::unlink(name);
  HostAllReduce first = HostAllReduce::create(name, 3, 1);
  HostAllReduce second = HostAllReduce::join(name, 1);
  EXPECT_FALSE(first.peers_visible());  // rank 2 has not joined
  HostAllReduce third = HostAllReduce::join(name, 2);
  EXPECT_TRUE(first.peers_visible());
  EXPECT_FALSE(HostAllReduce::unlink(name));  // the last to join removed it
  EXPECT_THROW(HostAllReduce::join(name, 1), InvalidArgument);
  const std::string alone = unique_name("alone");
  HostAllReduce::unlink(alone);
  HostAllReduce single = HostAllReduce::create(alone, 1, 2);
  EXPECT_FALSE(HostAllReduce::unlink(alone));
  std::int64_t values[2] = {-3, 4};
  single.reduce_max(values, 2, seconds(1));  // one rank: its own values
  EXPECT_EQ(values[0], -3);
  EXPECT_EQ(values[1], 4);
}

TEST(HostAllReduceTest, ARankThatExitedIsNamed) {
  const std::string name = unique_name("exited");
  HostAllReduce::unlink(name);
  HostAllReduce first = HostAllReduce::create(name, 2, 1);
  const pid_t child = fork();
  if (child == 0) {
    HostAllReduce joined = HostAllReduce::join(name, 1);
    std::int64_t value = 1;
    joined.reduce_max(&value, 1, seconds(60));  // one round, then it is killed
    kill(getpid(), SIGKILL);
  }
  std::int64_t value = 0;
  first.reduce_max(&value, 1, seconds(60));
  EXPECT_EQ(value, 1);
  const std::string message =  // would hang without the liveness check
      message_of<Error>([&] { first.reduce_max(&value, 1, seconds(600)); });
  EXPECT_TRUE(contains(message, "rank 1 (pid " + std::to_string(child) + ") exited while rank 0 waited")) << message;
  EXPECT_THROW(first.reduce_max(&value, 1, seconds(1)), Error);  // out of use since
  waitpid(child, nullptr, 0);
}

TEST(HostAllReduceTest, ARankThatNeverComesTimesOut) {
  const std::string name = unique_name("timeout");
  HostAllReduce::unlink(name);
  HostAllReduce first = HostAllReduce::create(name, 2, 1);
  HostAllReduce second = HostAllReduce::join(name, 1);  // alive, never reduces
  std::int64_t value = 0;
  const std::string timed_out = message_of<Error>([&] { first.reduce_max(&value, 1, milliseconds(30)); });
  EXPECT_TRUE(contains(timed_out, "rank 1 (pid " + std::to_string(getpid()) + ") did not arrive at round 1"))
      << timed_out;
  const std::string refused = message_of<Error>([&] { first.reduce_max(&value, 1, seconds(1)); });
  EXPECT_TRUE(contains(refused, "out of use")) << refused;  // the rounds are out of step
}

TEST(HostAllReduceTest, MisuseIsRefusedNamingTheValues) {
  const std::string name = unique_name("misuse");
  HostAllReduce::unlink(name);
  EXPECT_THROW(HostAllReduce::create(name, 0, 1), InvalidArgument);
  EXPECT_THROW(HostAllReduce::create(name, 2, 0), InvalidArgument);
  HostAllReduce first = HostAllReduce::create(name, 2, 3);
  EXPECT_THROW(HostAllReduce::create(name, 2, 3), InvalidArgument);  // exists
  EXPECT_THROW(HostAllReduce::join(name, 0), InvalidArgument);       // rank 0 created it
  EXPECT_THROW(HostAllReduce::join(name, 2), InvalidArgument);       // out of range
  HostAllReduce second = HostAllReduce::join(name, 1);
  std::int64_t values[4] = {};
  const std::string too_many = message_of<InvalidArgument>([&] { first.reduce_max(values, 4, seconds(1)); });
  EXPECT_TRUE(contains(too_many, "4 values exceed its capacity of 3")) << too_many;
  // Counts that differ: both ranks raise, and the next round works.
  std::string messages[2];
  std::thread other([&] {
    std::int64_t mine[3] = {};
    messages[1] = message_of<InvalidArgument>([&] { second.reduce_max(mine, 3, seconds(60)); });
    mine[0] = 9;
    second.reduce_max(mine, 1, seconds(60));
  });
  messages[0] = message_of<InvalidArgument>([&] { first.reduce_max(values, 2, seconds(60)); });
  values[0] = 1;
  first.reduce_max(values, 1, seconds(60));
  other.join();
  for (const std::string& message : messages)
    EXPECT_TRUE(contains(message, "every rank must pass the same count")) << message;
  EXPECT_EQ(values[0], 9);
}

}  // namespace
}  // namespace vkv
