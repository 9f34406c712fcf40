// The budget's object (budget_segment.h): a new one is an empty budget, its text fields hold
// printable ASCII only, its name is the budget's; one that was widened, truncated, squatted
// by another user or laid out by another version is refused before anyone maps it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
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

// ---- the layout, on a segment in this process's memory ----------------------------------

TEST(SharedBudgetSegmentTest, ALaidOutSegmentIsAnEmptyBudgetOfItsCapacity) {
  const LocalSegment local(pages(10));
  const detail::BudgetSegment& segment = local.get();
  EXPECT_EQ(segment.magic.load(), detail::BudgetSegment::kMagic);
  EXPECT_EQ(segment.version, detail::BudgetSegment::kVersion);
  EXPECT_EQ(segment.mode, 0600u);
  EXPECT_EQ(segment.capacity.load(), pages(10));
  EXPECT_EQ(segment.used.load(), 0u);
  EXPECT_EQ(segment.device_page_bytes, kPage);
  EXPECT_STREQ(segment.device, "host");
  for (const detail::BudgetMemberRecord& row : segment.members) EXPECT_EQ(row.pid.load(), 0);
  auto again = std::make_unique<detail::BudgetSegment>();
  detail::initialize_segment(*again, 1, 1, "host", "host", 0100666, 1);
  EXPECT_EQ(again->mode, 0666u);  // permission bits only
}

// Text fields hold printable ASCII, cut to fit and NUL-terminated: a process name of other
// bytes is stored as '?'s, and a field something else wrote is refused when read.
TEST(SharedBudgetSegmentTest, TextFieldsAreCutToFitAndHoldOnlyPrintableASCII) {
  char field[8];
  detail::copy_text(field, sizeof(field), "h\xc3\xa9llo world");
  EXPECT_STREQ(field, "h??llo ");
  std::string text;
  EXPECT_TRUE(detail::read_text(field, sizeof(field), text));
  EXPECT_EQ(text, "h??llo ");
  detail::copy_text(field, sizeof(field), "");
  EXPECT_TRUE(detail::read_text(field, sizeof(field), text));
  EXPECT_EQ(text, "");
  std::memset(field, 'x', sizeof(field));  // no NUL
  EXPECT_FALSE(detail::read_text(field, sizeof(field), text));
  std::memcpy(field, "a\tb", 4);
  EXPECT_FALSE(detail::read_text(field, sizeof(field), text));
}

TEST(SharedBudgetSegmentTest, ABudgetsObjectIsNamedAfterIt) {
  EXPECT_EQ(detail::budget_object_name("kv-1.a_b"), "vkv-budget-kv-1.a_b");
  EXPECT_THROW(detail::budget_object_name("a/b"), InvalidArgument);
  EXPECT_THROW(detail::budget_object_name(""), InvalidArgument);
  EXPECT_EQ(detail::budget_description("kv"), "shared budget 'kv'");
  EXPECT_EQ(detail::budget_description(""), "the shared budget");
  EXPECT_NE(error_of([] { detail::open_budget_object("no-such-budget-here"); }).find("does not exist"),
            std::string::npos);
}

}  // namespace
}  // namespace vkv
