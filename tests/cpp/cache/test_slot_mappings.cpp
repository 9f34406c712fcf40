// SlotMappings alone, on the host backend: real pages over zero backing and back, every
// region all or nothing, zero-fills of fresh pages only where they are not known clean,
// the books an unmapping leaves, and large pages whole.
#include <gtest/gtest.h>

#include "cache/slot_parts.h"

namespace vkv {
namespace {

using detail::Slot;

class SlotMappingsTest : public testing::SlotParts {
 protected:
  using SlotParts::SlotParts;
};

TEST_F(SlotMappingsTest, AddressesFollowTheLayout) {
  EXPECT_EQ(mappings_.address(0, 0, 0), base_);
  EXPECT_EQ(mappings_.address(1, 2, 3), base_ + layout_.page_offset(1, 2, 3));
}

TEST_F(SlotMappingsTest, RealPagesReplaceZeroBackingAndGiveItBack) {
  mappings_.back_with_zeros(1, 4);
  EXPECT_EQ(slots_[1].backed_end, 4u);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(0, 1, 0), 4 * page())));
  grow(1, 2);
  testing::fill_bytes(*backend_, mappings_.address(0, 1, 0), 2 * page(), 7);
  EXPECT_EQ(testing::read_bytes(*backend_, mappings_.address(0, 1, 1), 1).front(), 7);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) mappings_.unmap_real(1, r, 0, slots_[1].pages[r].data(), 2);
  // Zero backing is back where the real pages were: the bytes written are gone.
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(0, 1, 0), 4 * page())));
  std::vector<Page> unmapped;
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
    mappings_.drop_mappings(slots_[1].pages[r], 0, slots_[1].pages[r].size(), false, unmapped);
    slots_.truncate_pages(1, r, 0);
  }
  EXPECT_EQ(unmapped.size(), 2 * layout_.num_regions());
  for (const Page& page : unmapped) pool_.give_back(page);
}

TEST_F(SlotMappingsTest, BackWithZerosOnlyExtendsTheBackedRange) {
  grow(0, 2);
  mappings_.back_with_zeros(0, 1);  // below what is mapped: nothing to do
  EXPECT_EQ(slots_[0].backed_end, 0u);
  mappings_.back_with_zeros(0, 5);
  EXPECT_EQ(slots_[0].backed_end, 5u);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(2, 0, 2), 3 * page())));
}

TEST_F(SlotMappingsTest, AFailedUnmapOfOneRegionMapsTheOthersBack) {
  grow(2, 3);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r)
    testing::fill_bytes(*backend_, mappings_.address(r, 2, 0), 3 * page(), static_cast<std::uint8_t>(r + 1));
  backend_->calls = 0;
  backend_->fail_at = 2;  // the second region's unmap
  EXPECT_THROW(mappings_.unmap_regions(2, 1, 2), DriverError);
  backend_->fail_at = 0;
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
    const auto bytes = testing::read_bytes(*backend_, mappings_.address(r, 2, 0), 3 * page());
    EXPECT_EQ(bytes, std::vector<std::uint8_t>(3 * page(), static_cast<std::uint8_t>(r + 1))) << "region " << r;
  }
  mappings_.unmap_regions(2, 1, 2);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) slots_.truncate_pages(2, r, 1);
}

TEST_F(SlotMappingsTest, AFailedMapLeavesZeroBackingAsItWas) {
  mappings_.back_with_zeros(0, 2);
  const std::vector<Page> pages = pool_.take(2);
  const PageHandle handles[] = {pages[0].handle, pages[1].handle};
  backend_->calls = 0;
  backend_->fail_at = 2;  // the map after unmapping the zero backing
  EXPECT_THROW(mappings_.map_real(0, 0, 0, handles, 2), DriverError);
  backend_->fail_at = 0;
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(0, 0, 0), 2 * page())));
  for (const Page& page : pages) pool_.give_back(page);
}

