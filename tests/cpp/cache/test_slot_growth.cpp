// SlotGrowth alone, on the host backend: step()'s way and the mapper's way of mapping
// fresh pages at the end of slots, each all or nothing under every injected failure,
// pages reclaimed from slots above their claims, large pages at whole spans.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "cache/background_planner.h"
#include "cache/slot_growth.h"
#include "cache/slot_parts.h"

namespace vkv {
namespace {

class SlotGrowthTest : public testing::SourceParts {
 protected:
  explicit SlotGrowthTest(std::size_t large_page_pages = 0) : SourceParts(large_page_pages) {}
  std::size_t regions() const { return layout_.num_regions(); }
  // step()'s way, as a call does it: undone unless it succeeds.
  void map(std::vector<std::size_t> claims) {
    std::size_t missing = 0;
    for (std::size_t s = 0; s < slots_.size(); ++s)
      missing += claims[s] > slots_[s].mapped() ? (claims[s] - slots_[s].mapped()) * regions() : 0;
    detail::UndoLog undo([this] { backend_->synchronize(0); });
    growth_.map_missing(claims, {}, missing, 0, undo, "step");
    undo.commit();
  }
  bool grow_ahead(std::size_t slot, std::size_t target) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool grew = growth_.grow_ahead(lock, slot, target, 0);
    EXPECT_TRUE(lock.owns_lock());
    return grew;
  }
  void expect_slot_reads_zeros(std::size_t slot) {
    for (std::size_t r = 0; r < regions(); ++r)
      EXPECT_TRUE(testing::all_zero(
          testing::read_bytes(*backend_, mappings_.address(r, slot, 0), slots_[slot].mapped() * page())));
  }

  std::condition_variable& unit_done_ = cache_.unit_done;
  std::size_t& in_flight_ = cache_.in_flight_pages;
  detail::SlotGrowth growth_{cache_, mappings_, readers_, source_};
};

TEST_F(SlotGrowthTest, StepsWayMapsEveryRegionWithItsBooks) {
  map({2, 0, 3, 0});
  EXPECT_EQ(slots_[0].mapped(), 2u);
  EXPECT_EQ(slots_[2].mapped(), 3u);
  for (const auto& region : slots_[2].pages) EXPECT_EQ(region.size(), 3u);
  EXPECT_EQ(slots_[2].backed_end, 3u);  // zero backing follows
  expect_slot_reads_zeros(2);
  EXPECT_EQ(pool_.handed_out_pages(), 5 * regions());
}

TEST_F(SlotGrowthTest, AShortageThrowsOutOfMemoryNamingTheCallAndChangesNothing) {
  const std::size_t slot_pages = layout_.pages_per_slot();
  try {
    map({slot_pages, slot_pages, slot_pages, slot_pages});
    FAIL() << "mapped more than the budget";
  } catch (const OutOfMemory& error) {
    EXPECT_NE(std::string(error.what()).find("step needs"), std::string::npos) << error.what();
    EXPECT_EQ(error.missing_pages(), 4 * slot_pages * regions() - pool_.budget_pages());
  }
  for (const detail::Slot& slot : slots_) EXPECT_EQ(slot.mapped(), 0u);
  EXPECT_EQ(pool_.handed_out_pages(), 0u);
}

TEST_F(SlotGrowthTest, StepsWayReclaimsWhatSlotsMapAboveTheirClaims) {
  const std::size_t half = pool_.budget_pages() / regions() / 2;
  map({0, half + 1, 0, 0});  // slot 1 claims none of them
  map({half, 0, 0, 0});
  EXPECT_EQ(slots_[0].mapped(), half);
  EXPECT_LT(slots_[1].mapped(), half + 1);
  EXPECT_LE(pool_.created_pages(), pool_.budget_pages());
}

TEST_F(SlotGrowthTest, StepsWayIsAllOrNothingUnderEveryFailure) {
  for (std::size_t fail_at = 1;; ++fail_at) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    backend_->calls = 0;
    backend_->fail_at = fail_at;
    try {
      map({2, 0, 1, 0});
    } catch (const DriverError&) {
      backend_->fail_at = 0;
      for (const detail::Slot& slot : slots_) ASSERT_EQ(slot.mapped(), 0u);
      ASSERT_EQ(pool_.handed_out_pages(), 0u);
      ASSERT_EQ(slots_[0].backed_end, 0u);
      continue;
    }
    backend_->fail_at = 0;
    ASSERT_GT(fail_at, 1u);
    EXPECT_EQ(slots_[0].mapped(), 2u);
    break;
  }
}

TEST_F(SlotGrowthTest, TheMappersWayMapsAUnitAheadFromFreeMemory) {
  EXPECT_TRUE(grow_ahead(2, 5));
  const std::size_t per_unit = std::max<std::size_t>(1, detail::BackgroundPlanner::kPagesPerUnit / regions());
  EXPECT_EQ(slots_[2].mapped(), std::min<std::size_t>(5, per_unit));
  EXPECT_FALSE(slots_[2].busy());
  EXPECT_EQ(in_flight_, 0u);
  EXPECT_EQ(profile_.mapped_ahead().calls, 1u);
  EXPECT_EQ(profile_.mapped_ahead().units, slots_[2].mapped() * regions());
  expect_slot_reads_zeros(2);
}

TEST_F(SlotGrowthTest, AFailedMapperUnitGivesItsPagesBackOrStrandsThemUntilTheyUnmap) {
  for (std::size_t fail_at = 1;; ++fail_at) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    backend_->calls = 0;
    backend_->fail_at = fail_at;
    try {
      grow_ahead(1, 4);
    } catch (const DriverError&) {
      backend_->fail_at = 0;
      ASSERT_EQ(slots_[1].mapped(), 0u);
      ASSERT_FALSE(slots_[1].busy());
      ASSERT_EQ(in_flight_, 0u);
      ASSERT_EQ(pool_.handed_out_pages(), growth_.stranded_pages());
      growth_.unmap_stranded();
      ASSERT_EQ(growth_.stranded_pages(), 0u);
      ASSERT_EQ(pool_.handed_out_pages(), 0u);
      continue;
    }
    backend_->fail_at = 0;
    EXPECT_GT(slots_[1].mapped(), 0u);
    break;
  }
}

class SlotGrowthLargeTest : public SlotGrowthTest {
 protected:
  static constexpr std::size_t kSpan = 4;
  SlotGrowthLargeTest() : SlotGrowthTest(kSpan) {}
};

TEST_F(SlotGrowthLargeTest, BothWaysMapLargePagesAtWholeSpans) {
  if (!backend_->traits().large_pages) GTEST_SKIP() << "the host backend has no large pages here";
  EXPECT_TRUE(grow_ahead(3, 2 * kSpan));  // a whole span ahead: a large page per region
  EXPECT_EQ(slots_[3].mapped(), kSpan);
  for (std::size_t r = 0; r < regions(); ++r) EXPECT_TRUE(pool_.is_large(slots_[3].pages[r][0]));
  map({kSpan, 0, 0, kSpan});  // one whole span, from what the budget has left
  EXPECT_TRUE(pool_.is_large(slots_[0].pages[0][0]));
  EXPECT_EQ(mappings_.round_up_to_whole(slots_[0], 1), kSpan);
  EXPECT_EQ(pool_.large_pages(), 2 * regions());
}

}  // namespace
}  // namespace vkv
