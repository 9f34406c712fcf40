// The books as stats() reads them (budget_view.h): a row something else wrote gives an
// error naming the row and the field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "budget_testing.h"
#include "shared_budget/budget_view.h"
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

}  // namespace
}  // namespace vkv
