// What a member holds: bytes taken from the free capacity as its pool creates pages (and
// from what was given back for its standing ask), bytes returned as it releases them, and
// the lock-free hints a member reads before it takes the lock. A member's free capacity is
// the capacity less what is used and the other members' floors' gaps, within its cap.
//
// Internal. Thread- and process-safety: every call locks the segment's mutex (BudgetLock),
// but the hints (free_hint(), room_text()) and publish_in_use(), which read and write
// atomics without it.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "budget_segment.h"

namespace vkv::detail {

class MemberHoldings {
 public:
  /// `segment` must stay mapped while this is used; `name` is for messages.
  explicit MemberHoldings(BudgetSegment& segment, std::string name = "") noexcept
      : segment_(segment), name_(std::move(name)) {}

  /// Takes `bytes` from the free capacity, all or nothing. @throws Error (a broken mutex).
  bool acquire(std::size_t member, std::size_t bytes);
  /// Takes as much of `bytes` as is free, in whole `unit`s; returns how much. What was
  /// given back for the member's standing ask comes first. Counts the dead out when short.
  std::size_t acquire_up_to(std::size_t member, std::size_t bytes, std::size_t unit);
  /// Returns bytes: to the askers' reservation while someone asks and the capacity allows,
  /// else to the free capacity. They count toward what the member pledged.
  void release(std::size_t member, std::size_t bytes) noexcept;
  std::size_t held(std::size_t member);

  /// Publishes the bytes the member's allocated slots claim (lock-free; for stats() and
  /// what the others may ask of it).
  void publish_in_use(std::size_t member, std::size_t bytes) noexcept {
    segment_.members[member].in_use.store(bytes, std::memory_order_relaxed);
  }
  /// Bytes the member may take now (the free capacity less the others' floors' gaps,
  /// within its cap), without locking: a hint that may be stale when read.
  std::size_t free_hint(std::size_t member) const noexcept;
  /// Why the member can take no more than free_hint(), for an OutOfMemory's message: the
  /// free capacity, the others' floors' gaps and its cap (lock-free reads; a hint).
  std::string room_text(std::size_t member) const;

 private:
  BudgetSegment& segment_;
  std::string name_;
};

}  // namespace vkv::detail
