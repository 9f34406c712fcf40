// UndoLog alone: a failed call's actions run in reverse, a committed call keeps
// everything, and a mapping is put back only after the device work the call enqueued.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "cache/undo_log.h"

namespace vkv::detail {
namespace {

TEST(UndoLog, ActionsRunInReverseWhenTheCallFails) {
  std::string order;
  {
    UndoLog undo;
    undo.push([&] { order += "a"; });
    undo.push([&] { order += "b"; });
    undo.push_remap([&] { order += "c"; });
  }
  EXPECT_EQ(order, "cba");
}

TEST(UndoLog, ACommittedCallKeepsEverything) {
  std::string order;
  {
    UndoLog undo;
    undo.push([&] { order += "a"; });
    undo.commit();
  }
  EXPECT_EQ(order, "");
}

TEST(UndoLog, AMappingIsPutBackAfterTheDeviceWorkEnqueuedOnceABatch) {
  std::string order;
  {
    UndoLog undo([&] { order += "w"; });
    undo.push_remap([&] { order += "1"; });
    undo.push_remap([&] { order += "2"; });
    undo.enqueued_device_work();
    undo.push_remap([&] { order += "3"; });
  }
  EXPECT_EQ(order, "w321") << "one wait before the first remap, none for the rest of the batch";
}

TEST(UndoLog, WorkEnqueuedWhileUndoingIsWaitedForBeforeTheNextRemap) {
  std::string order;
  {
    UndoLog undo([&] { order += "w"; });
    undo.push_remap([&] { order += "r"; });
    undo.push_enqueue([&] { order += "z"; });  // e.g. a zero-fill that clears a copy
    undo.push([&] { order += "h"; });
  }
  EXPECT_EQ(order, "hzwr");
}

TEST(UndoLog, AFailingActionDoesNotStopTheOthers) {
  std::string order;
  {
    UndoLog undo;
    undo.push([&] { order += "a"; });
    undo.push([&] { throw std::runtime_error("undo failed"); });
    undo.push([&] { order += "c"; });
  }
  EXPECT_EQ(order, "ca");
}

}  // namespace
}  // namespace vkv::detail
