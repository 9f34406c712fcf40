// The books' totals and the moves of bytes between them.
#include "budget_books.h"

#include <algorithm>

#include "member_row.h"

namespace vkv::detail {

std::uint64_t BudgetBooks::wanted_total() const noexcept {
  std::uint64_t wanted = 0;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) wanted += asking(row);
  return wanted;
}

std::uint64_t BudgetBooks::floor_gaps(std::size_t except, bool askers_too) const noexcept {
  std::uint64_t gaps = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i == except || row.pid.load(std::memory_order_relaxed) == 0 || (!askers_too && asking(row) > 0)) continue;
    gaps += floor_gap(row);
  }
  return gaps;
}

std::uint64_t BudgetBooks::floors_total(std::size_t except) const noexcept {
  std::uint64_t floors = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i != except && row.pid != 0) floors += row.floor.load(std::memory_order_relaxed);
  }
  return floors;
}

std::uint64_t BudgetBooks::free_for(std::size_t member) const noexcept {
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed) + floor_gaps(member);
  return capacity > used ? capacity - used : 0;
}

std::uint64_t BudgetBooks::shortfall_beyond_wanted() const noexcept {
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t kept =
      segment_.used.load(std::memory_order_relaxed) + floor_gaps(BudgetSegment::kMaxMembers, /*askers_too=*/false);
  return kept > capacity ? kept - capacity : 0;
}

std::uint64_t BudgetBooks::wanted_above(std::size_t member) const noexcept {
  const std::uint32_t priority = segment_.members[member].priority.load(std::memory_order_relaxed);
  std::uint64_t wanted = 0;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0 && row.priority.load(std::memory_order_relaxed) > priority) wanted += asking(row);
  return wanted;
}

std::uint64_t BudgetBooks::reserved_for(std::size_t member) const noexcept {
  const std::uint64_t above = wanted_above(member);
  return segment_.reserved > above ? segment_.reserved - above : 0;
}

void BudgetBooks::return_bytes(std::size_t bytes) noexcept {
  const std::uint64_t wanted = wanted_total();
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  if (segment_.used.load(std::memory_order_relaxed) < bytes) {
    // The books are off (they can only be if something else wrote them): never wrap.
    recount();
    segment_.used.fetch_add(bytes, std::memory_order_relaxed);  // `bytes` left a row already
  }
  const std::uint64_t used_without = segment_.used.load(std::memory_order_relaxed) - bytes;
  const std::uint64_t kept = used_without + floor_gaps(BudgetSegment::kMaxMembers, /*askers_too=*/false);
  const std::uint64_t room =
      std::min(wanted > segment_.reserved ? wanted - segment_.reserved : 0, capacity > kept ? capacity - kept : 0);
  const std::uint64_t reserved = std::min<std::uint64_t>(bytes, room);
  segment_.reserved += reserved;
  segment_.used.store(used_without + reserved, std::memory_order_relaxed);
}

void BudgetBooks::fit_reservation() noexcept {
  const std::uint64_t wanted = wanted_total();
  if (segment_.reserved <= wanted) return;
  const std::uint64_t unwanted = segment_.reserved - wanted;
  segment_.reserved -= unwanted;
  segment_.used.fetch_sub(unwanted, std::memory_order_relaxed);
}

void BudgetBooks::recount() noexcept {
  std::uint64_t used = segment_.reserved;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) used += row.held;
  segment_.used.store(used, std::memory_order_relaxed);
}

bool BudgetBooks::request_if_short() noexcept {
  bool short_now = shortfall_beyond_wanted() > 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers && !short_now; ++i)
    short_now = segment_.members[i].pid != 0 && over_cap(segment_.members[i]) > 0;
  if (short_now) segment_.requests.fetch_add(1);
  return short_now;
}

void BudgetBooks::wake_releases() noexcept {
  segment_.releases.fetch_add(1);
  futex_wake_all(segment_.releases);
}

}  // namespace vkv::detail
