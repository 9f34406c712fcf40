// A member's holdings: taking, returning, and the hints read before taking.
#include "member_holdings.h"

#include <algorithm>

#include "budget_books.h"
#include "budget_lock.h"
#include "member_registry.h"
#include "member_row.h"
#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {

bool MemberHoldings::acquire(std::size_t member, std::size_t bytes) {
  return acquire_up_to(member, bytes, bytes) == bytes;
}

std::size_t MemberHoldings::acquire_up_to(std::size_t member, std::size_t bytes, std::size_t unit) {
  if (bytes == 0) return 0;
  BudgetLock lock(segment_);
  BudgetBooks books(segment_);
  BudgetMemberRecord& row = segment_.members[member];
  // A standing ask's reservation is the member's own: what was given back for it comes
  // first, and free capacity within its cap after it; whole units of the two together.
  std::uint64_t mine = 0;
  auto fitting = [&] {
    mine = std::min<std::uint64_t>(std::min(books.reserved_for(member), standing_ask(row)), bytes);
    return std::min<std::uint64_t>(bytes, mine + cap_room(row, books.free_for(member), mine)) / unit * unit;
  };
  std::uint64_t total = fitting();
  if (total < bytes && reap_locked(segment_) > 0) total = fitting();  // a dead member's bytes (and floor) are free
  mine = std::min(mine, total);
  segment_.reserved -= mine;
  row.held += total;
  segment_.used.fetch_add(total - mine, std::memory_order_relaxed);
  return total;
}

void MemberHoldings::release(std::size_t member, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  BudgetBooks books(segment_);
  try {
    BudgetLock lock(segment_);
    BudgetMemberRecord& row = segment_.members[member];
    bytes = std::min<std::uint64_t>(bytes, row.held);
    row.held -= bytes;
    const std::uint64_t toward_pledge = std::min<std::uint64_t>(row.pledged, bytes);
    row.pledged -= toward_pledge;
    row.given_bytes.fetch_add(toward_pledge, std::memory_order_relaxed);
    books.return_bytes(bytes);
  } catch (...) {
    log_debug("shared budget: a release was not counted (its mutex is broken)");
  }
  books.wake_releases();
}

std::size_t MemberHoldings::held(std::size_t member) {
  BudgetLock lock(segment_);
  return segment_.members[member].held;
}

std::size_t MemberHoldings::free_hint(std::size_t member) const noexcept {
  const BudgetBooks books(segment_);
  const BudgetMemberRecord& row = segment_.members[member];
  // A standing ask's reservation is the member's to take (other askers' priorities aside: a hint).
  const std::uint64_t mine = std::min(segment_.reserved.load(std::memory_order_relaxed), standing_ask(row));
  return mine + cap_room(row, books.free_for(member));
}

std::string MemberHoldings::room_text(std::size_t member) const {
  const BudgetBooks books(segment_);
  const BudgetMemberRecord& row = segment_.members[member];
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed);
  const std::uint64_t gaps = books.floor_gaps(member);
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  std::string text = concat(budget_description(name_), ": ", format_bytes(capacity > used ? capacity - used : 0),
                            " of ", format_bytes(capacity), " free");
  if (gaps > 0) text += concat(", ", format_bytes(gaps), " of it kept for the other members' floors");
  if (cap != 0)
    text += concat(", this cache holds ", format_bytes(row.held.load(std::memory_order_relaxed)), " of its cap ",
                   format_bytes(cap), " (shared_budget_cap)");
  return text;
}

}  // namespace vkv::detail
