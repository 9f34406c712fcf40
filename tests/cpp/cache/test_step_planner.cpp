// StepPlanner alone: the claims a step leaves, the pages it maps, the shared pages it
// copies (the last slot mapping a page keeps it), waiting for a busy mapper, and the
// checks of seq_lens in the caller's words.
#include <gtest/gtest.h>

#include "cache/slot_parts.h"
#include "cache/step_planner.h"

namespace vkv {
namespace {

class StepPlannerTest : public testing::SlotParts {
 protected:
  std::size_t tokens_per_page() const { return page() / layout_.token_bytes(); }
  std::size_t regions() const { return layout_.num_regions(); }

  detail::StepPlanner planner_{cache_, mappings_};
};

TEST_F(StepPlannerTest, ClaimsGrowWithSeqLensAndNeverShrink) {
  slots_.mark_allocated(0, 0);
  slots_.mark_allocated(1, 0);
  grow(1, 3);
  slots_.set_tokens(1, 3 * tokens_per_page(), 3);
  const std::size_t seq_lens[] = {tokens_per_page() + 1, 1, 0, 0};
  const detail::StepPlan plan = planner_.plan(seq_lens, 4, 0);
  EXPECT_EQ(plan.claims, (std::vector<std::size_t>{2, 3, 0, 0}));
  EXPECT_EQ(plan.to_map, 2 * regions());
  EXPECT_EQ(plan.missing, plan.to_map);
  EXPECT_TRUE(plan.copies.empty());
  EXPECT_FALSE(plan.waits_for_mapper);
}

TEST_F(StepPlannerTest, ASharedPageAboutToBeWrittenIsCopiedByAllButItsLastSlot) {
  for (std::size_t s : {0, 1}) slots_.mark_allocated(s, 0);
  grow(0, 2);
  for (std::size_t r = 0; r < regions(); ++r) {  // slot 1 maps slot 0's pages
    mappings_.map_real(1, r, 0, slots_[0].pages[r].data(), 2);
    slots_.set_pages(1, r, slots_[0].pages[r]);
    for (PageHandle handle : slots_[0].pages[r]) sharing_.add_mapping(handle);
  }
  for (std::size_t s : {0, 1}) {
    slots_.set_tokens(s, tokens_per_page() + 1, 2);  // the second page is partly written
  }
  const std::size_t seq_lens[] = {tokens_per_page() + 2, tokens_per_page() + 2, 0, 0};
  const detail::StepPlan plan = planner_.plan(seq_lens, 4, 0);
  ASSERT_EQ(plan.copies.size(), 1u);  // slot 0 copies, slot 1 keeps the page
  EXPECT_EQ(plan.copies[0].slot, 0u);
  EXPECT_EQ(plan.copies[0].page, 1u);
  EXPECT_EQ(plan.missing, regions());
  for (std::size_t r = 0; r < regions(); ++r) {  // the test's books as they were
    for (PageHandle handle : slots_[1].pages[r]) sharing_.drop_mapping(handle);
    mappings_.unmap_real(1, r, 0, slots_[1].pages[r].data(), 2);
    slots_.truncate_pages(1, r, 0);
  }
}

TEST_F(StepPlannerTest, ABusyMapperOnPagesTheStepNeedsMakesItWait) {
  slots_.mark_allocated(2, 0);
  slots_.mark_busy(2, 0);
  const std::size_t seq_lens[] = {0, 0, 1, 0};
  EXPECT_TRUE(planner_.plan(seq_lens, 4, 0).waits_for_mapper);
  slots_.mark_busy(2, 5);  // working beyond what the step needs and what the horizon reaches
  EXPECT_FALSE(planner_.plan(seq_lens, 4, 1).waits_for_mapper);
  EXPECT_TRUE(planner_.plan(seq_lens, 4, 6).waits_for_mapper);
  slots_.mark_not_busy(2);
}

TEST_F(StepPlannerTest, BadSeqLensAreNamedInTheCallersWords) {
  slots_.mark_allocated(0, 0);
  const std::size_t short_list[] = {1, 0};
  EXPECT_THROW(planner_.expect_valid(short_list, 2), InvalidArgument);
  const std::size_t too_long[] = {config_.max_context_len + 1, 0, 0, 0};
  try {
    planner_.expect_valid(too_long, 4);
    FAIL() << "accepted a seq_len past max_context_len";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("seq_lens[0]"), std::string::npos) << error.what();
  }
  const std::size_t free_slot[] = {0, 5, 0, 0};
  EXPECT_THROW(planner_.expect_valid(free_slot, 4), InvalidArgument);
  slots_.mark_swapped_out(0, {});
  const std::size_t swapped[] = {5, 0, 0, 0};
  EXPECT_THROW(planner_.expect_valid(swapped, 4), InvalidArgument);
  slots_.mark_swapped_in(0, 0, 0);
  const std::size_t fine[] = {5, 0, 0, 0};
  EXPECT_NO_THROW(planner_.expect_valid(fine, 4));
}

}  // namespace
}  // namespace vkv
