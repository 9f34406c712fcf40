// PageSource alone, on the host backend: what can be had, the shortage named, pages from
// the pool first and then from slots above their floors, a slot's tail unmapped whole.
#include <gtest/gtest.h>

#include <mutex>

#include "cache/page_source.h"
#include "cache/slot_parts.h"

namespace vkv {
namespace {

class PageSourceTest : public testing::SourceParts {
 protected:
  std::size_t regions() const { return layout_.num_regions(); }
  std::vector<std::size_t> claims() const { return slots_.claims(); }
};

TEST_F(PageSourceTest, WhatCanBeHadIsThePoolsAndWhatSlotsMapAboveTheirClaims) {
  EXPECT_EQ(source_.obtainable_pages(claims()), pool_.budget_pages());
  grow(1, 3);
  slots_.set_tokens(1, slots_[1].seq_len, 1);
  EXPECT_EQ(source_.obtainable_pages(claims()), pool_.budget_pages() - regions());
  slots_.mark_busy(1, 1);  // the mapper's pages are not to be had
  EXPECT_EQ(source_.obtainable_pages(claims()), pool_.budget_pages() - 3 * regions());
  slots_.mark_not_busy(1);
}

TEST_F(PageSourceTest, AShortageNamesTheCallWhatIsMissingAndWhatCanBeHad) {
  source_.expect_obtainable(pool_.budget_pages(), claims(), "step");
  try {
    source_.expect_obtainable(pool_.budget_pages() + 3, claims(), "swap_in");
    FAIL() << "no shortage";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 3u);
    EXPECT_NE(std::string(error.what()).find("swap_in needs"), std::string::npos) << error.what();
  }
}

TEST_F(PageSourceTest, PagesComeFromThePoolThenFromTheColdestSlotAboveItsFloor) {
  grow(1, 4);
  slots_.mark_allocated(1, 0);
  slots_.mark_freed(1, 0);  // freed: all its pages may go
  const std::size_t free_now = pool_.budget_pages() - pool_.handed_out_pages();
  std::vector<Page> pages = source_.obtain(free_now + 2 * regions(), claims());
  EXPECT_EQ(pages.size(), free_now + 2 * regions());
  EXPECT_EQ(slots_[1].mapped(), 2u);
  for (const Page& page : pages) pool_.give_back(page);
  EXPECT_THROW(source_.obtain(pool_.budget_pages() + 1, claims()), OutOfMemory);
  EXPECT_EQ(pool_.handed_out_pages(), slots_[1].mapped() * regions());  // every page given back
}

TEST_F(PageSourceTest, ReclamationKeepsWhatASlotClaims) {
  grow(2, 4);
  slots_.set_tokens(2, slots_[2].seq_len, 3);
  std::vector<Page> into;
  EXPECT_TRUE(source_.reclaim_coldest(into, 100, claims()));
  EXPECT_EQ(slots_[2].mapped(), 3u);
  EXPECT_EQ(into.size(), regions());
  EXPECT_FALSE(source_.reclaim_coldest(into, 100, claims()));  // nothing above a floor is left
  for (const Page& page : into) pool_.give_back(page);
}

TEST_F(PageSourceTest, AnUnmappedTailShrinksAFillStillOwed) {
  grow(0, 3);
  slots_.set_tokens(0, slots_[0].seq_len, 3);
  readers_.defer_fill(0, 0);
  slots_.set_tokens(0, slots_[0].seq_len, 0);
  std::vector<Page> into;
  source_.unmap_tail(0, 1, into);
  EXPECT_EQ(slots_[0].mapped(), 1u);
  EXPECT_EQ(slots_[0].deferred_fill, 1u);
  EXPECT_EQ(into.size(), 2 * regions());
  for (const Page& page : into) EXPECT_FALSE(page.clean);  // they leave without their fill
  for (const Page& page : into) pool_.give_back(page);
  readers_.enqueue_deferred_fills();
}

}  // namespace
}  // namespace vkv
