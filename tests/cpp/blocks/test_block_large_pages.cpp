// BlockBacking with large pages (config.large_page_size) on the host backend: the
// reservation is cut into chunks of a large page each; a chunk with nothing mapped is mapped
// whole, its pages not asked for parked, and the next backs take them without creating or
// mapping anything; other pages go page by page (a chunk the reservation cuts, a budget
// without room for a large page); a large page's unused pages stay parked while any of its
// pages is held, and go back with the last one; a parked or pending page backed again reads
// zeros; sizes that are not whole pages are refused.
#include <gtest/gtest.h>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::kHostTestPageBytes;

constexpr std::size_t kPage = kHostTestPageBytes;

// Block b on page b (block 0 permanent); large pages of `large` pages.
BlockBackingConfig one_block_a_page(std::size_t large, std::size_t num_blocks = 24) {
  BlockBackingConfig config = testing::one_run(num_blocks, kPage);
  config.large_page_size = large * kPage;
  return config;
}

std::shared_ptr<Backend> host() { return std::make_shared<HostBackend>(kPage); }

TEST(BlockLargePages, AChunkWithNothingMappedIsMappedWholeAndTheNextBacksTakeItsOtherPages) {
  BlockBacking backing(one_block_a_page(4, 22), nullptr, std::nullopt, host());
  BlockBackingStats stats = backing.stats();  // block 0's chunk, pages 0-3: 1-3 parked
  EXPECT_EQ(stats.pages_held, 1u);
  EXPECT_EQ(stats.pages_parked, 3u);
  EXPECT_EQ(stats.backend.create.units, 4u);
  const BackendStats before = stats.backend;
  ASSERT_EQ(backing.back(3), 3u);  // blocks 1-3 on their parked pages
  stats = backing.stats();
  EXPECT_EQ(stats.backend.create.calls, before.create.calls);
  EXPECT_EQ(stats.backend.map.calls, before.map.calls);
  EXPECT_EQ(stats.pages_parked, 0u);
  ASSERT_EQ(backing.back(21), 18u);  // chunks 4-7 to 16-19 whole; 20 and 21 (the reservation cuts their chunk) alone
  stats = backing.stats();
  EXPECT_EQ(stats.backend.create.calls - before.create.calls, 6u);
  EXPECT_EQ(stats.backend.create.units - before.create.units, 18u);
  EXPECT_EQ(stats.backend.map.calls - before.map.calls, 5u);  // four large pages, then 20-21 in one call
  EXPECT_EQ(stats.pages_held, 22u);
  EXPECT_EQ(stats.pages_parked, 0u);
  for (std::size_t b = 1; b <= 21; ++b) EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, b))) << b;
  backing.check_invariants();
}

TEST(BlockLargePages, ItsPagesStayParkedUntilNoBlockIsOnAnyAndThenGoBackTogether) {
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(7), 7u);  // large pages 0-3 and 4-7
  for (std::size_t b = 1; b <= 7; ++b) testing::fill_block(backing, b, static_cast<std::uint8_t>(b));
  const std::uint64_t released_before = backing.stats().backend.release.units;
  const std::int64_t some[] = {4, 5, 6};
  EXPECT_EQ(backing.release(some, 3, 0), 3 * kPage);  // no block on them any more...
  BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_parked, 3u);  // ...but block 7 keeps their large page
  EXPECT_EQ(stats.pages_held, 5u);
  EXPECT_EQ(stats.backend.release.units, released_before);
  backing.check_invariants();
  const std::int64_t seven = 7;
  EXPECT_EQ(backing.release(&seven, 1, 0), kPage);
  stats = backing.stats();
  EXPECT_EQ(stats.pages_parked + stats.pages_pending, 0u);
  EXPECT_EQ(stats.backend.release.units - released_before, 4u);
  for (std::size_t b = 1; b <= 3; ++b)
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(kPage, b)) << "block " << b;
  backing.check_invariants();
}

