// ReadWindows alone: the horizon a slot's mappings must respect is that of the windows still
// open that began after the slot was allocated, and a window closes when its event completes.
#include <gtest/gtest.h>

#include <memory>

#include "cache/read_windows.h"
#include "testing.h"
#include "vkv/host_backend.h"

namespace vkv::detail {
namespace {

class ReadWindowsTest : public ::testing::Test {
 protected:
  std::shared_ptr<testing::ControlledEventBackend> events_ =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  ReadWindows windows_{*events_};

  // One step() whose work reads below `horizon_pages`.
  void step(std::size_t horizon_pages) {
    windows_.begin_step(0);
    windows_.end_step(horizon_pages);
  }
};

TEST_F(ReadWindowsTest, TheWorkSinceTheLastStepCountsOnlyWhenAsked) {
  EXPECT_EQ(windows_.horizon(0, true), 0u) << "no step yet";
  step(5);
  EXPECT_EQ(windows_.steps(), 1u);
  EXPECT_EQ(windows_.horizon(0, /*include_current=*/true), 5u);
  EXPECT_EQ(windows_.horizon(0, /*include_current=*/false), 0u) << "no event covers it yet";
  EXPECT_EQ(events_->pending(), 0u);
}

TEST_F(ReadWindowsTest, AWindowStaysOpenUntilItsEventCompletes) {
  step(5);
  step(3);  // records an event behind the first step's work
  EXPECT_EQ(events_->pending(), 1u);
  EXPECT_EQ(windows_.horizon(0, false), 5u);
  EXPECT_EQ(windows_.horizon(0, true), 5u) << "the larger of the open window and the current work";
  events_->complete_all();
  windows_.forget_completed();
  EXPECT_EQ(windows_.horizon(0, false), 0u);
  EXPECT_EQ(windows_.horizon(0, true), 3u);
}

TEST_F(ReadWindowsTest, ASlotAllocatedAfterAStepIsNotReadByItsWork) {
  step(8);
  const std::uint64_t allocated_at = windows_.steps();  // a slot allocated now
  EXPECT_EQ(windows_.horizon(allocated_at, true), 0u);
  step(2);
  EXPECT_EQ(windows_.horizon(allocated_at, false), 0u) << "the first window began before the slot";
  EXPECT_EQ(windows_.horizon(allocated_at, true), 2u);
}

TEST_F(ReadWindowsTest, WaitCompletesAndForgetsEveryWindow) {
  step(4);
  step(6);
  step(1);
  EXPECT_EQ(events_->pending(), 2u);
  windows_.wait();
  EXPECT_EQ(events_->pending(), 0u);
  EXPECT_EQ(windows_.horizon(0, false), 0u);
}

TEST_F(ReadWindowsTest, AStepOfNothingRecordsNoEvent) {
  step(0);
  step(0);
  EXPECT_EQ(events_->pending(), 0u);
}

}  // namespace
}  // namespace vkv::detail
