// The budget's members: joining, leaving, and counting the dead out.
#include "member_registry.h"

#include <algorithm>

#include "budget_books.h"
#include "budget_lock.h"
#include "budget_settings.h"
#include "member_row.h"
#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {

std::size_t MemberRegistry::join(std::size_t page_bytes, const MemberLimits& limits, const std::string& label) {
  const ProcessIdentity self = ProcessIdentity::self();
  const std::string command = self.command();
  VKV_EXPECTS(limits.cap == 0 || limits.cap >= std::max<std::uint64_t>(page_bytes, limits.floor),
              "shared_budget_cap = ", limits.cap, " is less than ",
              limits.cap < page_bytes ? concat("one page of this cache, ", page_bytes, " bytes")
                                      : concat("shared_budget_floor = ", limits.floor),
              ": raise it, or 0 for no cap");
  BudgetBooks books(segment_);
  bool asked = false;
  std::size_t member = BudgetSegment::kMaxMembers;
  {
    BudgetLock lock(segment_);
    reap_locked(segment_);
    expect_floors_fit(budget_description(name_), books.floors_total(BudgetSegment::kMaxMembers) + limits.floor,
                      segment_.capacity.load(std::memory_order_relaxed),
                      concat("with shared_budget_floor = ", limits.floor, " the"));
    for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
      BudgetMemberRecord& row = segment_.members[i];
      if (row.pid != 0) continue;
      clear_row(row);
      row.pid = self.pid;
      row.start_time = self.start_time;
      row.page_bytes = page_bytes;
      copy_text(row.command, sizeof(row.command), command);
      copy_text(row.label, sizeof(row.label), label);
      row.floor.store(limits.floor, std::memory_order_relaxed);
      row.cap.store(limits.cap, std::memory_order_relaxed);
      row.priority.store(limits.priority, std::memory_order_relaxed);
      row.answered = segment_.requests.load();  // requests before it joined are not its to answer
      member = i;
      // Its floor may be held by others' unclaimed pages: they give them back.
      if (limits.floor > 0) asked = books.request_if_short();
      break;
    }
  }
  if (asked) futex_wake_all(segment_.requests);
  if (member < BudgetSegment::kMaxMembers) return member;
  throw InvalidArgument(concat("the shared budget has ", BudgetSegment::kMaxMembers,
                               " members already, the most it can hold: close a cache that uses it first"));
}

void MemberRegistry::leave(std::size_t member) noexcept {
  BudgetBooks books(segment_);
  try {
    BudgetLock lock(segment_);
    BudgetMemberRecord& row = segment_.members[member];
    const std::uint64_t held = row.held;
    clear_row(row);
    books.return_bytes(held);
    books.fit_reservation();
  } catch (...) {
    log_debug("shared budget: leaving failed (its mutex is broken); its bytes are counted back when the process exits");
  }
  books.wake_releases();
}

std::size_t MemberRegistry::reap() {
  std::size_t reaped = 0;
  {
    BudgetLock lock(segment_);
    reaped = reap_locked(segment_);
  }
  if (reaped > 0) BudgetBooks(segment_).wake_releases();
  return reaped;
}

std::size_t MemberRegistry::largest_page() {
  BudgetLock lock(segment_);
  reap_locked(segment_);
  std::uint64_t page = segment_.device_page_bytes;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) page = std::max(page, row.page_bytes);
  return page;
}

std::size_t reap_locked(BudgetSegment& segment) noexcept {
  BudgetBooks books(segment);
  std::size_t reaped = 0;
  for (BudgetMemberRecord& row : segment.members) {
    if (row.pid != 0 && row.speaker_pid.load(std::memory_order_relaxed) != 0 && !speaker_of(row).alive())
      forget_speaker(row);
    if (row.pid == 0 || identity_of(row).alive()) continue;
    // The driver (or the kernel, for host memory) freed the dead process's pages.
    const std::uint64_t held = row.held;
    clear_row(row);
    books.return_bytes(held);
    ++reaped;
  }
  if (reaped > 0) books.fit_reservation();
  return reaped;
}

}  // namespace vkv::detail