TEST(BlockLargePages, AParkedPageBackedAgainReadsZeros) {
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, host());
  testing::fill_block(backing, 2, 0xcd);  // on a parked page no block was ever backed on
  ASSERT_EQ(backing.back(3), 3u);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 2)));
  for (std::size_t b = 1; b <= 3; ++b) testing::fill_block(backing, b, 0xab);
  const std::int64_t two = 2;
  backing.release(&two, 1, 0);
  ASSERT_EQ(backing.stats().pages_parked, 1u);
  const std::uint64_t created = backing.stats().backend.create.calls;
  ASSERT_EQ(backing.back(3), 1u);  // block 2, on its parked page: no page created
  EXPECT_EQ(backing.stats().backend.create.calls, created);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 2)));
  EXPECT_EQ(backing.stats().pages_parked, 0u);
  backing.check_invariants();
}

// The deferred host backend with its stream held: released pages wait for their event.
TEST(BlockLargePages, APendingLargePageWithOnePageBackedAgainParksTheRest) {
  auto deferred = std::make_shared<HostBackend>(kPage, HostExecution::deferred);
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, deferred);
  ASSERT_EQ(backing.back(7), 7u);
  testing::hold_stream(*deferred, 0, std::chrono::seconds(1));  // longer than a loaded machine takes to the back
  const std::int64_t chunk[] = {4, 5, 6, 7};
  backing.release(chunk, 4, 0);  // the event behind the held stream is not done yet
  ASSERT_EQ(backing.stats().pages_pending, 4u);
  ASSERT_EQ(backing.back_some(1).size(), 1u);  // block 4 takes its page back; 5-7 park
  BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_pending, 0u);
  EXPECT_EQ(stats.pages_parked, 3u);
  backing.check_invariants();
  deferred->synchronize(0);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 4)));
  const std::int64_t four = 4;
  backing.release(&four, 1, 0);
  deferred->synchronize(0);
  backing.back(0);  // gives back what its readers are done with
  stats = backing.stats();
  EXPECT_EQ(stats.pages_parked + stats.pages_pending, 0u);
  EXPECT_EQ(stats.pages_held, 4u);  // blocks 0-3's large page
  backing.check_invariants();
}

// A chunk the budget has no room to map whole: its pages go one by one, cut out of the
// scratch large page under the chunk, whose other pages get the scratch page again.
TEST(BlockLargePages, AChunkWithoutRoomForALargePageIsCutOutOfItsScratchLargePage) {
  BlockBackingConfig config = one_block_a_page(4);
  config.scratch_page = true;
  config.memory_budget = 6 * kPage;  // block 0's large page and two more pages
  BlockBacking backing(config, nullptr, std::nullopt, host());
  const BackendStats before = backing.stats().backend;
  EXPECT_EQ(backing.back(10), 5u);  // 1-3 parked, then 4 and 5 alone
  const BackendStats after = backing.stats().backend;
  EXPECT_EQ(after.create.units - before.create.units, 2u);
  EXPECT_EQ(after.zero_backing.units - before.zero_backing.units, 2u);  // pages 6 and 7
  testing::fill_block(backing, 6, 0x5a);                                // lands in scratch
  for (std::size_t b = 1; b <= 5; ++b) EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, b))) << b;
  backing.check_invariants();
}

TEST(BlockLargePages, ABudgetWithoutRoomForALargePageBacksWithSinglePages) {
  BlockBackingConfig config = one_block_a_page(4);
  config.memory_budget = 6 * kPage;  // page 0, one large page and one more page
  BlockBacking backing(config, nullptr, std::nullopt, host());
  EXPECT_EQ(backing.back(10), 5u);
  EXPECT_EQ(backing.stats().pages_held, 6u);
  backing.check_invariants();
  const std::int64_t five = 5;
  backing.release(&five, 1, 0);
  EXPECT_EQ(backing.back_some(2).size(), 1u);
  backing.check_invariants();
}

TEST(BlockLargePages, SizesThatAreNotWholePagesOrTooSmallAreRefusedByName) {
  for (std::size_t size : {kPage, 3 * kPage / 2, 3 * kPage + 1}) {
    BlockBackingConfig config = one_block_a_page(1);
    config.large_page_size = size;
    const std::string message =
        testing::message_of<InvalidArgument>([&] { BlockBacking backing(config, nullptr, std::nullopt, host()); });
    EXPECT_TRUE(testing::contains(message, "large_page_size = " + std::to_string(size))) << message;
  }
}

}  // namespace
}  // namespace vkv
