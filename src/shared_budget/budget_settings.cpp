// Resizing the budget and setting its members' limits at run time.
#include "budget_settings.h"

#include <algorithm>

#include "budget_books.h"
#include "budget_lock.h"
#include "member_registry.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

std::string text_of_bytes(std::uint64_t bytes) { return concat(bytes, " bytes (", format_bytes(bytes), ")"); }

}  // namespace

void expect_floors_fit(const std::string& description, std::uint64_t floors, std::uint64_t capacity,
                       const std::string& what) {
  VKV_EXPECTS(floors <= capacity, description, ": ", what, " members' floors would add up to ", text_of_bytes(floors),
              ", more than its capacity, ", text_of_bytes(capacity),
              ": lower a floor (python -m vkv.budget set) or raise the capacity");
}

void BudgetSettings::resize(std::size_t capacity) {
  BudgetBooks books(segment_);
  bool over = false;
  {
    BudgetLock lock(segment_);
    reap_locked(segment_);
    expect_floors_fit(budget_description(name_), books.floors_total(BudgetSegment::kMaxMembers), capacity,
                      concat("bytes = ", capacity, " is refused: the"));
    segment_.capacity.store(capacity, std::memory_order_relaxed);
    books.fit_reservation();
    over = books.request_if_short();
  }
  if (over) futex_wake_all(segment_.requests);
  books.wake_releases();
}

std::size_t BudgetSettings::set_limits(std::int32_t pid, const MemberLimits& limits, LimitChange set) {
  BudgetBooks books(segment_);
  bool asked = false;
  std::size_t changed = 0;
  {
    BudgetLock lock(segment_);
    reap_locked(segment_);
    std::uint64_t floors = 0;
    std::string pids;
    for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
      BudgetMemberRecord& row = segment_.members[i];
      if (row.pid == 0) continue;
      pids += concat(pids.empty() ? "" : ", ", row.pid);
      const bool target = row.pid == pid;
      const std::uint64_t floor = target && set.floor ? limits.floor : row.floor.load(std::memory_order_relaxed);
      const std::uint64_t cap = target && set.cap ? limits.cap : row.cap.load(std::memory_order_relaxed);
      floors += floor;
      if (!target) continue;
      ++changed;
      VKV_EXPECTS(cap == 0 || cap >= std::max<std::uint64_t>(row.page_bytes, floor), "cap = ", cap, " of pid ", pid,
                  " is less than ",
                  cap < row.page_bytes ? concat("one page of its cache, ", row.page_bytes, " bytes")
                                       : concat("its floor, ", floor, " bytes"),
                  ": raise it, or 0 for no cap");
    }
    VKV_EXPECTS(changed > 0, budget_description(name_), " has no member with pid ", pid,
                " (its members: ", pids.empty() ? "none" : pids, ")");
    expect_floors_fit(budget_description(name_), floors, segment_.capacity.load(std::memory_order_relaxed),
                      concat("with floor = ", limits.floor, " for pid ", pid, " the"));
    for (BudgetMemberRecord& row : segment_.members) {
      if (row.pid != pid) continue;
      if (set.floor) row.floor.store(limits.floor, std::memory_order_relaxed);
      if (set.cap) row.cap.store(limits.cap, std::memory_order_relaxed);
      if (set.priority) row.priority.store(limits.priority, std::memory_order_relaxed);
    }
    asked = books.request_if_short();
  }
  if (asked) futex_wake_all(segment_.requests);
  books.wake_releases();  // an asker waiting on a reservation for a new priority
  return changed;
}

}  // namespace vkv::detail
