// The budget's members (member_registry.h): a member that leaves gives everything back, one
// killed with SIGKILL is counted back (at the next look or the next shortage) with its
// floor, and a floor joining is freed from the others' unclaimed pages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "budget_testing.h"
#include "shared_budget/member_registry.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

class SharedBudgetRegistryCacheTest : public SharedBudgetCacheTest {};

TEST_P(SharedBudgetRegistryCacheTest, ALeavingMemberGivesEverythingBack) {
  {
    auto a = member();
    a->step(lens({{a->alloc_reqid(), tokens(4)}}));
    EXPECT_EQ(budget_->stats().used_bytes, budget_bytes(4));
  }
  const SharedBudgetStats stats = budget_->stats();
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_TRUE(stats.members.empty());
}

// A member killed with SIGKILL: the budget counts its pages back; the survivors go on.
// The child joins before the parent starts any thread (fork() copies only the caller).
TEST(SharedBudgetRegistryTest, AKilledMemberIsCountedBack) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  MemberProcess child([&] {
    auto* cache = new KvCache(config);  // lives until the process is killed
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
    seq_lens[cache->alloc_reqid()] = config.max_context_len;
    cache->step(seq_lens);
  });
  ASSERT_TRUE(child.started());
  SharedBudgetStats stats = budget.stats();
  ASSERT_EQ(stats.members.size(), 1u);
  EXPECT_EQ(stats.members[0].pid, child.pid());
  EXPECT_GT(stats.used_bytes, 0u);
  child.kill();
  stats = budget.stats();
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(stats.used_bytes, 0u);
  KvCache survivor(config);  // the whole capacity is there for the next member
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[survivor.alloc_reqid()] = config.max_context_len;
  survivor.step(seq_lens);
}

// A killed member's bytes are counted out at the next shortage of a survivor, without
// anyone looking at the stats: its step() that needs them succeeds at once.
TEST(SharedBudgetRegistryTest, AKilledMemberIsCountedOutAtTheNextShortage) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  MemberProcess child([&] {
    auto* cache = new KvCache(config);  // lives until the process is killed
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
    seq_lens[cache->alloc_reqid()] = config.max_context_len;  // claimed: nothing to give when asked
    cache->step(seq_lens);
  });
  ASSERT_TRUE(child.started());
  KvCache survivor(config);  // joins while the child lives (joining counts the dead out too)
  const std::size_t child_bytes = budget.stats().used_bytes;
  ASSERT_GT(child_bytes, 0u);
  budget.resize(child_bytes);  // the child holds the whole budget
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  const std::size_t slot = survivor.alloc_reqid();
  seq_lens[slot] = config.max_context_len;
  EXPECT_THROW(survivor.step(seq_lens), OutOfMemory);
  child.kill();
  survivor.step(seq_lens);  // no stats() in between
  EXPECT_EQ(survivor.stats().bytes_created(), child_bytes);
  survivor.check_invariants();
}

// A member joining with a floor that others' unclaimed pages occupy: they give those back,
// and the floor is there for it without an ask.
TEST(SharedBudgetRegistryTest, AFloorJoiningIsFreedFromTheOthersUnclaimedPages) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess other([&] { hold(guaranteed_config(name), 2, 18); });
  ASSERT_TRUE(other.started());
  KvCache floored(guaranteed_config(name, /*floor=*/20));  // 12 free: 8 short of its floor
  EXPECT_TRUE(testing::wait_until([&] { return member_of(budget.stats(), other.pid()).held_bytes == pages(12); }));
  const std::size_t slot = floored.alloc_reqid();
  step_to(floored, slot, 20);
  EXPECT_EQ(floored.stats().budget_asks.calls, 0u);
  floored.check_invariants();
}

// A member killed with SIGKILL takes its floor with it: the others may grow into it.
TEST(SharedBudgetRegistryTest, ADeadMembersFloorIsCountedOut) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess floored([&] { hold(guaranteed_config(name, /*floor=*/24), 0, 1); });
  ASSERT_TRUE(floored.started());
  KvCache other(guaranteed_config(name));
  const std::size_t slot = other.alloc_reqid();
  EXPECT_THROW(step_to(other, slot, 9), OutOfMemory);  // 31 free, 23 of them its floor's gap
  floored.kill();
  step_to(other, slot, 30);  // no stats() in between: the shortage counts the dead out
  EXPECT_EQ(budget.stats().members.size(), 1u);
  other.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetRegistryCacheTest,
                         testing::every_backend_with_both_layouts(), testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