TEST_F(SlotMappingsTest, ZeroFillsOnlyPagesNotKnownClean) {
  std::vector<Page> pages = grow(3, 2);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r)
    testing::fill_bytes(*backend_, mappings_.address(r, 3, 0), 2 * page(), 9);
  for (Page& fresh : pages) fresh.clean = true;
  pages[1].clean = false;  // region 0's second page
  mappings_.zero_fresh_regions(3, 0, pages.data(), 2, 0);
  backend_->synchronize(0);
  EXPECT_EQ(testing::read_bytes(*backend_, mappings_.address(0, 3, 0), 1).front(), 9);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(0, 3, 1), page())));
  EXPECT_EQ(testing::read_bytes(*backend_, mappings_.address(1, 3, 1), 1).front(), 9);
  for (Page& fresh : pages) fresh.clean = false;  // none known clean: every region at once
  mappings_.zero_fresh_regions(3, 0, pages.data(), 2, 0);
  backend_->synchronize(0);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r)
    EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(r, 3, 0), 2 * page())));
}

TEST_F(SlotMappingsTest, DroppingAMappingGivesBackOnlyPagesMappedNowhereElse) {
  grow(0, 2);
  sharing_.add_mapping(slots_[0].pages[0][0]);  // as if another slot mapped it too
  std::vector<Page> unmapped;
  mappings_.drop_mappings(slots_[0].pages[0], 0, 2, /*clean=*/true, unmapped);
  ASSERT_EQ(unmapped.size(), 1u);
  EXPECT_EQ(unmapped[0].handle, slots_[0].pages[0][1]);
  EXPECT_TRUE(unmapped[0].clean);
  EXPECT_FALSE(sharing_.is_shared(slots_[0].pages[0][0]));  // mapped once now
  sharing_.add_mapping(slots_[0].pages[0][0]);              // the test's books as they were
  sharing_.drop_mapping(slots_[0].pages[0][0]);
}

class SlotMappingsLargeTest : public SlotMappingsTest {
 protected:
  static constexpr std::size_t kSpan = 4;
  SlotMappingsLargeTest() : SlotMappingsTest(kSpan) {}
};

TEST_F(SlotMappingsLargeTest, LargePagesMapWithOneCallAndRoundWhole) {
  if (!backend_->traits().large_pages) GTEST_SKIP() << "the host backend has no large pages here";
  std::vector<Page> large;
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) large.push_back(*pool_.take_large());
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
    const std::vector<PageHandle> run(kSpan, large[r].handle);
    mappings_.map_real(1, r, 0, run.data(), kSpan);
    slots_.set_pages(1, r, run);
  }
  grow(1, 1);  // a single page after the span
  EXPECT_EQ(mappings_.round_down_to_whole(slots_[1], 2), 0u);
  EXPECT_EQ(mappings_.round_up_to_whole(slots_[1], 2), kSpan);
  EXPECT_EQ(mappings_.round_down_to_whole(slots_[1], kSpan), kSpan);  // the single page
  EXPECT_EQ(mappings_.round_up_to_whole(slots_[1], 0), 0u);
  std::vector<Page> unmapped;
  mappings_.drop_mappings(slots_[1].pages[0], 0, kSpan + 1, false, unmapped);
  EXPECT_EQ(unmapped.size(), 2u);  // the large page once, and the single page (the books stay: teardown's)
}

TEST_F(SlotMappingsLargeTest, GivingBackARunOfEqualHandlesGivesTheLargePageOnce) {
  if (!backend_->traits().large_pages) GTEST_SKIP() << "the host backend has no large pages here";
  const Page large = *pool_.take_large();
  const std::vector<Page> run(kSpan, large);
  mappings_.give_back_pages(run.data(), run.size());
  EXPECT_EQ(pool_.free_large_pages(), 1u);
}

}  // namespace
}  // namespace vkv
