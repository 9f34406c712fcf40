// Asking and answering between members.
#include "budget_asks.h"

#include <algorithm>

#include "budget_books.h"
#include "budget_lock.h"
#include "engine_shares.h"
#include "member_registry.h"
#include "member_row.h"
#include "util/log.h"

namespace vkv::detail {

std::uint32_t BudgetAsks::ask(std::size_t member, std::size_t bytes, std::size_t needed) {
  std::uint32_t request = 0;
  {
    BudgetLock lock(segment_);
    BudgetMemberRecord& row = segment_.members[member];
    // Under a cap, what it may still take beyond what is free for it already.
    const std::uint64_t room = cap_room(row, ~std::uint64_t{0});
    const std::uint64_t beyond_free = room - std::min(room, BudgetBooks(segment_).free_for(member));
    if (beyond_free < std::min(needed, bytes)) {  // the cap refuses it whatever the others give
      row.wanted = 0;
      return segment_.requests.load();
    }
    row.wanted = std::min<std::uint64_t>(bytes, beyond_free);
    request = segment_.requests.fetch_add(1) + 1;
  }
  count_ask(member);
  futex_wake_all(segment_.requests);
  return request;
}

std::size_t BudgetAsks::others_cached(std::size_t member) const noexcept {
  std::uint64_t cached = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i != member && row.pid.load(std::memory_order_relaxed) != 0) cached += giveable(row);
  }
  return cached;
}

bool BudgetAsks::ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap) {
  BudgetLock lock(segment_);
  if (reap) reap_locked(segment_);
  return BudgetBooks(segment_).reserved_for(member) >=
             std::min<std::uint64_t>(enough, segment_.members[member].wanted) ||
         all_answered_locked(request, member);
}

bool BudgetAsks::all_answered(std::uint32_t request, std::size_t except, bool speakers_too) {
  BudgetLock lock(segment_);
  reap_locked(segment_);
  return all_answered_locked(request, except, speakers_too);
}

bool BudgetAsks::all_answered_locked(std::uint32_t request, std::size_t except, bool speakers_too) const noexcept {
  const BudgetBooks books(segment_);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == except) continue;
    if (owes_answer(row, request)) return false;
    // A speaker answers at its engine's next step: until then what it owes is open.
    if (speakers_too && row.speaker_pid.load(std::memory_order_relaxed) != 0 && share_wanted(books, i) > 0)
      return false;
  }
  return true;
}

bool BudgetAsks::answer_may_come(std::uint32_t request, std::size_t except) {
  BudgetLock lock(segment_);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == except) continue;
    if (owes_answer(row, request) && identity_of(row).running()) return true;
  }
  return false;
}

std::size_t BudgetAsks::claim_reserved(std::size_t member) noexcept {
  BudgetBooks books(segment_);
  std::uint64_t taken = 0;
  try {
    BudgetLock lock(segment_);
    BudgetMemberRecord& row = segment_.members[member];
    taken = cap_room(row, std::min(books.reserved_for(member), asking(row)));
    segment_.reserved -= taken;  // `used` counts it either way
    row.held += taken;
    row.wanted = 0;
    books.fit_reservation();
  } catch (...) {
    log_debug("shared budget: claiming the reservation failed (its mutex is broken)");
  }
  books.wake_releases();
  return taken;
}

// A member of lower priority than `member` that could give something (not asking itself,
// holding unclaimed bytes above its floor) has not answered `request` yet and can still
// run: `member` answers after it. Reads /proc per such member.
bool BudgetAsks::lower_priority_may_give_locked(std::size_t member, std::uint32_t request) const noexcept {
  const std::uint32_t priority = segment_.members[member].priority.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == member || asking(row) > 0 || row.priority.load(std::memory_order_relaxed) >= priority)
      continue;
    if (owes_answer(row, request) && giveable(row) > 0 && identity_of(row).running()) return true;
  }
  return false;
}

std::size_t BudgetAsks::pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked_out, bool* deferred) {
  BudgetLock lock(segment_);
  BudgetMemberRecord& row = segment_.members[member];
  // The latest request, not the one the watcher woke for: what is wanted now may be a
  // newer ask that the lower priorities have not answered yet.
  if (deferred != nullptr) {
    *deferred = lower_priority_may_give_locked(member, segment_.requests.load());
    if (*deferred) return 0;
  }
  std::uint64_t wanted = 0;
  std::uint64_t pledged = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& other = segment_.members[i];
    if (other.pid == 0) continue;
    if (i != member) wanted += asking(other);
    pledged += other.pledged;
  }
  // Never below its floor, whoever asks; what it holds above its cap first.
  const std::uint64_t held = row.held;
  const std::uint64_t floor = row.floor.load(std::memory_order_relaxed);
  std::uint64_t can = std::min<std::uint64_t>(can_give, held > floor ? held - floor : 0);
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  const std::uint64_t over = cap != 0 && held > cap ? held - cap : 0;
  const std::uint64_t own = std::min(can, over > row.pledged ? over - row.pledged : 0);
  can -= own;
  const std::uint64_t promised = segment_.reserved + pledged + own;
  const std::uint64_t asked = wanted + BudgetBooks(segment_).shortfall_beyond_wanted();
  if (asked_out != nullptr) *asked_out = asked;
  const std::uint64_t given = own + std::min<std::uint64_t>(can, asked > promised ? asked - promised : 0);
  row.pledged += given;
  return given;
}

void BudgetAsks::answered(std::size_t member, std::uint32_t request, std::size_t given, bool asked) noexcept {
  BudgetMemberRecord& row = segment_.members[member];
  try {
    BudgetLock lock(segment_);
    row.pledged = 0;
    if (at_or_after(request, row.answered)) row.answered = request;
  } catch (...) {
    log_debug("shared budget: an answer was not recorded (its mutex is broken)");
  }
  if (given > 0) row.give_backs.fetch_add(1, std::memory_order_relaxed);
  if (asked) row.last_answer_ns.store(monotonic_ns(), std::memory_order_relaxed);
  BudgetBooks(segment_).wake_releases();
}

void BudgetAsks::end_pledge(std::size_t member) noexcept {
  try {
    BudgetLock lock(segment_);
    segment_.members[member].pledged = 0;
  } catch (...) {
    log_debug("shared budget: a pledge was not ended (its mutex is broken)");
  }
  BudgetBooks(segment_).wake_releases();
}

std::uint32_t BudgetAsks::last_answered(std::size_t member) {
  BudgetLock lock(segment_);
  return segment_.members[member].answered;
}

}  // namespace vkv::detail
