// SharedBudget, the object: creating, opening, removing and reading a budget, and the
// checks of its name, its capacity and the config fields that name one. What a budget's
// parts do is tested in a suite per part (test_member_registry.cpp, test_budget_asks.cpp, ...).
#include <gtest/gtest.h>

#include <string>

#include "budget_testing.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

TEST(SharedBudgetTest, CreateOpenRemoveAndStats) {
  BudgetName name;
  SharedBudget created = SharedBudget::create(name.str(), 64 << 20, host());
  SharedBudget opened = SharedBudget::open(name.str());
  const SharedBudgetStats stats = opened.stats();
  EXPECT_EQ(stats.name, name.str());
  EXPECT_EQ(stats.device, "host");
  EXPECT_EQ(stats.capacity_bytes, std::size_t{64} << 20);
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(created.resize(32 << 20).capacity_bytes, std::size_t{32} << 20);
  EXPECT_EQ(opened.stats().capacity_bytes, std::size_t{32} << 20);  // one object, seen by both
  EXPECT_TRUE(SharedBudget::remove(name.str()));
  EXPECT_FALSE(SharedBudget::remove(name.str()));
  EXPECT_EQ(opened.stats().capacity_bytes, std::size_t{32} << 20);  // still mapped where open
}

TEST(SharedBudgetTest, BadInputIsRefusedWithTheValueAndTheLimit) {
  BudgetName name;
  EXPECT_NE(error_of([&] { SharedBudget::open(name.str()); }).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of([] { SharedBudget::create("bad/name", 1 << 20, host()); }).find("only letters"),
            std::string::npos);
  EXPECT_NE(error_of([] { SharedBudget::create("", 1 << 20, host()); }).find("1 to 200 characters"), std::string::npos);
  EXPECT_NE(error_of([&] { SharedBudget::create(name.str(), 0, host()); }).find("bytes = 0"), std::string::npos);
  const std::size_t huge = std::size_t{1} << 60;
  const std::string too_large = error_of([&] { SharedBudget::create(name.str(), huge, host()); });
  EXPECT_NE(too_large.find(std::to_string(huge)), std::string::npos) << too_large;
  EXPECT_NE(too_large.find("exceeds the memory of host"), std::string::npos) << too_large;
  SharedBudget budget = SharedBudget::create(name.str(), 1 << 20, host());
  EXPECT_NE(error_of([&] { SharedBudget::create(name.str(), 1 << 20, host()); }).find("exists already"),
            std::string::npos);
  EXPECT_NE(error_of([&] { budget.resize(huge); }).find("exceeds the memory"), std::string::npos);
  EXPECT_EQ(budget.stats().capacity_bytes, std::size_t{1} << 20);  // the failed resize changed nothing
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = "no-such-budget";
  EXPECT_NE(error_of([&] {
              KvCache cache(config);
            }).find("shared_budget = 'no-such-budget': shared budget 'no-such-budget' does not exist"),
            std::string::npos);
}

TEST(SharedBudgetTest, NamesAShellWouldMisreadAndBudgetsBelowOnePageAreRefused) {
  for (const std::string bad : {".", "..", "-x", "--help"})
    EXPECT_NE(error_of([&] {
                SharedBudget::create(bad, 64 << 20, host());
              }).find("must not be '.' or '..' nor start with '-'"),
              std::string::npos)
        << bad;
  BudgetName name;
  const std::string tiny = error_of([&] { SharedBudget::create(name.str(), 1, host()); });
  EXPECT_NE(tiny.find("bytes = 1 (1 B) is less than one page of its members, 4096 bytes"), std::string::npos) << tiny;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);  // a member of 1 MiB pages
  const std::string small = error_of([&] { budget.resize(512 << 10); });
  EXPECT_NE(small.find("is less than one page of its members, 1048576 bytes"), std::string::npos) << small;
  EXPECT_EQ(budget.stats().capacity_bytes, std::size_t{64} << 20);
  EXPECT_EQ(budget.resize(1 << 20).capacity_bytes, std::size_t{1} << 20);
  ledger.leave(member);
}

TEST(SharedBudgetConfig, PressureMsNeedsASharedBudgetAndADayAtMost) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.shared_budget_pressure_ms = 5;
  EXPECT_THROW(validate(config), InvalidArgument);
  config.shared_budget = "x";
  config.shared_budget_pressure_ms = kMaxIdleMs + 1;
  EXPECT_THROW(validate(config), InvalidArgument);
}

TEST(SharedBudgetConfig, IdleMsNeedsASharedBudgetAndADayAtMost) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.shared_budget_idle_ms = 5;
  EXPECT_THROW(validate(config), InvalidArgument);
  config.shared_budget = "x";
  config.shared_budget_idle_ms = kMaxIdleMs + 1;
  EXPECT_THROW(validate(config), InvalidArgument);
}

}  // namespace
}  // namespace vkv
