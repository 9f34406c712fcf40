// Asking and answering, when a member runs short: ask() posts what it wants and bumps
// `requests`; every other member's watcher wakes, pledge()s what it can give back without
// touching a claimed page (deferred-reclamation pages, pages mapped ahead, free pages) and
// releases it (MemberHoldings::release()). Released bytes go to `reserved` while someone
// asks, so a third member cannot take them first. The asker waits until the reservation
// covers what it wants or every live member has answered, then takes the reservation with
// claim_reserved(). A capacity lowered below `used` (BudgetSettings::resize()) asks the
// same way for the excess.
//
// Priorities order the giving: a member answers a request only once every member of lower
// priority that could give has answered it (pledge()'s `deferred`), and what is given back
// goes to the askers of higher priority first. No ask takes a member below its floor.
//
// Internal. Thread- and process-safety: every call locks the segment's mutex (BudgetLock),
// but others_cached(), count_ask() and given_bytes(), which read atomics without it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "budget_segment.h"

namespace vkv::detail {

class BudgetAsks {
 public:
  /// `segment` must stay mapped while this is used.
  explicit BudgetAsks(BudgetSegment& segment) noexcept : segment_(segment) {}

  // ---- the asker -------------------------------------------------------------------------
  /// Asks the other members for `bytes`, of which it needs `needed`: at most what its cap
  /// leaves room for beyond the free capacity, and nothing when that is less than `needed`
  /// (the cap refuses it whatever the others give). Returns the request's number.
  std::uint32_t ask(std::size_t member, std::size_t bytes, std::size_t needed = 0);
  /// Bytes the other live members hold, their requests do not claim (as of their last
  /// published call) and their floors do not keep: what asking could bring at most.
  /// Lock-free reads; a hint.
  std::size_t others_cached(std::size_t member) const noexcept;
  /// Whether the asker should stop waiting: its share of the reservation (what askers of
  /// higher priority do not want) covers `enough` bytes (at most what it wants), or every
  /// other live member answered `request` and no pledge is outstanding. With `reap`, counts
  /// dead members out first (a read of /proc per member).
  bool ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap = true);
  /// Every live member but `except` has answered `request`, and no pledge is outstanding.
  /// With `speakers_too`: a member spoken for owes an answer while its share is not 0.
  bool all_answered(std::uint32_t request, std::size_t except = BudgetSegment::kMaxMembers, bool speakers_too = false);
  /// Some member but `except` that has not answered `request` yet (or owes a pledge) is
  /// alive and not stopped: slow, not gone. Reads /proc per such member.
  bool answer_may_come(std::uint32_t request, std::size_t except);
  /// Ends the member's ask and moves up to what it wanted from its share of the reservation
  /// (within its cap) into its `held`; returns those bytes (the caller creates pages from
  /// them or releases them).
  std::size_t claim_reserved(std::size_t member) noexcept;
  /// Counts an ask of the member (for people watching; lock-free).
  void count_ask(std::size_t member) noexcept { segment_.members[member].asks.fetch_add(1); }

  // ---- the givers ------------------------------------------------------------------------
  /// What the member holds above its cap, then what the other members ask for and no one
  /// has pledged yet plus any excess over the capacity (the floors' gaps counted as
  /// used): the member pledges up to `can_give` of it, never going below its floor, and
  /// returns its pledge. `asked` (may be null): all that, pledged or not.
  /// With `deferred`: pledges nothing and sets it while a member of lower priority that
  /// could give (not asking itself, holding unclaimed bytes above its floor) has not
  /// answered the latest request and can still run (checked under the pledge's lock;
  /// reads /proc per such member): lower priorities give first.
  std::size_t pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked = nullptr,
                     bool* deferred = nullptr);
  /// The member has given back what it could of its pledge for `request` (`given` bytes,
  /// counted as a give-back when not 0); `asked`: another member or a resize wanted bytes
  /// (the time of its last answer is recorded).
  void answered(std::size_t member, std::uint32_t request, std::size_t given = 0, bool asked = false) noexcept;
  /// The member has given back what it could of a pledge made outside an answer (its cap).
  void end_pledge(std::size_t member) noexcept;
  /// The last request the member answered (at joining: the last one before it joined).
  std::uint32_t last_answered(std::size_t member);
  /// Bytes the member gave back toward its pledges so far (lock-free).
  std::size_t given_bytes(std::size_t member) const noexcept {
    return segment_.members[member].given_bytes.load(std::memory_order_relaxed);
  }

 private:
  bool all_answered_locked(std::uint32_t request, std::size_t except, bool speakers_too = false) const noexcept;
  bool lower_priority_may_give_locked(std::size_t member, std::uint32_t request) const noexcept;

  BudgetSegment& segment_;
};

}  // namespace vkv::detail
