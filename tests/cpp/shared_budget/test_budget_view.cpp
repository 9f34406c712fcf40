// The books as stats() reads them (budget_view.h): each live member with its label, limits
// and bytes, the dead counted out; a row something else wrote gives an error naming the
// row and the field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "budget_testing.h"
#include "shared_budget/budget_view.h"
#include "shared_budget/member_holdings.h"
#include "shared_budget/member_registry.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

// A row something else wrote gives an error naming the row and the field, not garbage
// (nor, in Python, a UnicodeDecodeError); a process name that is not ASCII is stored as '?'s.
TEST(SharedBudgetViewTest, ACorruptedRowGivesAClearError) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);
  detail::BudgetMemberRecord& row = raw.segment().members[member];
  const std::string command(row.command);
  std::memcpy(row.command, "\xff\xfe\xfd", 4);
  std::string error = error_of([&] { budget.stats(); });
  EXPECT_NE(error.find("member row " + std::to_string(member) + " is corrupted (a command that is not text"),
            std::string::npos)
      << error;
  std::memcpy(row.command, command.c_str(), command.size() + 1);
  row.page_bytes = 3;
  error = error_of([&] { budget.stats(); });
  EXPECT_NE(error.find("a page size that is not a power of 2; pid " + std::to_string(getpid()) + ", page_bytes 3"),
            std::string::npos)
      << error;
  row.page_bytes = 1 << 20;
  EXPECT_EQ(budget.stats().members.size(), 1u);
  ledger.leave(member);
}

// Each live member as stats() shows it: its label, limits and bytes; for a member an engine
// answers for, what the engine keeps (all it holds but its spare); the dead are counted out
// first.
TEST(SharedBudgetViewTest, TheViewShowsEachLiveMemberAndCountsTheDeadOut) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  const std::size_t engine = registry.join(kPage, {pages(1), pages(8), 3}, "engine-a");
  const std::size_t dead = registry.join(kPage);
  ASSERT_TRUE(holdings.acquire(engine, pages(4)));
  ASSERT_TRUE(holdings.acquire(dead, pages(2)));
  holdings.publish_in_use(engine, pages(2));
  detail::BudgetView view = detail::read_view(local.get());
  EXPECT_EQ(view.capacity_bytes, pages(10));
  EXPECT_EQ(view.used_bytes, pages(6));
  EXPECT_EQ(view.device, "host");
  ASSERT_EQ(view.members.size(), 2u);
  const detail::BudgetMemberView& member = view.members[0];
  EXPECT_EQ(member.pid, getpid());
  EXPECT_EQ(member.label, "engine-a");
  EXPECT_EQ(member.row, engine);
  EXPECT_EQ(member.held_bytes, pages(4));
  EXPECT_EQ(member.in_use_bytes, pages(2));
  EXPECT_EQ(member.limits.floor, pages(1));
  EXPECT_EQ(member.limits.cap, pages(8));
  EXPECT_EQ(member.limits.priority, 3u);
  EXPECT_EQ(member.since_answer_ns, -1);  // never answered
  EXPECT_EQ(member.speaker_pid, 0);
  local.row(engine).speaker_start_time = detail::ProcessIdentity::self().start_time;
  local.row(engine).speaker_pid = getpid();  // an engine speaks for it: it could give 3 of its 4
  local.row(engine).spare = pages(3);
  pretend_dead(local.row(dead));
  view = detail::read_view(local.get());
  ASSERT_EQ(view.members.size(), 1u);
  EXPECT_EQ(view.used_bytes, pages(4));
  EXPECT_EQ(view.members[0].speaker_pid, getpid());
  EXPECT_EQ(view.members[0].in_use_bytes, pages(1));
}

}  // namespace
}  // namespace vkv
