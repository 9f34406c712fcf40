// The budget's members (member_registry.h): a member takes a free row with its limits and
// label, and a full budget or a cap below a page or the floor is refused; a member that
// leaves gives everything back, one killed with SIGKILL is counted back (at the next look
// or the next shortage) with its floor, and a floor joining is freed from the others'
// unclaimed pages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "budget_testing.h"
#include "shared_budget/member_holdings.h"
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

// ---- the registry alone, on a segment in this process's memory ----------------------------

// A member takes the first free row, with its page size, limits and label (printable, cut
// to fit), and owes no answer to requests made before it joined; leaving frees the row.
TEST(SharedBudgetRegistryTest, AJoinTakesTheFirstFreeRowAndALeaveGivesItBack) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  local.get().requests = 5;
  const std::string label = "engine\x01" + std::string(60, 'x');
  EXPECT_EQ(registry.join(kPage, {pages(1), pages(4), 2}, label), 0u);
  EXPECT_EQ(registry.join(kPage), 1u);
  const detail::BudgetMemberRecord& row = local.row(0);
  EXPECT_EQ(row.pid.load(), getpid());
  EXPECT_EQ(row.page_bytes, kPage);
  EXPECT_EQ(std::string(row.label), "engine?" + std::string(40, 'x'));
  EXPECT_EQ(row.floor.load(), pages(1));
  EXPECT_EQ(row.cap.load(), pages(4));
  EXPECT_EQ(row.priority.load(), 2u);
  EXPECT_EQ(row.answered, 5u);
  registry.leave(0);
  EXPECT_EQ(local.row(0).pid.load(), 0);
  EXPECT_EQ(registry.join(kPage), 0u);
}

TEST(SharedBudgetRegistryTest, AFullBudgetRefusesAJoinUntilAMemberIsGone) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  for (std::size_t i = 0; i < detail::BudgetSegment::kMaxMembers; ++i) ASSERT_EQ(registry.join(kPage), i);
  const std::string error = error_of([&] { registry.join(kPage); });
  EXPECT_NE(error.find("the shared budget has 64 members already"), std::string::npos) << error;
  pretend_dead(local.row(5));
  EXPECT_EQ(registry.join(kPage), 5u);  // joining counts the dead out first
}

TEST(SharedBudgetRegistryTest, ACapBelowAPageOrTheFloorIsRefusedAtJoining) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  std::string error = error_of([&] { registry.join(kPage, {0, kPage - 1, 0}); });
  EXPECT_NE(error.find("shared_budget_cap = 65535 is less than one page of this cache, 65536 bytes"), std::string::npos)
      << error;
  error = error_of([&] { registry.join(kPage, {pages(3), pages(2), 0}); });
  EXPECT_NE(error.find("is less than shared_budget_floor = 196608"), std::string::npos) << error;
  EXPECT_EQ(local.row(0).pid.load(), 0);  // no row taken
}

// A dead member's bytes come back: to the free capacity, or to the askers' reservation.
TEST(SharedBudgetRegistryTest, ReapingCountsADeadMembersBytesBack) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  const std::size_t dead = registry.join(kPage);
  const std::size_t asker = registry.join(kPage);
  ASSERT_TRUE(holdings.acquire(dead, pages(10)));
  EXPECT_EQ(registry.reap(), 0u);
  local.row(asker).wanted = pages(3);
  pretend_dead(local.row(dead));
  const std::uint32_t releases = local.get().releases;
  EXPECT_EQ(registry.reap(), 1u);
  EXPECT_EQ(local.row(dead).pid.load(), 0);
  EXPECT_EQ(local.get().reserved.load(), pages(3));
  EXPECT_EQ(local.get().used.load(), pages(3));
  EXPECT_NE(local.get().releases.load(), releases);  // an asker waiting is woken
  EXPECT_EQ(registry.reap(), 0u);
}

TEST(SharedBudgetRegistryTest, TheLeastCapacityIsTheLargestPageOfTheDeviceAndTheMembers) {
  const LocalSegment local(pages(10), 4096);
  detail::MemberRegistry registry(local.get());
  EXPECT_EQ(registry.largest_page(), 4096u);
  const std::size_t member = registry.join(kPage);
  EXPECT_EQ(registry.largest_page(), kPage);
  registry.leave(member);
  EXPECT_EQ(registry.largest_page(), 4096u);
}

}  // namespace
}  // namespace vkv
