// BlockBacking with large pages (config.large_page_size) on the host backend: a run of fresh
// pages takes as many large pages as fit from its start and single pages for the rest; a
// large page's unused pages stay parked while any of its pages is held, and go back with
// the last one; a parked or pending page backed again reads zeros; a budget with no room
// for a large page backs with single pages; sizes that are not whole pages are refused.
#include <gtest/gtest.h>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::kHostTestPageBytes;

constexpr std::size_t kPage = kHostTestPageBytes;

// Block b on page b; large pages of `large` pages.
BlockBackingConfig one_block_a_page(std::size_t large, std::size_t num_blocks = 24) {
  BlockBackingConfig config = testing::one_run(num_blocks, kPage);
  config.large_page_size = large * kPage;
  return config;
}

std::shared_ptr<Backend> host() { return std::make_shared<HostBackend>(kPage); }

TEST(BlockLargePages, ARunTakesLargePagesFromItsStartAndSinglePagesForTheRest) {
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, host());
  const BackendStats before = backing.stats().backend;
  ASSERT_EQ(backing.back(7), 7u);  // pages 1-7: a large page 1-4, then 5, 6, 7
  const BackendStats after = backing.stats().backend;
  EXPECT_EQ(after.create.calls - before.create.calls, 4u);
  EXPECT_EQ(after.map.calls - before.map.calls, 2u);
  const std::int64_t five = 5;
  backing.release(&five, 1, 0);  // a single page: back at once
  EXPECT_EQ(backing.stats().pages_held, 7u);
  EXPECT_EQ(backing.stats().pages_parked, 0u);
  ASSERT_EQ(backing.back(12), 6u);  // 5 alone, then 8-12: a large page 8-11 and 12
  EXPECT_EQ(backing.stats().backend.map.calls - after.map.calls, 3u);
  backing.check_invariants();
}

TEST(BlockLargePages, ItsPagesStayParkedUntilNoBlockIsOnAnyAndThenGoBackTogether) {
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(8), 8u);  // large pages 1-4 and 5-8
  for (std::size_t b = 1; b <= 8; ++b) testing::fill_block(backing, b, static_cast<std::uint8_t>(b));
  const std::uint64_t released_before = backing.stats().backend.release.units;
  const std::int64_t some[] = {1, 2, 3};
  EXPECT_EQ(backing.release(some, 3, 0), 3 * kPage);  // no block on them any more...
  BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_parked, 3u);  // ...but block 4 keeps their large page
  EXPECT_EQ(stats.pages_held, 6u);
  EXPECT_EQ(stats.backend.release.units, released_before);
  backing.check_invariants();
  const std::int64_t four = 4;
  EXPECT_EQ(backing.release(&four, 1, 0), kPage);
  stats = backing.stats();
  EXPECT_EQ(stats.pages_parked + stats.pages_pending, 0u);
  EXPECT_EQ(stats.backend.release.units - released_before, 4u);
  for (std::size_t b = 5; b <= 8; ++b)
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(kPage, b)) << "block " << b;
  backing.check_invariants();
}

TEST(BlockLargePages, AParkedPageBackedAgainReadsZeros) {
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, host());
  ASSERT_EQ(backing.back(4), 4u);
  for (std::size_t b = 1; b <= 4; ++b) testing::fill_block(backing, b, 0xab);
  const std::int64_t two = 2;
  backing.release(&two, 1, 0);
  ASSERT_EQ(backing.stats().pages_parked, 1u);
  const std::uint64_t created = backing.stats().backend.create.calls;
  ASSERT_EQ(backing.back(4), 1u);  // block 2, on its parked page: no page created
  EXPECT_EQ(backing.stats().backend.create.calls, created);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 2)));
  EXPECT_EQ(backing.stats().pages_parked, 0u);
  backing.check_invariants();
}

// The deferred host backend with its stream held: released pages wait for their event.
TEST(BlockLargePages, APendingLargePageWithOnePageBackedAgainParksTheRest) {
  auto deferred = std::make_shared<HostBackend>(kPage, HostExecution::deferred);
  BlockBacking backing(one_block_a_page(4), nullptr, std::nullopt, deferred);
  ASSERT_EQ(backing.back(4), 4u);
  testing::hold_stream(*deferred, 0, std::chrono::seconds(1));  // longer than a loaded machine takes to the back
  const std::int64_t all[] = {1, 2, 3, 4};
  backing.release(all, 4, 0);  // the event behind the held stream is not done yet
  ASSERT_EQ(backing.stats().pages_pending, 4u);
  ASSERT_EQ(backing.back_some(1).size(), 1u);  // block 1 takes its page back; 2-4 park
  BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_pending, 0u);
  EXPECT_EQ(stats.pages_parked, 3u);
  backing.check_invariants();
  deferred->synchronize(0);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 1)));
  const std::int64_t one = 1;
  backing.release(&one, 1, 0);
  deferred->synchronize(0);
  backing.back(0);  // gives back what its readers are done with
  stats = backing.stats();
  EXPECT_EQ(stats.pages_parked + stats.pages_pending + stats.pages_held, 1u);  // page 0 alone
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
