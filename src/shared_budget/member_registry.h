// Who is in the budget: a row per member process, taken at joining and given up at
// leaving, and counted back when its process is gone. A member's process may die anywhere
// (SIGKILL included): its row names its pid and start time, and whoever takes the lock
// after noticing it gone (a shortage, stats, a resize, a join) counts its bytes back
// (reap()); a death while holding the lock is repaired by the next locker (BudgetLock).
//
// Internal. Thread- and process-safety: every call locks the segment's mutex (BudgetLock);
// reap_locked() expects it held.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "budget_segment.h"

namespace vkv::detail {

class MemberRegistry {
 public:
  /// `segment` must stay mapped while this is used; `name` is for messages.
  explicit MemberRegistry(BudgetSegment& segment, std::string name = "") noexcept
      : segment_(segment), name_(std::move(name)) {}

  /// A row for the calling process, with its limits and `label` (printable ASCII, cut to
  /// fit). A floor that others' unclaimed pages occupy asks them to give those back.
  /// @throws InvalidArgument when all rows are taken by live members, for a cap below one
  /// page or the floor, or a floor that brings the floors above the capacity (one line
  /// naming their sum and the capacity); Error when the mutex is broken.
  std::size_t join(std::size_t page_bytes, const MemberLimits& limits = {}, const std::string& label = "");
  /// Gives the row up; bytes it still holds are counted back.
  void leave(std::size_t member) noexcept;
  /// Counts back the bytes of members whose process is gone. Returns how many it found.
  std::size_t reap();
  /// The largest page of the device and of the live members: the least capacity.
  std::size_t largest_page();

 private:
  BudgetSegment& segment_;
  std::string name_;
};

/// reap() with the mutex held, and no wake-up: reads /proc per live member. Also forgets
/// the engines that answered for members and are gone.
std::size_t reap_locked(BudgetSegment& segment) noexcept;

}  // namespace vkv::detail
