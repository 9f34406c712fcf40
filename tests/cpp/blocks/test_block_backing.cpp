// BlockBacking's calls on the host backend: backing and releasing, page counts (a page two
// blocks share goes back after both; how many blocks release within a bound), states,
// permanent blocks, zeros on pages backed anew, the scratch page, refusals that name the
// value, and shortages of the budget (fewer blocks; a failed call changes nothing).
#include <gtest/gtest.h>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::block_bytes;
using testing::contains;
using testing::fill_block;
using testing::kHostTestPageBytes;
using testing::message_of;
using testing::one_run;

constexpr std::size_t kPage = kHostTestPageBytes;

std::shared_ptr<Backend> host() { return std::make_shared<HostBackend>(kPage); }

TEST(BlockBacking, BacksTheLowestBlocksAndMarksThemBacked) {
  BlockBacking backing(one_run(16, kPage / 2), nullptr, std::nullopt, host());
  EXPECT_EQ(backing.reserved_bytes(), 8 * kPage);
  EXPECT_TRUE(backing.is_backed(0));  // permanent
  EXPECT_EQ(backing.backed_blocks(), 0u);
  EXPECT_EQ(backing.back(3), 3u);
  for (std::size_t b = 0; b < 16; ++b) {
    EXPECT_EQ(backing.is_backed(b), b <= 3) << b;
    EXPECT_EQ(backing.states()[b], b <= 3 ? kBacked : kUnbacked) << b;
  }
  EXPECT_EQ(backing.stats().pages_held, 2u);  // blocks 0-3 on pages 0 and 1
  EXPECT_EQ(backing.back(3), 0u);             // there already
  EXPECT_EQ(backing.back(2), 0u);             // back() never releases
  EXPECT_EQ(backing.back(1000), 12u);         // every non-permanent block
  EXPECT_EQ(backing.backed_blocks(), 15u);
  backing.check_invariants();
}

TEST(BlockBacking, APageTwoBlocksShareGoesBackOnlyAfterBoth) {
  BlockBacking backing(one_run(8, kPage / 2), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(5), 5u);  // blocks 1-5: pages 0 (with block 0), 1, 2
  const std::int64_t two = 2, three = 3, five = 5;
  EXPECT_EQ(backing.release(&two, 1, 0), 0u);  // block 3 is still on page 1
  EXPECT_EQ(backing.mapped_pages(2), 1u);
  EXPECT_EQ(backing.stats().pages_held, 3u);
  EXPECT_EQ(backing.release(&three, 1, 0), kPage);  // now page 1 goes back
  EXPECT_EQ(backing.mapped_pages(2), 0u);
  EXPECT_EQ(backing.stats().pages_held, 2u);
  EXPECT_EQ(backing.release(&five, 1, 0), 0u);  // block 4 keeps page 2
  EXPECT_EQ(backing.stats().pages_held, 2u);
  EXPECT_EQ(backing.stats().pages_pending, 0u);  // the host backend's events are complete at once
  backing.check_invariants();
}

TEST(BlockBacking, ReleasableWithinCountsThePagesAPrefixGivesBack) {
  // Two blocks a page in each of two buffers: a page pair goes back with the second of its blocks.
  BlockBacking backing(testing::block_config(16, {{0, kPage / 2, kPage / 2}, {8 * kPage, kPage / 2, kPage / 2}}),
                       nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(6), 6u);  // blocks 0-6: block 6 alone on its pages
  const std::vector<std::int64_t> highest = {6, 5, 4, 3, 2};
  EXPECT_EQ(backing.releasable_within(highest.data(), 5, 2 * kPage - 1), 0u);  // block 6 frees 2 pages
  EXPECT_EQ(backing.releasable_within(highest.data(), 5, 3 * kPage), 2u);      // 6, 5: block 4 would free 2 more
  EXPECT_EQ(backing.releasable_within(highest.data(), 5, 5 * kPage), 4u);      // block 3 frees nothing, 2 frees 2
  EXPECT_EQ(backing.releasable_within(highest.data(), 5, 6 * kPage), 5u);
  const std::vector<std::int64_t> halves = {5, 3};  // each leaves its partner backed: frees nothing
  EXPECT_EQ(backing.releasable_within(halves.data(), 2, 0), 2u);
  EXPECT_EQ(backing.stats().pages_held, 8u);                    // a question: nothing released
  EXPECT_EQ(backing.release(highest.data(), 4, 0), 4 * kPage);  // release() agrees
  const std::vector<std::int64_t> refused = {1, 1};
  const std::string message =
      message_of<InvalidArgument>([&] { backing.releasable_within(refused.data(), refused.size(), kPage); });
  EXPECT_TRUE(contains(message, "releasable_within: block 1 is listed twice")) << message;
  backing.check_invariants();
}

