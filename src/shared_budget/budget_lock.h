// The lock every change of the books takes: the segment's robust process-shared mutex,
// and the repair after a member died holding it. Such a member's half-done change may have
// left `used` off (even wrapped below zero), so the next locker counts the dead out and
// adds `used` up again from the rows.
//
// Internal. Thread- and process-safety: a scoped lock of one segment; any thread of any
// process that maps it may hold one (one at a time).
#pragma once

#include "budget_segment.h"
#include "interprocess/shared_memory.h"

namespace vkv::detail {

class BudgetLock {
 public:
  /// Waits at most shared_lock_timeout(): a stopped holder costs an error naming it, not a
  /// hang. @throws Error on that timeout, or when the mutex is broken.
  explicit BudgetLock(BudgetSegment& segment);
  BudgetLock(const BudgetLock&) = delete;
  BudgetLock& operator=(const BudgetLock&) = delete;

 private:
  RobustLock lock_;
};

}  // namespace vkv::detail
