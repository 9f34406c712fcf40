// The capacity and the members' limits at run time (budget_settings.h): shrinking asks the
// members for the excess, a cap bounds what a member holds and a lowered one is given back,
// limits set while a member runs take effect in it, and floors above the capacity are refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <string>

#include "budget_testing.h"
#include "shared_budget/budget_settings.h"
#include "shared_budget/member_holdings.h"
#include "shared_budget/member_registry.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

class SharedBudgetSettingsCacheTest : public SharedBudgetCacheTest {};

TEST_P(SharedBudgetSettingsCacheTest, ShrinkingAsksMembersForTheExcess) {
  auto a = member();
  const std::size_t held = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{held, tokens(2)}, {freed, tokens(5)}}));
  a->free_reqid(freed);
  const SharedBudgetStats stats = budget_->resize(budget_bytes(4));
  EXPECT_EQ(stats.capacity_bytes, budget_bytes(4));
  EXPECT_LE(stats.used_bytes, budget_bytes(4));
  EXPECT_LE(a->stats().pages_created, 4 * regions());
  EXPECT_EQ(a->stats().pages_in_use, 2 * regions());
  // Below what is claimed: the member keeps its claim, creates nothing until under it.
  const SharedBudgetStats below = budget_->resize(budget_bytes(1));
  EXPECT_EQ(below.used_bytes, budget_bytes(2));
  EXPECT_THROW(a->step(lens({{held, tokens(3)}})), OutOfMemory);
  budget_->resize(budget_bytes(8));
  a->step(lens({{held, tokens(3)}}));
  expect_books_add_up({a.get()});
}

// A cap bounds what a member holds: it neither takes free capacity nor asks beyond it.
// Lowered at run time below what it holds, the member gives back its unclaimed pages down
// to it; pages its requests claim stay until they finish, then go too.
TEST(SharedBudgetSettingsTest, ACapBoundsWhatAMemberHoldsAndALowerOneIsGivenBack) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess other([&] { hold(guaranteed_config(name), 0, 20); });
  ASSERT_TRUE(other.started());
  KvCache capped(guaranteed_config(name, 0, /*cap=*/10));
  const std::size_t slot = capped.alloc_reqid();
  const std::string refused = error_of([&] { step_to(capped, slot, 12); });  // 12 free, but the cap is 10
  EXPECT_NE(refused.find("step needs 12 more pages (768.00 KiB) but only 10 can be had"), std::string::npos) << refused;
  EXPECT_NE(refused.find("of its cap 640.00 KiB (shared_budget_cap)"), std::string::npos) << refused;
  EXPECT_EQ(member_of(budget.stats(), other.pid()).held_bytes, pages(20));  // nobody was asked
  step_to(capped, slot, 10);
  // Lowered to 6 while a request claims 10: it keeps them, and creates nothing.
  SharedBudgetStats stats = budget.set_limits(getpid(), {std::nullopt, pages(6), std::nullopt});
  EXPECT_EQ(member_of(stats, getpid()).cap_bytes, pages(6));
  EXPECT_EQ(member_of(stats, getpid()).held_bytes, pages(10));
  const std::size_t second = capped.alloc_reqid();
  EXPECT_THROW(step_to(capped, second, 1), OutOfMemory);
  capped.free_reqid(slot);  // its pages are unclaimed now: the watcher gives them back to 6
  EXPECT_TRUE(testing::wait_until([&] { return member_of(budget.stats(), getpid()).held_bytes <= pages(6); }));
  step_to(capped, second, 6);
  capped.check_invariants();
}

// Limits set while the member runs take effect in it: a lower cap makes it give back its
// unclaimed pages, a floor keeps the others from growing into it.
TEST(SharedBudgetSettingsTest, LimitsSetAtRunTimeTakeEffectInARunningMember) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess running([&] { hold(guaranteed_config(name), 2, 18); });
  ASSERT_TRUE(running.started());
  SharedBudgetStats stats = budget.set_limits(running.pid(), {std::nullopt, pages(8), 3u});
  EXPECT_EQ(member_of(stats, running.pid()).held_bytes, pages(8));
  EXPECT_EQ(member_of(stats, running.pid()).priority, 3u);
  stats = budget.set_limits(running.pid(), {pages(16), 0, std::nullopt});  // a floor above it, and no cap
  EXPECT_EQ(member_of(stats, running.pid()).floor_bytes, pages(16));
  EXPECT_EQ(member_of(stats, running.pid()).cap_bytes, 0u);
  EXPECT_EQ(member_of(stats, running.pid()).held_bytes, pages(8));
  KvCache other(guaranteed_config(name));
  const std::size_t slot = other.alloc_reqid();
  EXPECT_THROW(step_to(other, slot, 17), OutOfMemory);  // 24 free, 8 of them the floor's gap
  step_to(other, slot, 16);
  const std::string error = error_of([&] { budget.set_limits(running.pid(), {std::nullopt, pages(4), std::nullopt}); });
  EXPECT_NE(error.find("cap = 262144 of pid " + std::to_string(running.pid()) + " is less than its floor, 1048576"),
            std::string::npos)
      << error;
  EXPECT_NE(error_of([&] {
              budget.set_limits(1, {std::nullopt, std::nullopt, 1u});
            }).find("has no member with pid 1"),
            std::string::npos);
}

