// The budget's object (budget_segment.h): one that was widened, truncated, squatted by
// another user or laid out by another version is refused before anyone maps it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "budget_testing.h"
#include "shared_budget/budget_segment.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

// Someone widened the object's mode after its creator chose it, or truncated it: refused
// before anyone maps it (a truncated mapping raises SIGBUS when touched).
TEST(SharedBudgetSegmentTest, AWidenedOrTruncatedObjectIsRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host(), 0600);
  ASSERT_EQ(chmod(budget_path(name).c_str(), 0666), 0);
  const std::string widened = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(widened.find("is writable by more users than its creator chose (mode 0666, created with 0600)"),
            std::string::npos)
      << widened;
  ASSERT_EQ(chmod(budget_path(name).c_str(), 0600), 0);
  EXPECT_NO_THROW(SharedBudget::open(name.str()));
  ASSERT_EQ(truncate(budget_path(name).c_str(), 64), 0);
  const std::string truncated = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(truncated.find("is 64 bytes, less than the"), std::string::npos) << truncated;
}

// Another user's object: refused (root is the only other owner trusted). Needs root to
// make one; the object is world-writable, as a squatter's would be.
TEST(SharedBudgetSegmentTest, AnotherUsersBudgetIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make an object another user's";
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host(), 0666);
  ASSERT_EQ(chown(budget_path(name).c_str(), 65534, 65534), 0);
  const std::string squatted = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(squatted.find("is owned by uid 65534 (mode 0666"), std::string::npos) << squatted;
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  EXPECT_NE(error_of([&] { KvCache cache(config); }).find("is owned by uid 65534"), std::string::npos);
}

// The shared object's layout changed: an object of the earlier layout is refused as such.
TEST(SharedBudgetSegmentTest, AnObjectOfAnotherLayoutVersionIsRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget(name.str()).segment().version = 3;
  ASSERT_EQ(truncate(budget_path(name).c_str(), 4096), 0);  // the earlier layout was smaller
  const std::string error = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(error.find("has layout version 3, this vkv reads version 4: use the same vkv in every member"),
            std::string::npos)
      << error;
}

}  // namespace
}  // namespace vkv
