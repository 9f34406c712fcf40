// fork() with a live cache: the child gets a clear error from every call, never hangs,
// cannot write into the parent's pages, and its exit leaves the parent's cache intact.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "testing.h"

namespace vkv {
namespace {

// Runs `child` in a forked process; returns its wait status. A child that hangs is
// killed by an alarm, which the caller sees as SIGALRM.
template <typename Child>
int run_in_child(Child&& child) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);
    _exit(child());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

TEST(Fork, EveryCallInTheChildRaisesAndTheParentGoesOn) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.background_mapping = true;  // a mapper thread that does not exist in the child
  auto cache = std::make_unique<KvCache>(config, std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  const std::size_t slot = cache->alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[slot] = 10;
  cache->step(seq_lens);
  auto* token = reinterpret_cast<std::uint8_t*>(cache->base() + cache->layout().page_offset(0, slot, 0));
  std::memset(token, 0x42, cache->layout().token_bytes());

  const int status = run_in_child([&] {
    int refused = 0;
    auto refuses = [&](auto&& call) {
      try {
        call();
      } catch (const Error& error) {
        refused += std::string(error.what()).find("fork()") != std::string::npos ? 1 : 0;
      }
    };
    refuses([&] { cache->alloc_reqid(); });
    refuses([&] { cache->step(seq_lens); });
    refuses([&] { cache->free_reqid(slot); });
    refuses([&] { cache->stats(); });
    refuses([&] { cache->num_free_slots(); });
    cache.reset();  // must neither hang on the mapper nor release the parent's pages
    return refused == 5 ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit cleanly (status " << status << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a call in the child did not refuse with a fork() message";

  // The child's writes do not reach the parent: its copy of the mapping is gone.
  const int writer = run_in_child([&] {
    *token = 0x13;
    return 0;
  });
  // A segmentation fault (or, under AddressSanitizer, its report and exit code).
  EXPECT_FALSE(WIFEXITED(writer) && WEXITSTATUS(writer) == 0) << "the child wrote into the cache";
  EXPECT_TRUE(!WIFSIGNALED(writer) || WTERMSIG(writer) == SIGSEGV) << "the child died of " << WTERMSIG(writer);
  EXPECT_EQ(*token, 0x42);
  EXPECT_EQ(cache->alloc_reqid(), slot == 0 ? 1u : 0u);  // the parent's cache works on
  cache->check_invariants();
}

}  // namespace
}  // namespace vkv
