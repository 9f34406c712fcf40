// BackgroundPlanner alone, on the host backend: which unit the mapper does next, most
// urgent first, from the slots' state as the cache would leave it.
#include <gtest/gtest.h>

#include "cache/background_planner.h"
#include "cache/slot_parts.h"

namespace vkv {
namespace {

using detail::BackgroundUnit;
using Kind = detail::BackgroundUnit::Kind;

class BackgroundPlannerTest : public testing::ReaderParts {
 protected:
  BackgroundPlannerTest() {
    config_.zero_page = false;  // the cases that need it turn it on
    config_.lookahead_tokens = 300;
  }
  std::size_t tokens_per_page() const { return page() / layout_.token_bytes(); }
  BackgroundUnit next(std::size_t eager_tokens = 0, std::size_t watermark = 0) {
    return planner_.next(/*settle_events=*/true, eager_tokens, watermark);
  }

  detail::BackgroundPlanner planner_{cache_, mappings_, readers_};
};

TEST_F(BackgroundPlannerTest, AnIdleCacheHasNothingToDo) { EXPECT_EQ(next().kind, Kind::none); }

TEST_F(BackgroundPlannerTest, AnAllocatedSlotGrowsByItsLookahead) {
  slots_.mark_allocated(2, 0);
  grow(2, 1);
  slots_.set_tokens(2, tokens_per_page() / 2, 1);
  const BackgroundUnit unit = next();
  EXPECT_EQ(unit.kind, Kind::grow);
  EXPECT_EQ(unit.slot, 2u);
  EXPECT_EQ(unit.pages, layout_.pages_for_tokens(tokens_per_page() / 2 + 300));
}

TEST_F(BackgroundPlannerTest, ABusySlotIsLeftToTheUnitAtWorkOnIt) {
  slots_.mark_allocated(2, 0);
  slots_.set_tokens(2, 10, slots_[2].claimed);
  slots_.mark_busy(2, 0);
  EXPECT_EQ(next().kind, Kind::none);
  slots_.mark_not_busy(2);
}

TEST_F(BackgroundPlannerTest, ExpectedTokensGrowAfterEverySlotsLookahead) {
  slots_.mark_allocated(0, 0);
  slots_.set_expected_tokens(0, 5 * tokens_per_page());
  const BackgroundUnit unit = next();
  EXPECT_EQ(unit.kind, Kind::grow);
  EXPECT_EQ(unit.slot, 0u);
  EXPECT_EQ(unit.pages, 5u);
}

TEST_F(BackgroundPlannerTest, EagerAllocationGrowsTheSlotHandedOutNext) {
  const BackgroundUnit unit = next(/*eager_tokens=*/3 * tokens_per_page());
  EXPECT_EQ(unit.kind, Kind::grow);
  EXPECT_EQ(unit.slot, slots_.next_to_allocate());
  EXPECT_EQ(unit.pages, 3u);
}

TEST_F(BackgroundPlannerTest, BelowTheWatermarkAFreedSlotsPagesGo) {
  slots_.mark_allocated(1, 0);
  grow(1, 3);
  slots_.mark_freed(1, 0);
  EXPECT_EQ(next().kind, Kind::none);  // enough obtainable pages
  const BackgroundUnit unit = next(0, /*watermark=*/1000);
  EXPECT_EQ(unit.kind, Kind::shrink);
  EXPECT_EQ(unit.slot, 1u);
  EXPECT_EQ(unit.pages, 3u);
}

TEST_F(BackgroundPlannerTest, AFreedSlotOwedAZeroFillIsLeftAlone) {
  slots_.mark_allocated(1, 0);
  grow(1, 3);
  slots_.set_tokens(1, slots_[1].seq_len, 3);
  readers_.defer_fill(1, 0);
  slots_.mark_freed(1, 0);
  slots_.set_tokens(1, slots_[1].seq_len, 0);
  EXPECT_EQ(next(0, /*watermark=*/1000).kind, Kind::none);
  readers_.enqueue_deferred_fills();
  EXPECT_EQ(next(0, /*watermark=*/1000).kind, Kind::shrink);
}

TEST_F(BackgroundPlannerTest, WithZeroBackingSlotsNotHandedOutAreBackedTheNextOneFirst) {
  config_.zero_page = true;
  slots_.set_backed_end(0, layout_.pages_per_slot());
  const BackgroundUnit unit = next();
  EXPECT_EQ(unit.kind, Kind::cover);
  EXPECT_EQ(unit.slot, 1u);
  const std::size_t per_unit =
      std::max<std::size_t>(1, detail::BackgroundPlanner::kPagesPerCoverUnit / layout_.num_regions());
  EXPECT_EQ(unit.pages, std::min(layout_.pages_per_slot(), per_unit));
}

TEST_F(BackgroundPlannerTest, WithZeroBackingFreePagesAreCreatedForSlotsInReach) {
  config_.zero_page = true;
  for (std::size_t s = 0; s < slots_.size(); ++s) slots_.set_backed_end(s, layout_.pages_per_slot());
  slots_.mark_allocated(0, windows_.steps());
  slots_.set_tokens(0, slots_[0].seq_len, 1);  // step() swaps its next page in itself
  const BackgroundUnit unit = next();
  EXPECT_EQ(unit.kind, Kind::create);
  EXPECT_EQ(unit.pages, std::min(layout_.num_regions(), detail::BackgroundPlanner::kPagesPerUnit));
  slots_.set_tokens(0, slots_[0].seq_len, 0);
}

TEST_F(BackgroundPlannerTest, WithAScratchPageNothingIsMappedAheadOrReclaimed) {
  config_.zero_page = true;
  config_.scratch_page = true;
  slots_.mark_allocated(2, 0);
  slots_.set_tokens(2, 10, slots_[2].claimed);
  slots_.mark_allocated(1, 0);
  grow(1, 3);
  slots_.mark_freed(1, 0);
  for (std::size_t s = 0; s < slots_.size(); ++s) slots_.set_backed_end(s, layout_.pages_per_slot());
  EXPECT_EQ(next(3 * tokens_per_page(), /*watermark=*/1000).kind, Kind::none);
  config_.scratch_page = false;
}

}  // namespace
}  // namespace vkv