TEST(BlockBacking, BackingPrefersBlocksOnPagesBackedAlready) {
  BlockBacking backing(one_run(16, kPage / 4), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(7), 7u);  // blocks 0-7: pages 0, 1
  const std::int64_t released[] = {2, 5, 6, 7};
  backing.release(released, 4, 0);  // page 1 keeps block 4; blocks 5-7 there cost nothing
  std::vector<std::int64_t> ids = backing.back_some(4);
  EXPECT_EQ(ids, (std::vector<std::int64_t>{2, 5, 6, 7}));  // holes in backed pages first, then by id
  ids = backing.back_some(1);
  EXPECT_EQ(ids, (std::vector<std::int64_t>{8}));
  BlockBackingConfig lowest = one_run(16, kPage / 4);
  lowest.prefer_costless = false;
  BlockBacking plain(lowest, nullptr, std::nullopt, host());
  ASSERT_EQ(plain.back(7), 7u);
  const std::int64_t some[] = {2, 5};
  plain.release(some, 2, 0);
  EXPECT_EQ(plain.back_some(2), (std::vector<std::int64_t>{2, 5}));
  backing.check_invariants();
  plain.check_invariants();
}

TEST(BlockBacking, PagesBackedAnewReadAsZerosWhilePagesKeptKeepTheirBytes) {
  BlockBacking backing(one_run(8, kPage / 2), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(4), 4u);  // blocks 0-4: pages 0, 1, 2
  for (std::size_t b = 1; b <= 4; ++b) fill_block(backing, b, static_cast<std::uint8_t>(10 + b));
  const std::int64_t released[] = {2, 3, 4};
  backing.release(released, 3, 0);  // page 1 goes, page 2 keeps nobody: goes too; page 0 stays (0, 1)
  EXPECT_EQ(backing.back(4), 3u);
  EXPECT_TRUE(testing::all_zero(block_bytes(backing, 2)));
  EXPECT_TRUE(testing::all_zero(block_bytes(backing, 4)));
  EXPECT_EQ(block_bytes(backing, 1), std::vector<std::uint8_t>(kPage / 2, 11));  // never left
  backing.check_invariants();
}

TEST(BlockBacking, SharedStatesAreReleasedOnlyWhenReclaiming) {
  std::vector<std::uint8_t> states(8, 0xee);
  BlockBacking backing(one_run(8, kPage / 2), states.data(), std::nullopt, host());
  EXPECT_EQ(states, (std::vector<std::uint8_t>{kBacked, 0, 0, 0, 0, 0, 0, 0}));  // written at construction
  ASSERT_EQ(backing.back(3), 3u);
  states[1] = kInPool;  // the engine's pool has them
  states[2] = kInPool;
  const std::int64_t one = 1;
  std::string message = message_of<InvalidArgument>([&] { backing.release(&one, 1, 0); });
  EXPECT_TRUE(contains(message, "block 1 is IN_POOL, not RECLAIMING")) << message;
  states[1] = kReclaiming;
  EXPECT_EQ(backing.release(&one, 1, 0), 0u);
  EXPECT_EQ(states[1], kUnbacked);
  EXPECT_EQ(states[2], kInPool);  // the engine's to change
  backing.check_invariants();
}

TEST(BlockBacking, RefusalsNameTheBlockAndChangeNothing) {
  BlockBacking backing(one_run(8, kPage / 2), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(4), 4u);
  auto refused = [&](std::vector<std::int64_t> ids) {
    return message_of<InvalidArgument>([&] { backing.release(ids.data(), ids.size(), 0); });
  };
  EXPECT_TRUE(contains(refused({1, 8}), "block 8 (blocks[1]) is out of range: num_blocks = 8"));
  EXPECT_TRUE(contains(refused({-1}), "block -1 (blocks[0]) is out of range"));
  EXPECT_TRUE(contains(refused({0}), "block 0 is permanent"));
  EXPECT_TRUE(contains(refused({1, 2, 1}), "block 1 is listed twice"));
  EXPECT_TRUE(contains(refused({1, 6}), "block 6 is not backed"));
  EXPECT_EQ(backing.backed_blocks(), 4u);  // none of those released anything
  for (std::size_t b = 0; b <= 4; ++b) EXPECT_TRUE(backing.is_backed(b));
  EXPECT_TRUE(contains(message_of<InvalidArgument>([&] { backing.is_backed(8); }), "block 8 is out of range"));
  backing.check_invariants();
}

