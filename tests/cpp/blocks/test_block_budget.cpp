// The layer as a member of a shared budget: its cap bounds what it backs, another member's
// floor is kept from it, its released pages go back to the budget, an ask answered within
// its bytes keeps the member's floor held, and when it runs short it asks the other
// members for the pages their requests do not claim.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::kHostTestPageBytes;

constexpr std::size_t kPage = kHostTestPageBytes;

// A budget name no other test (or process) uses; removed at the end of the test.
class BudgetName {
 public:
  BudgetName() {
    static std::atomic<int> counter{0};
    name_ = "test-blocks-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  ~BudgetName() { SharedBudget::remove(name_); }
  const std::string& str() const { return name_; }

 private:
  std::string name_;
};

// Two blocks a page, in budget `name`.
BlockBackingConfig member(const std::string& name, std::size_t floor_pages = 0, std::size_t cap_pages = 0) {
  BlockBackingConfig config = testing::one_run(64, kPage / 2);
  config.shared_budget = name;
  config.shared_budget_floor = floor_pages * kPage;
  config.shared_budget_cap = cap_pages * kPage;
  config.shared_budget_label = "blocks";
  return config;
}

std::size_t held_pages(const SharedBudget& budget) {
  std::size_t held = 0;
  for (const SharedBudgetMember& member : budget.stats().members) held += member.held_bytes;
  return held / kPage;
}

std::size_t held_bytes(const SharedBudget& budget, const std::string& label) {
  for (const SharedBudgetMember& member : budget.stats().members)
    if (member.label == label) return member.held_bytes;
  return 0;
}

TEST(BlockBudget, ACapBoundsWhatIsBackedAndReleasedPagesGoBack) {
  const BudgetName name;
  const SharedBudget budget = SharedBudget::create(name.str(), 16 * kPage, Device::parse("cpu"));
  BlockBacking backing(member(name.str(), 0, /*cap=*/4), nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  EXPECT_EQ(backing.back(100), 7u);  // blocks 0-7: the cap's 4 pages
  EXPECT_EQ(held_pages(budget), 4u);
  const std::int64_t released[] = {4, 5, 6, 7};
  EXPECT_EQ(backing.release(released, 4, 0), 2 * kPage);
  EXPECT_EQ(held_pages(budget), 2u);
  EXPECT_EQ(budget.stats().members.at(0).label, "blocks");
  backing.check_invariants();
}

TEST(BlockBudget, AnotherMembersFloorIsKeptFromTheLayer) {
  const BudgetName name;
  const SharedBudget budget = SharedBudget::create(name.str(), 12 * kPage, Device::parse("cpu"));
  BlockBacking floored(member(name.str(), /*floor=*/8), nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  BlockBacking other(member(name.str()), nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  // 12 pages: the floored member holds 1 and keeps 7 more; the other gets the remaining 4.
  EXPECT_EQ(other.back(100), 7u);
  EXPECT_EQ(floored.back(100), 15u);  // its floor's 8 pages
  EXPECT_EQ(held_pages(budget), 12u);
  floored.check_invariants();
  other.check_invariants();
}

TEST(BlockBudget, AnAskAnsweredWithinItsBytesKeepsAFloorThatIsNoWholeNumberOfPages) {
  // An engine answers for the floored member, whose blocks (two a page) go back a page at a
  // time: its floor of 2.5 pages can only be held as 3.
  const BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 8 * kPage, Device::parse("cpu"));
  BlockBackingConfig floored_config = member(name.str());
  floored_config.shared_budget_floor = 5 * kPage / 2;
  BlockBacking floored(floored_config, nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  BlockBackingConfig asker_config = member(name.str());
  asker_config.shared_budget_label = "asker";
  BlockBacking asker(asker_config, nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  ASSERT_EQ(floored.back(10), 10u);          // blocks 0-10 on pages 0-5: block 10 alone on page 5
  const std::size_t spare = 10 * kPage / 2;  // every block but the permanent one is free
  budget.speak_for("blocks", {spare, 0, 0, true});
  budget.speak_for("asker", {0, 8 * kPage, 0, true});  // it wants the whole budget
  const SharedBudgetShare share = budget.speak_for("blocks", {spare, 0, 0, true});
  EXPECT_EQ(share.give_bytes, 7 * kPage / 2);  // down to its floor exactly: 7 blocks' bytes
  // The 7 highest blocks would give back 4 pages (block 4 takes page 2 with it), below the
  // floor; within the ask's bytes, 6 of them go.
  const std::vector<std::int64_t> highest = {10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
  const std::size_t count = floored.releasable_within(highest.data(), highest.size(), share.give_bytes);
  EXPECT_EQ(count, 6u);
  EXPECT_EQ(floored.release(highest.data(), count, 0), 3 * kPage);
  EXPECT_EQ(held_bytes(budget, "blocks"), 3 * kPage);  // above the floor: the closest whole page
  // Asked again for the half page it holds above its floor: any block it gives frees a page.
  const SharedBudgetShare again = budget.speak_for("blocks", {4 * kPage / 2, 0, 0, true});
  EXPECT_EQ(again.give_bytes, kPage / 2);
  const std::vector<std::int64_t> left = {4, 3, 2, 1};
  EXPECT_EQ(floored.releasable_within(left.data(), left.size(), again.give_bytes), 0u);
  floored.check_invariants();
  asker.check_invariants();
}

TEST(BlockBudget, AShortLayerAsksTheOthersForTheirUnclaimedPages) {
  const BudgetName name;
  const SharedBudget budget = SharedBudget::create(name.str(), 8 * kPage, Device::parse("cpu"));
  auto host = std::make_shared<HostBackend>(kPage);
  CacheConfig config = testing::small_config(LayoutKind::interleaved, kPage);  // 2 KiB a token: 32 a page
  config.shared_budget = name.str();
  KvCache cache(config, host);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[slot] = 6 * 32;
  cache.step(seq_lens);    // 6 pages
  cache.free_reqid(slot);  // kept by the cache, claimed by nobody
  BlockBacking backing(member(name.str()), nullptr, std::nullopt, std::make_shared<HostBackend>(kPage));
  EXPECT_GT(backing.back(100), 3u);  // more than the 2 free pages hold: the cache gave some back
  EXPECT_GE(backing.stats().budget_asks.calls, 1u);
  EXPECT_LE(held_pages(budget), 8u);
  backing.check_invariants();
  cache.check_invariants();
}

}  // namespace
}  // namespace vkv
