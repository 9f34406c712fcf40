// SlotReaders alone, on the host backend: a leaving owner's zero-fill is deferred with no
// backend call and enqueued once; pages that leave shrink it; a fence records one event
// per stream and marks only the deferral it saw; the floors follow the read windows.
#include <gtest/gtest.h>

#include "cache/slot_parts.h"
#include "cache/slot_readers.h"

namespace vkv {
namespace {

class SlotReadersTest : public testing::ReaderParts {
 protected:
  // A slot whose owner wrote its 2 claimed pages and left: the fill is owed.
  void leave(std::size_t slot, Stream stream) {
    grow(slot, 2);
    for (std::size_t r = 0; r < layout_.num_regions(); ++r)
      testing::fill_bytes(*backend_, mappings_.address(r, slot, 0), 2 * page(), 5);
    slots_.set_tokens(slot, slots_[slot].seq_len, 2);
    readers_.defer_fill(slot, stream);
    slots_.set_tokens(slot, slots_[slot].seq_len, 0);
  }
  bool slot_is_zero(std::size_t slot) {
    for (std::size_t r = 0; r < layout_.num_regions(); ++r)
      if (!testing::all_zero(testing::read_bytes(*backend_, mappings_.address(r, slot, 0), 2 * page()))) return false;
    return true;
  }
};

TEST_F(SlotReadersTest, AFillIsDeferredWithNoBackendCallAndEnqueuedOnce) {
  backend_->calls = 0;
  leave(1, 0);
  const std::size_t calls = backend_->calls;
  EXPECT_EQ(readers_.deferred_fills(), 1u);
  EXPECT_EQ(slots_[1].deferred_fill, 2u);
  EXPECT_FALSE(slot_is_zero(1));
  readers_.enqueue_deferred_fills();
  EXPECT_GT(backend_->calls, calls);
  backend_->synchronize(0);
  EXPECT_TRUE(slot_is_zero(1));
  EXPECT_EQ(readers_.deferred_fills(), 0u);
  EXPECT_EQ(slots_[1].deferred_fill, 0u);
  EXPECT_NE(slots_[1].free_event, 0u);  // behind the fill
  const std::size_t after = backend_->calls;
  readers_.enqueue_fill(1);  // nothing owed any more
  EXPECT_EQ(backend_->calls, after);
  readers_.wait_free_event(1);
  EXPECT_EQ(slots_[1].free_event, 0u);
}

TEST_F(SlotReadersTest, ASlotThatClaimedNothingOwesNoFill) {
  grow(0, 1);
  readers_.defer_fill(0, 0);
  EXPECT_EQ(readers_.deferred_fills(), 0u);
  EXPECT_EQ(slots_[0].deferred_fill, 0u);
}

TEST_F(SlotReadersTest, AFailedEnqueueLeavesTheFillDeferred) {
  leave(2, 0);
  backend_->calls = 0;
  backend_->fail_at = 1;  // the zero-fill itself
  EXPECT_THROW(readers_.enqueue_fill(2), DriverError);
  EXPECT_EQ(readers_.deferred_fills(), 1u);
  EXPECT_EQ(slots_[2].deferred_fill, 2u);
  readers_.enqueue_fill(2);
  backend_->synchronize(0);
  EXPECT_TRUE(slot_is_zero(2));
}

TEST_F(SlotReadersTest, PagesThatLeaveShrinkTheFill) {
  leave(0, 0);
  readers_.shrink_fill(0, 1);
  EXPECT_EQ(slots_[0].deferred_fill, 1u);
  EXPECT_EQ(readers_.deferred_fills(), 1u);
  readers_.shrink_fill(0, 3);  // beyond the fill: nothing changes
  EXPECT_EQ(slots_[0].deferred_fill, 1u);
  readers_.shrink_fill(0, 0);
  EXPECT_EQ(slots_[0].deferred_fill, 0u);
  EXPECT_EQ(readers_.deferred_fills(), 0u);
}

TEST_F(SlotReadersTest, AFenceRecordsOneEventPerStreamAndMarksOnlyTheDeferralItSaw) {
  const Stream other = backend_->create_stream();
  leave(0, 0);
  leave(1, 0);
  leave(2, other);
  const detail::SlotReaders::Fence fence = readers_.fence({0, 1, 2});
  EXPECT_EQ(fence.events.size(), other == 0 ? 1u : 2u);  // one per stream
  EXPECT_EQ(fence.fills.size(), 3u);
  readers_.wait_then_destroy(fence.events);
  // Slot 1's fill was enqueued and the slot left again meanwhile: another deferral.
  readers_.enqueue_fill(1);
  readers_.wait_free_event(1);
  slots_.set_tokens(1, slots_[1].seq_len, 2);
  readers_.defer_fill(1, 0);
  slots_.set_tokens(1, slots_[1].seq_len, 0);
  readers_.mark_done(fence);
  EXPECT_TRUE(slots_[0].fill_readers_done);
  EXPECT_FALSE(slots_[1].fill_readers_done);
  EXPECT_TRUE(slots_[2].fill_readers_done);
  readers_.wait_for({1});  // its own fence, waited for at once
  EXPECT_TRUE(slots_[1].fill_readers_done);
  readers_.enqueue_deferred_fills();
  backend_->synchronize_device();
  backend_->destroy_stream(other);
}

TEST_F(SlotReadersTest, WaitingForTheLastReadersOfADeferredFillCountsAsAnEventWait) {
  leave(3, 0);
  readers_.wait_last_readers(3);  // no fill enqueued: an event behind the owner's work
  EXPECT_TRUE(slots_[3].fill_readers_done);
  EXPECT_EQ(slots_[3].deferred_fill, 2u);
  EXPECT_GT(profile_.event_wait_ns(), 0u);
}

TEST_F(SlotReadersTest, AllocatedSlotsFloorsFollowTheReadHorizon) {
  slots_.set_tokens(0, slots_[0].seq_len, 0);
  slots_.mark_allocated(0, windows_.steps());
  windows_.begin_step(0);
  windows_.end_step(3);  // the work enqueued from now on reads up to page 3
  EXPECT_EQ(readers_.first_reclaimable_without_waiting(0), 3u);
  EXPECT_EQ(readers_.first_reclaimable_without_waiting(1), 0u);  // free: its claim
  slots_.set_tokens(0, slots_[0].seq_len, 5);
  EXPECT_EQ(readers_.reclaimable_floors(), (std::vector<std::size_t>{5, 0, 0, 0}));
  backend_->synchronize_device();
  windows_.forget_completed();
}

TEST_F(SlotReadersTest, WithoutZeroBackingAFloorIsTheClaim) {
  config_.zero_page = false;
  slots_.mark_allocated(0, windows_.steps());
  windows_.begin_step(0);
  windows_.end_step(3);
  EXPECT_EQ(readers_.first_reclaimable_without_waiting(0), 0u);
  config_.zero_page = true;
}

}  // namespace
}  // namespace vkv
