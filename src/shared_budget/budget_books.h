// The books' totals and how bytes move between them: `used` (sum of held + reserved),
// `reserved` (released for askers, not taken yet), and what the floors keep. Every
// operation on the budget (budget_ledger.h names them) counts through this, so that the
// rules below are written once:
//
//   - a member's free capacity is the capacity less what is used and less the other
//     members' floors' gaps (what their floors keep that they do not hold);
//   - bytes that come back go to the reservation while someone asks and the capacity
//     allows (so that a third member cannot take them first), to the free capacity
//     otherwise; a reservation nobody asks for any more is free capacity;
//   - the reservation serves askers of higher priority first.
//
// Internal. Thread- and process-safety: with the segment's mutex held (BudgetLock), but
// for the totals the lock-free hints read (floor_gaps(), free_for()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "budget_segment.h"

namespace vkv::detail {

class BudgetBooks {
 public:
  explicit BudgetBooks(BudgetSegment& segment) noexcept : segment_(segment) {}

  BudgetSegment& segment() const noexcept { return segment_; }
  BudgetMemberRecord& row(std::size_t member) const noexcept { return segment_.members[member]; }

  // ---- totals over the live rows -------------------------------------------------------
  /// What every member asks for (asks in flight and standing asks).
  std::uint64_t wanted_total() const noexcept;
  /// The floors' gaps (floor - held) of the live members but `except`; without
  /// `askers_too`, of those not asking only.
  std::uint64_t floor_gaps(std::size_t except, bool askers_too = true) const noexcept;
  /// The floors of the live members but `except`.
  std::uint64_t floors_total(std::size_t except) const noexcept;
  /// The free capacity of `member`: the capacity less what is used and less the other
  /// members' floors' gaps (its cap not applied).
  std::uint64_t free_for(std::size_t member) const noexcept;
  /// What the capacity lacks for what is used and the floors' gaps of members not asking.
  std::uint64_t shortfall_beyond_wanted() const noexcept;
  /// What askers of higher priority than `member` want: the reservation serves them first.
  std::uint64_t wanted_above(std::size_t member) const noexcept;
  /// The reservation less what askers of higher priority than `member` want.
  std::uint64_t reserved_for(std::size_t member) const noexcept;

  // ---- moving bytes --------------------------------------------------------------------
  /// `bytes` just left some member's `held`: into the reservation as far as askers want them
  /// and the capacity allows without taking the floors' gaps of members not asking, the
  /// rest out of `used`.
  void return_bytes(std::size_t bytes) noexcept;
  /// A reservation nobody asks for any more is free capacity.
  void fit_reservation() noexcept;
  /// `used` from the rows: what repairs it after an owner died mid-change or it wrapped.
  void recount() noexcept;
  /// Bumps `requests` when a member is over its cap or the capacity is short (returns
  /// whether; the caller wakes the members once the mutex is released).
  bool request_if_short() noexcept;
  /// Bumps `releases` and wakes whoever waits on it (askers, SharedBudget::resize()).
  void wake_releases() noexcept;

 private:
  BudgetSegment& segment_;
};

}  // namespace vkv::detail
