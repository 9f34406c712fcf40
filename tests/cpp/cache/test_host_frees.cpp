// HostFrees alone, on the host backend: host memory goes once the copy behind it completed.
#include <gtest/gtest.h>

#include "cache/host_frees.h"
#include "testing.h"

namespace vkv {
namespace {

TEST(HostFreesTest, HostMemoryGoesOnceItsCopyCompleted) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  testing::FaultInjectingBackend backend(events);
  detail::HostFrees frees(backend);
  frees.add({backend.allocate_host(64), 64, backend.record_event(0)});
  frees.add({backend.allocate_host(64), 64, 0});  // no copy: it goes at the next call
  frees.free_finished(/*wait=*/false);
  EXPECT_EQ(frees.pending(), 1u);  // its copy is not done yet
  EXPECT_EQ(backend.held["host_buffers"], 1);
  events->complete_all();
  frees.free_finished(/*wait=*/false);
  EXPECT_EQ(frees.pending(), 0u);
  EXPECT_EQ(backend.held["host_buffers"], 0);
  EXPECT_EQ(backend.held["events"], 0);
}

TEST(HostFreesTest, AFailedQueryChangesNothingAndTeardownWaits) {
  testing::FaultInjectingBackend backend(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  detail::HostFrees frees(backend);
  frees.add({backend.allocate_host(64), 64, backend.record_event(0)});
  backend.calls = 0;
  backend.fail_at = 1;
  EXPECT_THROW(frees.free_finished(/*wait=*/false), DriverError);
  EXPECT_EQ(frees.pending(), 1u);
  backend.fail_at = 0;
  frees.free_finished(/*wait=*/true);
  EXPECT_EQ(frees.pending(), 0u);
  EXPECT_EQ(backend.held["host_buffers"], 0);
}

}  // namespace
}  // namespace vkv
