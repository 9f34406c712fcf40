// Undo actions for a call that changes state in several steps: run in reverse when the
// call fails before commit(), so that a failed call leaves the cache as it found it.
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace vkv::detail {

class UndoLog {
 public:
  UndoLog() { actions_.reserve(16); }
  ~UndoLog() {
    if (committed_) return;
    for (auto action = actions_.rbegin(); action != actions_.rend(); ++action) {
      try {
        (*action)();
      } catch (...) {
        // Keep undoing the rest; the error that matters is the one propagating.
      }
    }
  }
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;

  /// Registers how to put back a step that has just been done.
  template <typename Action>
  void push(Action&& action) {
    actions_.emplace_back(std::forward<Action>(action));
  }
  /// The call succeeded: keep everything.
  void commit() noexcept { committed_ = true; }

 private:
  std::vector<std::function<void()>> actions_;
  bool committed_ = false;
};

}  // namespace vkv::detail