// Floors that together exceed the capacity are refused in one line naming the sum and the
// capacity: at joining, at setting, at resizing; nothing changes.
TEST(SharedBudgetSettingsTest, FloorsAboveTheCapacityAreRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess floored([&] { hold(guaranteed_config(name, /*floor=*/20), 0, 1); });
  ASSERT_TRUE(floored.started());
  const std::string sum = "floors would add up to 2359296 bytes (2.25 MiB), more than its capacity, 2097152 bytes";
  const std::string joining = error_of([&] { KvCache cache(guaranteed_config(name, /*floor=*/16)); });
  EXPECT_NE(joining.find("with shared_budget_floor = 1048576 the members' " + sum), std::string::npos) << joining;
  EXPECT_EQ(joining.find('\n'), std::string::npos);
  const std::string setting = error_of([&] {
    budget.set_limits(floored.pid(), {pages(36), std::nullopt, std::nullopt});
  });
  EXPECT_NE(setting.find("floors would add up to 2359296 bytes"), std::string::npos) << setting;
  const std::string resizing = error_of([&] { budget.resize(pages(16)); });
  EXPECT_NE(resizing.find("bytes = 1048576 is refused: the members' floors would add up to 1310720 bytes (1.25 MiB), "
                          "more than its capacity, 1048576 bytes"),
            std::string::npos)
      << resizing;
  const SharedBudgetStats stats = budget.stats();
  EXPECT_EQ(stats.capacity_bytes, pages(32));
  ASSERT_EQ(stats.members.size(), 1u);
  EXPECT_EQ(stats.members[0].floor_bytes, pages(20));
  KvCache fits(guaranteed_config(name, /*floor=*/12));
  EXPECT_EQ(budget.stats().members.size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetSettingsCacheTest,
                         testing::every_backend_with_both_layouts(), testing::backend_and_layout_name);

// ---- settings alone, on a segment in this process's memory -------------------------------

// A capacity lowered below what is used calls for give-backs; one below the floors is
// refused and changes nothing.
TEST(SharedBudgetSettingsTest, AResizeBelowUsedAsksAndOneBelowTheFloorsIsRefused) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  detail::BudgetSettings settings(local.get(), "kv");
  const std::size_t member = registry.join(kPage, {pages(2), 0, 0});
  ASSERT_TRUE(holdings.acquire(member, pages(8)));
  const std::uint32_t requests = local.get().requests;
  settings.resize(pages(9));
  EXPECT_EQ(local.get().capacity.load(), pages(9));
  EXPECT_EQ(local.get().requests.load(), requests);  // within it: nobody is asked
  settings.resize(pages(6));
  EXPECT_EQ(local.get().capacity.load(), pages(6));
  EXPECT_EQ(local.get().requests.load(), requests + 1);
  const std::string error = error_of([&] { settings.resize(pages(1)); });
  EXPECT_NE(error.find("shared budget 'kv': bytes = 65536 is refused: the members' floors would add up to 131072 "
                       "bytes (128.00 KiB), more than its capacity, 65536 bytes (64.00 KiB)"),
            std::string::npos)
      << error;
  EXPECT_EQ(local.get().capacity.load(), pages(6));
}

// set_limits() sets the fields it is told to, on every member of the process, and refuses
// (changing nothing) a cap below a member's page or floor, floors above the capacity, or a
// pid that has no member.
TEST(SharedBudgetSettingsTest, LimitsAreSetForEveryMemberOfAProcessOrNotAtAll) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::BudgetSettings settings(local.get());
  const std::size_t first = registry.join(kPage, {pages(1), pages(6), 1});
  const std::size_t second = registry.join(kPage);
  detail::LimitChange priority_only;
  priority_only.priority = true;
  EXPECT_EQ(settings.set_limits(getpid(), {pages(9), 0, 4}, priority_only), 2u);
  for (const std::size_t member : {first, second}) EXPECT_EQ(local.row(member).priority.load(), 4u);
  EXPECT_EQ(local.row(first).floor.load(), pages(1));
  EXPECT_EQ(local.row(first).cap.load(), pages(6));
  detail::LimitChange cap_only;
  cap_only.cap = true;
  const std::string pid = std::to_string(getpid());
  std::string error = error_of([&] { settings.set_limits(getpid(), {0, kPage / 2, 0}, cap_only); });
  EXPECT_NE(error.find("cap = 32768 of pid " + pid + " is less than one page of its cache, 65536 bytes"),
            std::string::npos)
      << error;
  detail::LimitChange floor_only;
  floor_only.floor = true;
  error = error_of([&] { settings.set_limits(getpid(), {pages(6), 0, 0}, floor_only); });
  EXPECT_NE(error.find("with floor = 393216 for pid " + pid + " the members' floors would add up to 786432 bytes"),
            std::string::npos)
      << error;
  error = error_of([&] { settings.set_limits(1, {0, 0, 0}, priority_only); });
  EXPECT_NE(error.find("the shared budget has no member with pid 1 (its members: " + pid + ", " + pid + ")"),
            std::string::npos)
      << error;
  EXPECT_EQ(local.row(first).floor.load(), pages(1));
  EXPECT_EQ(local.row(first).cap.load(), pages(6));
  EXPECT_EQ(local.row(second).floor.load(), 0u);
  EXPECT_EQ(settings.set_limits(getpid(), {pages(5), 0, 0}, floor_only), 2u);  // 10 in all: they fit
}

}  // namespace
}  // namespace vkv
