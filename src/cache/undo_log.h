// Undo actions for a call that changes state in several steps: run in reverse when the
// call fails before commit(), so that a failed call leaves the cache as it found it.
//
// Undo is stream-ordered too: a mapping must not change under device work still queued
// on it (a zero-fill or copy this call enqueued before it failed; the driver's unmap does
// not wait, and a GPU faults). So an action that changes a mapping first waits for the
// device work enqueued so far (`wait_for_device`), once per batch of such actions.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "vkv/backend.h"

namespace vkv::detail {

class UndoLog {
 public:
  /// `wait_for_device` blocks until the device work this call enqueued has completed
  /// (synchronizing its stream); empty when the call enqueues none.
  explicit UndoLog(std::function<void()> wait_for_device = {}) : wait_for_device_(std::move(wait_for_device)) {
    actions_.reserve(16);
  }
  ~UndoLog() {
    if (committed_) return;
    for (auto action = actions_.rbegin(); action != actions_.rend(); ++action) {
      try {
        if (action->kind == Kind::remap && device_work_pending_ && wait_for_device_) {
          device_work_pending_ = false;
          wait_for_device_();  // throws only on a dead context, where nothing runs any more
        }
      } catch (...) {}
      try {
        action->run();
        if (action->kind == Kind::enqueue) device_work_pending_ = true;
      } catch (...) {
        // Keep undoing the rest; the error that matters is the one propagating.
      }
    }
  }
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;

  /// Registers how to put back host-side state (bookkeeping, the pool).
  template <typename Action>
  void push(Action&& action) {
    actions_.push_back({Kind::host, std::forward<Action>(action)});
  }
  /// Registers how to put back a mapping: runs after the device work enqueued before it.
  template <typename Action>
  void push_remap(Action&& action) {
    actions_.push_back({Kind::remap, std::forward<Action>(action)});
  }
  /// Registers an action that enqueues device work (e.g. a zero-fill that clears a copy).
  template <typename Action>
  void push_enqueue(Action&& action) {
    actions_.push_back({Kind::enqueue, std::forward<Action>(action)});
  }
  /// The call has just enqueued device work that touches pages an action may remap.
  void enqueued_device_work() noexcept { device_work_pending_ = true; }
  /// The call succeeded: keep everything.
  void commit() noexcept { committed_ = true; }

 private:
  enum class Kind { host, remap, enqueue };
  struct Action {
    Kind kind;
    std::function<void()> run;
  };
  std::vector<Action> actions_;
  std::function<void()> wait_for_device_;
  bool device_work_pending_ = false;
  bool committed_ = false;
};

/// The wait of an engine call's undo log (the call's device work is on `stream`):
/// undoing a mapping waits for that stream's work.
inline std::function<void()> waits_for_stream(Backend& backend, Stream stream) {
  return [&backend, stream] { backend.synchronize(stream); };
}

}  // namespace vkv::detail