TEST(BlockBacking, RefusesABadConfigNamingTheField) {
  auto refused = [](BlockBackingConfig config) {
    return message_of<InvalidArgument>([&] { BlockBacking(config, nullptr, std::nullopt, host()); });
  };
  BlockBackingConfig config = one_run(8, 100);
  config.permanent_blocks = {8};
  EXPECT_TRUE(contains(refused(config), "permanent_blocks[0] = 8 is out of range"));
  config.permanent_blocks = {1, 1};
  EXPECT_TRUE(contains(refused(config), "permanent_blocks lists block 1 twice"));
  config = one_run(8, 100);
  config.memory_budget = 100;
  EXPECT_TRUE(contains(refused(config), "memory_budget = 100 is less than one page"));
  config = one_run(8, 100);
  config.shared_budget_cap = kPage;
  EXPECT_TRUE(contains(refused(config), "shared_budget_cap = 65536 needs a shared_budget"));
  config = one_run(8, 100);
  config.page_size = 2 * kPage;
  EXPECT_TRUE(contains(refused(config), "page_size = 131072 differs from the given backend's page size 65536"));
  std::uint8_t states[8] = {};
  const std::string message = message_of<InvalidArgument>([&] {
    BlockBacking(one_run(8, 100), states, BlockAgreement{"vkv-test-blocks-refused", 1, 2}, host());
  });
  EXPECT_TRUE(contains(message, "shared states are worker rank 0's alone (this is rank 1)")) << message;
}

TEST(BlockBacking, AShortBudgetBacksTheLongestPrefixThatFits) {
  BlockBackingConfig config = one_run(32, kPage / 2);
  config.memory_budget = 3 * kPage;
  BlockBacking backing(config, nullptr, std::nullopt, host());
  EXPECT_EQ(backing.back(10), 5u);  // blocks 0-5 fill 3 pages
  EXPECT_EQ(backing.stats().shortages, 1u);
  EXPECT_EQ(backing.back(10), 0u);  // still no room: nothing changes
  const std::int64_t released[] = {4, 5};
  backing.release(released, 2, 0);  // page 2 goes back
  EXPECT_EQ(backing.back_some(4), (std::vector<std::int64_t>{4, 5}));
  backing.check_invariants();
}

TEST(BlockBacking, PermanentBlocksThatDoNotFitRefuseToStart) {
  BlockBackingConfig config = one_run(8, 2 * kPage);
  config.memory_budget = kPage;
  const std::string message = message_of<OutOfMemory>([&] { BlockBacking(config, nullptr, std::nullopt, host()); });
  EXPECT_TRUE(contains(message, "no room for the 1 permanent blocks")) << message;
}

TEST(BlockBacking, TheScratchPageTakesWritesToUnbackedBlocks) {
  BlockBackingConfig config = one_run(8, kPage);
  config.scratch_page = true;
  BlockBacking backing(config, nullptr, std::nullopt, host());
  fill_block(backing, 5, 7);  // no fault: the scratch page is under it
  ASSERT_EQ(backing.back(5), 5u);
  EXPECT_TRUE(testing::all_zero(block_bytes(backing, 5)));  // a real page now, zeros
  fill_block(backing, 5, 9);
  const std::int64_t five = 5;
  backing.release(&five, 1, 0);
  fill_block(backing, 5, 3);  // the scratch page again
  ASSERT_EQ(backing.back(5), 1u);
  EXPECT_TRUE(testing::all_zero(block_bytes(backing, 5)));
  backing.check_invariants();
}

TEST(BlockBacking, StatsCountBlocksPagesAndBackendCalls) {
  BlockBacking backing(one_run(16, kPage), nullptr, std::nullopt, host());
  backing.back(4);
  const std::int64_t released[] = {3, 4};
  backing.release(released, 2, 0);
  const BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.num_blocks, 16u);
  EXPECT_EQ(stats.page_bytes, kPage);
  EXPECT_EQ(stats.permanent_blocks, 1u);
  EXPECT_EQ(stats.backed_blocks, 2u);
  EXPECT_EQ(stats.pages_held, 3u);
  EXPECT_EQ(stats.bytes_held(), 3 * kPage);
  EXPECT_EQ(stats.blocks_backed, 5u);  // the permanent one too
  EXPECT_EQ(stats.blocks_released, 2u);
  EXPECT_EQ(stats.backs.units, 4u);  // pages mapped by back() (not the permanent block's)
  EXPECT_EQ(stats.releases.units, 2u);
  EXPECT_EQ(stats.backend.map.units, 5u);
  EXPECT_EQ(stats.backend.unmap.units, 2u);
}

}  // namespace
}  // namespace vkv
