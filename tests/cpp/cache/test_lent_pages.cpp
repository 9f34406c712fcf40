// LentPages alone, on the host backend: what a cache could give its shared budget back,
// what its requests claim, the next prompt's pages, and releasing free pages first.
#include <gtest/gtest.h>

#include <mutex>

#include "cache/lent_pages.h"
#include "cache/slot_parts.h"

namespace vkv {
namespace {

class LentPagesTest : public testing::SourceParts {
 protected:
  std::size_t regions() const { return layout_.num_regions(); }

  detail::PromptHistory& prompts_ = cache_.prompts;
  detail::LentPages lent_{cache_, mappings_, readers_, source_};
};

TEST_F(LentPagesTest, CachedPagesAreFreeOnesAndWhatSlotsMapAboveTheirFloors) {
  grow(0, 3);
  slots_.mark_allocated(0, 0);
  slots_.set_tokens(0, slots_[0].seq_len, 1);
  grow(1, 2);  // free slot: all of it is cached
  for (const Page& page : pool_.take(2)) pool_.give_back(page);
  const std::vector<std::size_t> floors = slots_.claims();
  EXPECT_EQ(lent_.cached_pages(floors, /*freed_only=*/false), pool_.free_pages() + 2 * regions() + 2 * regions());
  EXPECT_EQ(lent_.cached_pages(floors, /*freed_only=*/true), pool_.free_pages() + 2 * regions());
  EXPECT_EQ(lent_.claimed_pages(), regions());
  slots_.set_tokens(0, slots_[0].seq_len, 0);
}

TEST_F(LentPagesTest, TheNextPromptsPagesFollowEagerAllocation) {
  config_.eager_tokens = 3 * page() / layout_.token_bytes();
  EXPECT_EQ(lent_.next_prompt_pages(), 3 * regions());
  config_.eager_tokens = kAdaptive;
  EXPECT_EQ(lent_.next_prompt_pages(), 0u);  // no prompt seen yet
  prompts_.record(2 * page() / layout_.token_bytes());
  EXPECT_EQ(lent_.next_prompt_pages(), 2 * regions());
}

TEST_F(LentPagesTest, ReleaseGivesFreePagesBackFirstThenFreedSlotsPages) {
  grow(1, 2);
  for (const Page& page : pool_.take(4)) pool_.give_back(page);
  slots_.mark_allocated(1, 0);
  slots_.mark_freed(1, 0);
  const std::size_t created = pool_.created_pages();
  detail::BudgetClient::ReleaseTimes times;
  EXPECT_GE(lent_.release(4, readers_.reclaimable_floors(), detail::BudgetClient::Victims::freed_only, false, times),
            4u);
  EXPECT_EQ(slots_[1].mapped(), 2u);  // the free pages were enough
  EXPECT_EQ(pool_.created_pages(), created - 4);
  lent_.release(100, readers_.reclaimable_floors(), detail::BudgetClient::Victims::freed_only, true, times);
  EXPECT_EQ(slots_[1].mapped(), 0u);
  EXPECT_EQ(pool_.created_pages(), 0u);
}

TEST_F(LentPagesTest, WaitingForReadersWithTheLockReleasedMarksTheFillsItSaw) {
  grow(2, 2);
  slots_.set_tokens(2, slots_[2].seq_len, 2);
  readers_.defer_fill(2, 0);
  slots_.set_tokens(2, slots_[2].seq_len, 0);
  std::unique_lock<std::mutex> lock(mutex_);
  EXPECT_TRUE(lent_.wait_for_readers(lock, [&] {
    lock.lock();
    return true;
  }));
  EXPECT_TRUE(lock.owns_lock());
  EXPECT_TRUE(slots_[2].fill_readers_done);
  readers_.enqueue_deferred_fills();
}

}  // namespace
}  // namespace vkv
