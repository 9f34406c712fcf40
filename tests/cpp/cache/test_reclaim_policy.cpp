// choose_victim(): the one policy for which pages go back first, on its own.
#include <gtest/gtest.h>

#include "cache/reclaim_policy.h"

namespace vkv::detail {
namespace {

// A table of `slots` slots, one region each; maps `mapped[s]` pages in slot s.
SlotTable table(const std::vector<std::size_t>& mapped) {
  SlotTable slots(mapped.size(), 1);
  for (std::size_t s = 0; s < mapped.size(); ++s)
    slots.set_pages(s, 0, std::vector<PageHandle>(mapped[s], PageHandle{s + 1}));
  return slots;
}

std::vector<std::size_t> zeros(std::size_t n) { return std::vector<std::size_t>(n, 0); }

TEST(ReclaimPolicy, SurplusOfAllocatedSlotsGoesFirst) {
  SlotTable slots = table({4, 4, 4});
  slots.mark_freed(0, 4);  // a freed slot with pages...
  slots.mark_allocated(2, 0);
  const std::vector<std::size_t> floors = {0, 0, 3};  // ...but slot 2 maps one page beyond its claim
  EXPECT_EQ(choose_victim(slots, floors, VictimKinds::surplus_then_freed, slots.size()), 2u);
}

TEST(ReclaimPolicy, ThenTheLeastRecentlyFreedSlot) {
  SlotTable slots = table({4, 4, 4});
  slots.mark_freed(1, 4);
  slots.mark_freed(0, 4);
  slots.mark_freed(2, 4);
  EXPECT_EQ(choose_victim(slots, zeros(3), VictimKinds::surplus_then_freed, slots.size()), 1u);
}

TEST(ReclaimPolicy, FloorsBusySlotsAndTheExcludedSlotAreLeftAlone) {
  SlotTable slots = table({4, 4, 4, 0});
  slots.mark_allocated(0, 0);  // allocated, at its floor: nothing to give
  slots.mark_freed(1, 4);
  slots.mark_busy(1, 0);   // the mapper is working on it
  slots.mark_freed(2, 4);  // the one alloc_reqid() hands out next
  slots.mark_freed(3, 0);  // nothing mapped
  const std::vector<std::size_t> floors = {4, 0, 0, 0};
  EXPECT_EQ(choose_victim(slots, floors, VictimKinds::surplus_then_freed, /*exclude=*/2), slots.size());
  EXPECT_EQ(choose_victim(slots, floors, VictimKinds::surplus_then_freed, slots.size()), 2u);
}

TEST(ReclaimPolicy, FreedOnlyNeverTakesFromAllocatedSlots) {
  SlotTable slots = table({4, 4});
  slots.mark_allocated(0, 0);
  slots.mark_freed(1, 4);
  EXPECT_EQ(choose_victim(slots, zeros(2), VictimKinds::freed_only, slots.size()), 1u);
  slots.mark_allocated(1, 0);
  EXPECT_EQ(choose_victim(slots, zeros(2), VictimKinds::freed_only, slots.size()), slots.size());
}

}  // namespace
}  // namespace vkv::detail
