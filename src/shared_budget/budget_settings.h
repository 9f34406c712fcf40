// What an operator changes while members run: the capacity (resize()) and a member's limits
// (set_limits()). A member's `floor` is kept for it: no other member acquires or is given
// the part of it the member does not hold, and no ask takes it below its floor; the floors
// add up to at most the capacity. Its `cap` bounds what it holds: above it (a cap lowered
// at run time) it gives back unclaimed pages down to it. Its `priority` orders the giving
// (budget_asks.h). A change that leaves the budget short, or a member above its cap, asks
// the members to give back, as an ask does.
//
// Internal. Thread- and process-safety: every call locks the segment's mutex (BudgetLock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "budget_segment.h"

namespace vkv::detail {

/// Which of MemberLimits' fields set_limits() sets.
struct LimitChange {
  bool floor = false, cap = false, priority = false;
};

class BudgetSettings {
 public:
  /// `segment` must stay mapped while this is used; `name` is for messages.
  explicit BudgetSettings(BudgetSegment& segment, std::string name = "") noexcept
      : segment_(segment), name_(std::move(name)) {}

  /// Sets the capacity; when it falls below used, members are asked to give back the excess.
  /// @throws InvalidArgument below the members' floors (one line naming their sum).
  void resize(std::size_t capacity);
  /// Sets the limits of every member of process `pid` (the fields `set` names; the others
  /// stay); members above a new cap, or holding what a new floor keeps, are asked to give
  /// back. Returns how many members it changed.
  /// @throws InvalidArgument when no live member has that pid, a cap is below a member's
  ///         page or floor, or the floors would exceed the capacity; nothing changes then.
  std::size_t set_limits(std::int32_t pid, const MemberLimits& limits, LimitChange set);

 private:
  BudgetSegment& segment_;
  std::string name_;
};

/// @throws InvalidArgument when `floors` exceed `capacity`: one line naming the budget
/// (`description`), `what` was refused, their sum and the capacity.
void expect_floors_fit(const std::string& description, std::uint64_t floors, std::uint64_t capacity,
                       const std::string& what);

}  // namespace vkv::detail
