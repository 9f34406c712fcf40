// The books' lock (budget_lock.h): a member killed holding it blocks nobody and the next
// locker repairs the books; one stopped holding it costs an error naming it, not a hang.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

#include "budget_testing.h"
#include "shared_budget/budget_lock.h"
#include "shared_budget/member_holdings.h"
#include "shared_budget/member_registry.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

// A member killed while it holds the budget's lock blocks nobody: the next locker repairs.
TEST(SharedBudgetLockTest, AMemberKilledHoldingTheLockBlocksNobody) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  MemberProcess child([&] {
    detail::SharedMapping object = detail::open_budget_object(name.str());
    detail::BudgetLedger ledger(*static_cast<detail::BudgetSegment*>(object.data()));
    ledger.acquire(ledger.join(1 << 20), 8 << 20);
    static_cast<detail::BudgetSegment*>(object.data())->mutex.lock();
    // Stays mapped until the process dies: the kernel marks a robust mutex's owner dead
    // through the dying thread's list, at the mutex's address in that process.
    static_cast<void>(new detail::SharedMapping(std::move(object)));
  });
  ASSERT_TRUE(child.started());
  child.kill();
  const SharedBudgetStats stats = budget.stats();  // would hang on a plain mutex
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(stats.used_bytes, 0u);
}

// A member stopped while it holds the lock (here: it never unlocks) costs the others an
// error naming its pid after VKV_SHARED_LOCK_TIMEOUT seconds, not a hang.
TEST(SharedBudgetLockTest, AMemberStoppedHoldingTheLockCostsAnErrorNotAHang) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  MemberProcess child([&] {
    auto* raw = new RawBudget(name.str());  // stays mapped: the lock is held until the process dies
    raw->segment().mutex.lock();
  });
  ASSERT_TRUE(child.started());
  setenv("VKV_SHARED_LOCK_TIMEOUT", "0.2", 1);
  const std::string stats = error_of([&] { budget.stats(); });
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  const std::string joining = error_of([&] { KvCache cache(config); });
  unsetenv("VKV_SHARED_LOCK_TIMEOUT");
  const std::string holder = "held by pid " + std::to_string(child.pid());
  EXPECT_NE(stats.find("a shared budget: waited 0.2 s for its lock, " + holder), std::string::npos) << stats;
  EXPECT_NE(joining.find(holder), std::string::npos) << joining;
  child.kill();
  EXPECT_TRUE(budget.stats().members.empty());  // the next locker repairs after its death
}

// `used` wrapped below zero (as a half-done change of a process killed holding the lock, or
// a stray write, could leave it) is added up again from the rows when the books are
// recounted: after an owner died holding the lock, and whenever a release would wrap it.
TEST(SharedBudgetLockTest, AnUnderflowedUsedIsRepairedWhenTheBooksAreRecounted) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);
  ASSERT_TRUE(ledger.acquire(member, 8 << 20));
  raw.segment().used.store(~std::uint64_t{0} - 4095);  // wrapped
  MemberProcess child([&] {
    auto* mine = new RawBudget(name.str());
    mine->segment().mutex.lock();  // dies holding it
  });
  ASSERT_TRUE(child.started());
  child.kill();
  EXPECT_EQ(budget.stats().used_bytes, std::size_t{8} << 20);
  raw.segment().used.store(1 << 20);  // less than the release below: it would wrap
  ledger.release(member, 4 << 20);
  EXPECT_EQ(budget.stats().used_bytes, std::size_t{4} << 20);
  ledger.leave(member);
  EXPECT_EQ(budget.stats().used_bytes, 0u);
}

// Taken after its holder died, the lock counts the dead out and adds `used` up again from
// the rows before its taker reads the books; taken after a holder that unlocked, it
// changes nothing.
TEST(SharedBudgetLockTest, TakenAfterItsHolderDiedItRepairsTheBooksFirst) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetSegment& segment = raw.segment();
  detail::MemberRegistry registry(segment);
  detail::MemberHoldings holdings(segment);
  const std::size_t live = registry.join(1 << 20);
  const std::size_t dead = registry.join(1 << 20);
  ASSERT_TRUE(holdings.acquire(live, 8 << 20));
  ASSERT_TRUE(holdings.acquire(dead, 4 << 20));
  pretend_dead(segment.members[dead]);
  segment.used.store(1);  // off, as a change cut short leaves it
  { const detail::BudgetLock lock(segment); }
  EXPECT_EQ(segment.used.load(), 1u);
  EXPECT_NE(segment.members[dead].pid.load(), 0);
  MemberProcess child([&] {
    auto* mine = new RawBudget(name.str());  // stays mapped: the lock is held until the process dies
    mine->segment().mutex.lock();
  });
  ASSERT_TRUE(child.started());
  child.kill();
  {
    const detail::BudgetLock lock(segment);
    EXPECT_EQ(segment.members[dead].pid.load(), 0);
    EXPECT_EQ(segment.used.load(), std::uint64_t{8} << 20);
  }
  registry.leave(live);
  EXPECT_EQ(segment.used.load(), 0u);
}

}  // namespace
}  // namespace vkv
