// BudgetLedger: the shared books, every change under the segment's robust mutex.
#include "budget_ledger.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

// Request numbers wrap: `a` is at or after `b` when their difference, signed, is not negative.
bool at_or_after(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(a - b) >= 0; }

ProcessIdentity identity_of(const BudgetMemberRecord& row) noexcept { return {row.pid, row.start_time}; }

// A member `request` still waits for: it has not answered it yet, or owes a pledge.
bool owes_answer(const BudgetMemberRecord& row, std::uint32_t request) noexcept {
  return row.pledged > 0 || !at_or_after(row.answered, request);
}

std::uint64_t floor_gap(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t floor = row.floor.load(std::memory_order_relaxed);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  return floor > held ? floor - held : 0;
}

// What an ask can get from the member: what it holds, its requests do not claim (as of its
// last published call) and its floor does not keep; for a member an engine answers for,
// what its speaker said it could give, above the floor.
std::uint64_t giveable(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  const std::uint64_t floor = row.floor.load(std::memory_order_relaxed);
  if (row.speaker_pid.load(std::memory_order_relaxed) != 0)
    return std::min<std::uint64_t>(row.spare.load(std::memory_order_relaxed), held > floor ? held - floor : 0);
  const std::uint64_t in_use = row.in_use.load(std::memory_order_relaxed);
  return held > std::max(in_use, floor) ? held - std::max(in_use, floor) : 0;
}

// A spoken-for member's standing ask: what its speaker's goal lacks beyond what it holds,
// within its cap (a member short only of its own cap asks nobody).
std::uint64_t standing_ask(const BudgetMemberRecord& row) noexcept {
  if (row.speaker_pid.load(std::memory_order_relaxed) == 0) return 0;
  std::uint64_t goal = row.goal.load(std::memory_order_relaxed);
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  if (cap != 0) goal = std::min(goal, cap);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  return goal > held ? goal - held : 0;
}

ProcessIdentity speaker_of(const BudgetMemberRecord& row) noexcept {
  return {row.speaker_pid.load(std::memory_order_relaxed), row.speaker_start_time};
}

// No engine answers for the member any more: its standing ask, spare and promises go.
void forget_speaker(BudgetMemberRecord& row) noexcept {
  row.speaker_pid.store(0, std::memory_order_relaxed);
  row.speaker_start_time = 0;
  row.spare.store(0, std::memory_order_relaxed);
  row.goal.store(0, std::memory_order_relaxed);
  row.announced = 0;
  row.announced_ns = 0;
}

// The calling process, read from /proc once (again after a fork).
ProcessIdentity this_process() {
  static std::mutex mutex;
  static ProcessIdentity cached;
  std::lock_guard<std::mutex> lock(mutex);
  if (cached.pid != static_cast<std::int32_t>(getpid())) cached = ProcessIdentity::self();
  return cached;
}

// Room the member's cap leaves (all of `bytes` without a cap).
std::uint64_t cap_room(const BudgetMemberRecord& row, std::uint64_t bytes) noexcept {
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  if (cap == 0) return bytes;
  return std::min(bytes, cap > held ? cap - held : 0);
}

std::string text_of_bytes(std::uint64_t bytes) { return concat(bytes, " bytes (", format_bytes(bytes), ")"); }

}  // namespace

// Locks the mutex (at most shared_lock_timeout(): a stopped holder costs an error naming
// it, not a hang). When its owner died holding it, that process's half-done change may
// have left `used` off (even wrapped below zero): count the dead out and add `used` up
// again from the rows.
class BudgetLedger::Lock {
 public:
  explicit Lock(BudgetLedger& ledger) : lock_(ledger.segment_.mutex, "a shared budget") {
    if (!lock_.owner_died()) return;
    ledger.reap_locked();
    ledger.recount_locked();
  }

 private:
  RobustLock lock_;
};

std::size_t BudgetLedger::join(std::size_t page_bytes, const MemberLimits& limits, const std::string& label) {
  const ProcessIdentity self = ProcessIdentity::self();
  const std::string command = self.command();
  VKV_EXPECTS(limits.cap == 0 || limits.cap >= std::max<std::uint64_t>(page_bytes, limits.floor),
              "shared_budget_cap = ", limits.cap, " is less than ",
              limits.cap < page_bytes ? concat("one page of this cache, ", page_bytes, " bytes")
                                      : concat("shared_budget_floor = ", limits.floor),
              ": raise it, or 0 for no cap");
  bool asked = false;
  std::size_t member = BudgetSegment::kMaxMembers;
  {
    Lock lock(*this);
    reap_locked();
    expect_floors_fit(floors_total(BudgetSegment::kMaxMembers) + limits.floor,
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
      if (limits.floor > 0) asked = request_if_short_locked();
      break;
    }
  }
  if (asked) futex_wake_all(segment_.requests);
  if (member < BudgetSegment::kMaxMembers) return member;
  throw InvalidArgument(concat("the shared budget has ", BudgetSegment::kMaxMembers,
                               " members already, the most it can hold: close a cache that uses it first"));
}

void BudgetLedger::leave(std::size_t member) noexcept {
  try {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    const std::uint64_t held = row.held;
    clear_row(row);
    return_bytes(held);
    fit_reservation();
  } catch (...) {
    log_debug("shared budget: leaving failed (its mutex is broken); its bytes are counted back when the process exits");
  }
  wake_releases();
}

bool BudgetLedger::acquire(std::size_t member, std::size_t bytes) {
  return acquire_up_to(member, bytes, bytes) == bytes;
}

std::size_t BudgetLedger::acquire_up_to(std::size_t member, std::size_t bytes, std::size_t unit) {
  if (bytes == 0) return 0;
  Lock lock(*this);
  BudgetMemberRecord& row = segment_.members[member];
  auto take = [&] {
    const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
    const std::uint64_t used = segment_.used.load(std::memory_order_relaxed) + floor_gaps(member);
    const std::uint64_t free = cap_room(row, capacity > used ? capacity - used : 0);
    return std::min<std::uint64_t>(bytes, free / unit * unit);
  };
  // A standing ask's reservation is the member's own: what was given back for it comes first.
  std::uint64_t mine = std::min<std::uint64_t>(std::min(reserved_for(member), standing_ask(row)), bytes) / unit * unit;
  segment_.reserved -= mine;
  row.held += mine;
  bytes -= mine;
  std::uint64_t taken = take();
  if (taken < bytes && reap_locked() > 0) taken = take();  // a dead member's bytes (and floor) are free
  row.held += taken;
  segment_.used.fetch_add(taken, std::memory_order_relaxed);
  return mine + taken;
}

void BudgetLedger::release(std::size_t member, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  try {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    bytes = std::min<std::uint64_t>(bytes, row.held);
    row.held -= bytes;
    const std::uint64_t toward_pledge = std::min<std::uint64_t>(row.pledged, bytes);
    row.pledged -= toward_pledge;
    row.given_bytes.fetch_add(toward_pledge, std::memory_order_relaxed);
    return_bytes(bytes);
  } catch (...) {
    log_debug("shared budget: a release was not counted (its mutex is broken)");
  }
  wake_releases();
}

std::uint32_t BudgetLedger::ask(std::size_t member, std::size_t bytes, std::size_t needed) {
  std::uint32_t request = 0;
  {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    // Under a cap, what it may still take beyond what is free for it already.
    const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
    const std::uint64_t used = segment_.used.load(std::memory_order_relaxed) + floor_gaps(member);
    const std::uint64_t room = cap_room(row, ~std::uint64_t{0});
    const std::uint64_t beyond_free = room - std::min(room, capacity > used ? capacity - used : 0);
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

std::size_t BudgetLedger::free_hint(std::size_t member) const noexcept {
  const BudgetMemberRecord& row = segment_.members[member];
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed) + floor_gaps(member);
  // A standing ask's reservation is the member's to take (other askers' priorities aside: a hint).
  const std::uint64_t mine = std::min(segment_.reserved.load(std::memory_order_relaxed), standing_ask(row));
  return mine + cap_room(row, capacity > used ? capacity - used : 0);
}

std::string BudgetLedger::room_text(std::size_t member) const {
  const BudgetMemberRecord& row = segment_.members[member];
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed);
  const std::uint64_t gaps = floor_gaps(member);
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  std::string text = concat(description(), ": ", format_bytes(capacity > used ? capacity - used : 0), " of ",
                            format_bytes(capacity), " free");
  if (gaps > 0) text += concat(", ", format_bytes(gaps), " of it kept for the other members' floors");
  if (cap != 0)
    text += concat(", this cache holds ", format_bytes(row.held.load(std::memory_order_relaxed)), " of its cap ",
                   format_bytes(cap), " (shared_budget_cap)");
  return text;
}

std::size_t BudgetLedger::others_cached(std::size_t member) const noexcept {
  std::uint64_t cached = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i != member && row.pid.load(std::memory_order_relaxed) != 0) cached += giveable(row);
  }
  return cached;
}

// What askers of higher priority than `member` want: the reservation serves them first.
std::uint64_t BudgetLedger::wanted_above(std::size_t member) const noexcept {
  const std::uint32_t priority = segment_.members[member].priority.load(std::memory_order_relaxed);
  std::uint64_t wanted = 0;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0 && row.priority.load(std::memory_order_relaxed) > priority) wanted += asking(row);
  return wanted;
}

std::uint64_t BudgetLedger::reserved_for(std::size_t member) const noexcept {
  const std::uint64_t above = wanted_above(member);
  return segment_.reserved > above ? segment_.reserved - above : 0;
}

bool BudgetLedger::ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap) {
  Lock lock(*this);
  if (reap) reap_locked();
  return reserved_for(member) >= std::min<std::uint64_t>(enough, segment_.members[member].wanted) ||
         all_answered_locked(request, member);
}

bool BudgetLedger::all_answered(std::uint32_t request, std::size_t except, bool speakers_too) {
  Lock lock(*this);
  reap_locked();
  return all_answered_locked(request, except, speakers_too);
}

bool BudgetLedger::all_answered_locked(std::uint32_t request, std::size_t except, bool speakers_too) const noexcept {
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == except) continue;
    if (owes_answer(row, request)) return false;
    // A speaker answers at its engine's next step: until then what it owes is open.
    if (speakers_too && row.speaker_pid.load(std::memory_order_relaxed) != 0 && share_locked(i) > 0) return false;
  }
  return true;
}

bool BudgetLedger::answer_may_come(std::uint32_t request, std::size_t except) {
  Lock lock(*this);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == except) continue;
    if (owes_answer(row, request) && identity_of(row).running()) return true;
  }
  return false;
}

std::size_t BudgetLedger::claim_reserved(std::size_t member) noexcept {
  std::uint64_t taken = 0;
  try {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    taken = cap_room(row, std::min(reserved_for(member), asking(row)));
    segment_.reserved -= taken;  // `used` counts it either way
    row.held += taken;
    row.wanted = 0;
    fit_reservation();
  } catch (...) {
    log_debug("shared budget: claiming the reservation failed (its mutex is broken)");
  }
  wake_releases();
  return taken;
}

// A member of lower priority than `member` that could give something (not asking itself,
// holding unclaimed bytes above its floor) has not answered `request` yet and can still
// run: `member` answers after it. Reads /proc per such member.
bool BudgetLedger::lower_priority_may_give_locked(std::size_t member, std::uint32_t request) const noexcept {
  const std::uint32_t priority = segment_.members[member].priority.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == member || asking(row) > 0 || row.priority.load(std::memory_order_relaxed) >= priority)
      continue;
    if (owes_answer(row, request) && giveable(row) > 0 && identity_of(row).running()) return true;
  }
  return false;
}

std::size_t BudgetLedger::pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked_out, bool* deferred) {
  Lock lock(*this);
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
  const std::uint64_t asked = wanted + shortfall_beyond_wanted();
  if (asked_out != nullptr) *asked_out = asked;
  const std::uint64_t given = own + std::min<std::uint64_t>(can, asked > promised ? asked - promised : 0);
  row.pledged += given;
  return given;
}

void BudgetLedger::answered(std::size_t member, std::uint32_t request, std::size_t given, bool asked) noexcept {
  BudgetMemberRecord& row = segment_.members[member];
  try {
    Lock lock(*this);
    row.pledged = 0;
    if (at_or_after(request, row.answered)) row.answered = request;
  } catch (...) {
    log_debug("shared budget: an answer was not recorded (its mutex is broken)");
  }
  if (given > 0) row.give_backs.fetch_add(1, std::memory_order_relaxed);
  if (asked) row.last_answer_ns.store(monotonic_ns(), std::memory_order_relaxed);
  wake_releases();
}

void BudgetLedger::end_pledge(std::size_t member) noexcept {
  try {
    Lock lock(*this);
    segment_.members[member].pledged = 0;
  } catch (...) {
    log_debug("shared budget: a pledge was not ended (its mutex is broken)");
  }
  wake_releases();
}

std::size_t BudgetLedger::held(std::size_t member) {
  Lock lock(*this);
  return segment_.members[member].held;
}

std::uint32_t BudgetLedger::last_answered(std::size_t member) {
  Lock lock(*this);
  return segment_.members[member].answered;
}

void BudgetLedger::resize(std::size_t capacity) {
  bool over = false;
  {
    Lock lock(*this);
    reap_locked();
    expect_floors_fit(floors_total(BudgetSegment::kMaxMembers), capacity,
                      concat("bytes = ", capacity, " is refused: the"));
    segment_.capacity.store(capacity, std::memory_order_relaxed);
    fit_reservation();
    over = request_if_short_locked();
  }
  if (over) futex_wake_all(segment_.requests);
  wake_releases();
}

std::size_t BudgetLedger::set_limits(std::int32_t pid, const MemberLimits& limits, LimitChange set) {
  bool asked = false;
  std::size_t changed = 0;
  {
    Lock lock(*this);
    reap_locked();
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
    VKV_EXPECTS(changed > 0, description(), " has no member with pid ", pid,
                " (its members: ", pids.empty() ? "none" : pids, ")");
    expect_floors_fit(floors, segment_.capacity.load(std::memory_order_relaxed),
                      concat("with floor = ", limits.floor, " for pid ", pid, " the"));
    for (BudgetMemberRecord& row : segment_.members) {
      if (row.pid != pid) continue;
      if (set.floor) row.floor.store(limits.floor, std::memory_order_relaxed);
      if (set.cap) row.cap.store(limits.cap, std::memory_order_relaxed);
      if (set.priority) row.priority.store(limits.priority, std::memory_order_relaxed);
    }
    asked = request_if_short_locked();
  }
  if (asked) futex_wake_all(segment_.requests);
  wake_releases();  // an asker waiting on a reservation for a new priority
  return changed;
}

std::size_t BudgetLedger::reap() {
  std::size_t reaped = 0;
  {
    Lock lock(*this);
    reaped = reap_locked();
  }
  if (reaped > 0) wake_releases();
  return reaped;
}

std::size_t BudgetLedger::largest_page() {
  Lock lock(*this);
  reap_locked();
  std::uint64_t page = segment_.device_page_bytes;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) page = std::max(page, row.page_bytes);
  return page;
}

BudgetView BudgetLedger::view() {
  Lock lock(*this);
  reap_locked();
  const std::int64_t now = monotonic_ns();
  BudgetView view;
  view.capacity_bytes = segment_.capacity.load(std::memory_order_relaxed);
  view.used_bytes = segment_.used.load(std::memory_order_relaxed);
  view.reserved_bytes = segment_.reserved;
  view.device_total_bytes = segment_.device_total;
  VKV_EXPECTS(read_text(segment_.device, sizeof(segment_.device), view.device),
              "a shared budget's device name is corrupted (not NUL-terminated text): remove the budget and create it "
              "again");
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0) continue;
    BudgetMemberView member;
    member.pid = row.pid;
    member.page_bytes = row.page_bytes;
    member.held_bytes = row.held;
    member.in_use_bytes = row.in_use.load(std::memory_order_relaxed);
    member.wanted_bytes = asking(row);
    member.row = i;
    member.speaker_pid = row.speaker_pid.load(std::memory_order_relaxed);
    if (member.speaker_pid != 0)  // what its engine keeps: all it holds but what its scheduler could give
      member.in_use_bytes = member.held_bytes - std::min<std::size_t>(member.held_bytes, row.spare.load());
    member.limits = {row.floor.load(std::memory_order_relaxed), row.cap.load(std::memory_order_relaxed),
                     row.priority.load(std::memory_order_relaxed)};
    member.asks = row.asks.load(std::memory_order_relaxed);
    member.give_backs = row.give_backs.load(std::memory_order_relaxed);
    member.given_bytes = row.given_bytes.load(std::memory_order_relaxed);
    const std::int64_t answered_at = row.last_answer_ns.load(std::memory_order_relaxed);
    member.since_answer_ns = answered_at == 0 ? -1 : std::max<std::int64_t>(0, now - answered_at);
    const char* broken = nullptr;
    if (row.pid < 0)
      broken = "a negative pid";
    else if (!read_text(row.command, sizeof(row.command), member.command))
      broken = "a command that is not text";
    else if (!read_text(row.label, sizeof(row.label), member.label))
      broken = "a label that is not text";
    else if (row.page_bytes == 0 || (row.page_bytes & (row.page_bytes - 1)) != 0)
      broken = "a page size that is not a power of 2";
    if (broken != nullptr)
      throw Error(concat("a shared budget's member row ", i, " is corrupted (", broken, "; pid ", row.pid,
                         ", page_bytes ", row.page_bytes,
                         "): something other than vkv wrote its shared object; "
                         "remove the budget and create it again"));
    view.members.push_back(std::move(member));
  }
  return view;
}

std::size_t BudgetLedger::reap_locked() noexcept {
  std::size_t reaped = 0;
  for (BudgetMemberRecord& row : segment_.members) {
    if (row.pid != 0 && row.speaker_pid.load(std::memory_order_relaxed) != 0 && !speaker_of(row).alive())
      forget_speaker(row);
    if (row.pid == 0 || identity_of(row).alive()) continue;
    // The driver (or the kernel, for host memory) freed the dead process's pages.
    const std::uint64_t held = row.held;
    clear_row(row);
    return_bytes(held);
    ++reaped;
  }
  if (reaped > 0) fit_reservation();
  return reaped;
}

// `used` from the rows: what repairs it after an owner died mid-change or it wrapped.
void BudgetLedger::recount_locked() noexcept {
  std::uint64_t used = segment_.reserved;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) used += row.held;
  segment_.used.store(used, std::memory_order_relaxed);
}

void BudgetLedger::clear_row(BudgetMemberRecord& row) noexcept {
  row.pid = 0;
  row.start_time = 0;
  row.page_bytes = 0;
  std::memset(row.command, 0, sizeof(row.command));
  std::memset(row.label, 0, sizeof(row.label));
  row.held = 0;
  row.wanted = 0;
  row.pledged = 0;
  row.in_use.store(0, std::memory_order_relaxed);
  row.floor.store(0, std::memory_order_relaxed);  // a dead member's floor is counted out with it
  row.cap.store(0, std::memory_order_relaxed);
  row.priority.store(0, std::memory_order_relaxed);
  row.asks.store(0, std::memory_order_relaxed);
  row.give_backs.store(0, std::memory_order_relaxed);
  row.given_bytes.store(0, std::memory_order_relaxed);
  row.last_answer_ns.store(0, std::memory_order_relaxed);
  forget_speaker(row);
}

// `bytes` just left some member's `held`: into the reservation as far as askers want them
// and the capacity allows without taking the floors' gaps of members not asking, the rest
// out of `used`.
void BudgetLedger::return_bytes(std::size_t bytes) noexcept {
  const std::uint64_t wanted = wanted_total();
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  if (segment_.used.load(std::memory_order_relaxed) < bytes) {
    // The books are off (they can only be if something else wrote them): never wrap.
    recount_locked();
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

// A reservation nobody asks for any more is free capacity.
void BudgetLedger::fit_reservation() noexcept {
  const std::uint64_t wanted = wanted_total();
  if (segment_.reserved <= wanted) return;
  const std::uint64_t unwanted = segment_.reserved - wanted;
  segment_.reserved -= unwanted;
  segment_.used.fetch_sub(unwanted, std::memory_order_relaxed);
}

std::uint64_t BudgetLedger::wanted_total() const noexcept {
  std::uint64_t wanted = 0;
  for (const BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0) wanted += asking(row);
  return wanted;
}

std::uint64_t BudgetLedger::excess() const noexcept {
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed);
  return used > capacity ? used - capacity : 0;
}

std::uint64_t BudgetLedger::floor_gaps(std::size_t except, bool askers_too) const noexcept {
  std::uint64_t gaps = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i == except || row.pid.load(std::memory_order_relaxed) == 0 || (!askers_too && asking(row) > 0)) continue;
    gaps += floor_gap(row);
  }
  return gaps;
}

std::uint64_t BudgetLedger::shortfall_beyond_wanted() const noexcept {
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t kept =
      segment_.used.load(std::memory_order_relaxed) + floor_gaps(BudgetSegment::kMaxMembers, /*askers_too=*/false);
  return kept > capacity ? kept - capacity : 0;
}

std::uint64_t BudgetLedger::floors_total(std::size_t except) const noexcept {
  std::uint64_t floors = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (i != except && row.pid != 0) floors += row.floor.load(std::memory_order_relaxed);
  }
  return floors;
}

void BudgetLedger::expect_floors_fit(std::uint64_t floors, std::uint64_t capacity, const std::string& what) const {
  VKV_EXPECTS(floors <= capacity, description(), ": ", what, " members' floors would add up to ", text_of_bytes(floors),
              ", more than its capacity, ", text_of_bytes(capacity),
              ": lower a floor (python -m vkv.budget set) or raise the capacity");
}

bool BudgetLedger::request_if_short_locked() noexcept {
  bool short_now = shortfall_beyond_wanted() > 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers && !short_now; ++i)
    short_now = segment_.members[i].pid != 0 && over_cap(i) > 0;
  if (short_now) segment_.requests.fetch_add(1);
  return short_now;
}

void BudgetLedger::wake_releases() noexcept {
  segment_.releases.fetch_add(1);
  futex_wake_all(segment_.releases);
}

// ---- engines that answer for their members -----------------------------------------------

std::uint64_t BudgetLedger::asking(const BudgetMemberRecord& row) const noexcept {
  return std::max<std::uint64_t>(row.wanted, standing_ask(row));
}

std::uint64_t BudgetLedger::can_give(const BudgetMemberRecord& row) const noexcept {
  const std::uint64_t can = giveable(row);
  return can > row.pledged ? can - row.pledged : 0;
}

std::uint64_t BudgetLedger::open_asks_locked() const noexcept {
  std::uint64_t asked = shortfall_beyond_wanted();
  std::uint64_t promised = segment_.reserved;
  for (const BudgetMemberRecord& row : segment_.members) {
    if (row.pid == 0) continue;
    asked += asking(row);
    promised += row.pledged;
  }
  // What the askers can take without anyone giving: the free capacity, the floors' gaps of
  // the members not asking kept.
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t kept =
      segment_.used.load(std::memory_order_relaxed) + floor_gaps(BudgetSegment::kMaxMembers, /*askers_too=*/false);
  const std::uint64_t covered = promised + (capacity > kept ? capacity - kept : 0);
  return asked > covered ? asked - covered : 0;
}

std::uint64_t BudgetLedger::share_locked(std::size_t member) const noexcept {
  const BudgetMemberRecord& self = segment_.members[member];
  if (self.pid == 0 || asking(self) > 0) return 0;
  // Above its cap first, whoever asks.
  auto own_of = [this](std::size_t i) {
    const BudgetMemberRecord& row = segment_.members[i];
    const std::uint64_t over = over_cap(i);
    return std::min(can_give(row), over > row.pledged ? over - row.pledged : 0);
  };
  const std::uint64_t own = own_of(member);
  std::uint64_t open = open_asks_locked();
  if (open == 0) return own;
  // The asks: lowest priority first; within a priority, each keeps the same spare.
  struct Giver {
    std::uint32_t priority;
    std::uint64_t can;
    std::size_t index;
  };
  std::vector<Giver> givers;
  givers.reserve(BudgetSegment::kMaxMembers);
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || asking(row) > 0) continue;
    givers.push_back({row.priority.load(std::memory_order_relaxed), can_give(row) - own_of(i), i});
  }
  std::sort(givers.begin(), givers.end(), [](const Giver& a, const Giver& b) {
    return a.priority != b.priority ? a.priority < b.priority : a.can > b.can;
  });
  const std::uint32_t mine = self.priority.load(std::memory_order_relaxed);
  for (std::size_t first = 0; first < givers.size() && open > 0;) {
    std::size_t end = first;
    std::uint64_t level = 0;
    while (end < givers.size() && givers[end].priority == givers[first].priority) level += givers[end++].can;
    const bool my_level = givers[first].priority == mine;
    if (level <= open) {  // the whole level gives all it can
      if (my_level) return can_give(self);
      open -= level;
      first = end;
      continue;
    }
    if (!my_level) return own;  // a lower level covers the rest
    // The spare each keeps: the water level w at which what they give above it is `open`
    // (sorted by can, largest first), rounded so that they give no more than that.
    std::uint64_t above = 0;
    std::uint64_t water = 0;
    for (std::size_t k = first; k < end; ++k) {
      above += givers[k].can;
      if (above <= open) continue;  // these alone cannot cover it: the next gives too
      const std::uint64_t count = k - first + 1;
      water = (above - open + count - 1) / count;
      if (water >= (k + 1 < end ? givers[k + 1].can : 0)) break;  // the rest keep what they have
    }
    const std::uint64_t can = can_give(self) - own;
    return own + (can > water ? can - water : 0);
  }
  return own;
}

std::uint64_t BudgetLedger::room_locked(std::size_t member) const noexcept {
  const BudgetMemberRecord& row = segment_.members[member];
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed) + floor_gaps(member);
  return std::min(reserved_for(member), standing_ask(row)) + cap_room(row, capacity > used ? capacity - used : 0);
}

void BudgetLedger::reap_if_no_room_locked(std::size_t member) noexcept {
  if (room_locked(member) > 0) return;
  const std::int64_t now = monotonic_ns();
  if (now - reaped_at_ns_ < std::chrono::nanoseconds(kReannounce).count()) return;
  reaped_at_ns_ = now;
  reap_locked();
}

void BudgetLedger::forget_dead_speakers_locked() noexcept {
  // Only those asking: a dead engine's ask must not cost anyone a page (a /proc read each).
  for (BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0 && standing_ask(row) > 0 && !speaker_of(row).alive()) forget_speaker(row);
}

std::size_t BudgetLedger::find_label_locked(const std::string& label) const noexcept {
  if (label.empty()) return BudgetSegment::kMaxMembers;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    const std::size_t length = strnlen(row.label, sizeof(row.label));
    if (row.pid != 0 && length == std::min(label.size(), sizeof(row.label) - 1) &&
        std::memcmp(row.label, label.data(), length) == 0)
      return i;
  }
  return BudgetSegment::kMaxMembers;
}

EngineShare BudgetLedger::speak_for(const std::string& label, const EngineReport& report) {
  EngineShare share;
  bool wake = false;
  {
    Lock lock(*this);
    forget_dead_speakers_locked();
    const std::size_t member = find_label_locked(label);
    if (member == BudgetSegment::kMaxMembers) return share;
    reap_if_no_room_locked(member);
    BudgetMemberRecord& row = segment_.members[member];
    const ProcessIdentity speaker = this_process();
    row.speaker_start_time = speaker.start_time;
    row.speaker_pid.store(speaker.pid, std::memory_order_relaxed);
    row.spare.store(report.spare, std::memory_order_relaxed);
    row.goal.store(report.ask > 0 ? row.held + report.ask : 0, std::memory_order_relaxed);
    if (report.settled) row.pledged = 0;
    row.pledged += report.given;
    const std::int64_t now = monotonic_ns();
    if (report.given > 0) {
      row.give_backs.fetch_add(1, std::memory_order_relaxed);
      row.last_answer_ns.store(now, std::memory_order_relaxed);
    }
    share.found = true;
    share.asking = standing_ask(row);
    share.open = open_asks_locked();
    share.give = share_locked(member);
    share.room = room_locked(member);
    // Wake the others when an open ask appeared or grew, and again while it stays open (a
    // member that could not give before may now).
    if (share.asking == 0) {
      row.announced = 0;
    } else if (share.open > 0 && (share.asking > row.announced ||
                                  now - row.announced_ns >= std::chrono::nanoseconds(kReannounce).count())) {
      row.announced = share.asking;
      row.announced_ns = now;
      segment_.requests.fetch_add(1);
      row.asks.fetch_add(1, std::memory_order_relaxed);
      wake = true;
    }
    fit_reservation();  // an ask that ended frees what was reserved for it
  }
  if (wake) futex_wake_all(segment_.requests);
  return share;
}

EngineShare BudgetLedger::share_of(const std::string& label) {
  EngineShare share;
  Lock lock(*this);
  forget_dead_speakers_locked();
  const std::size_t member = find_label_locked(label);
  if (member == BudgetSegment::kMaxMembers) return share;
  reap_if_no_room_locked(member);
  share.found = true;
  share.asking = standing_ask(segment_.members[member]);
  share.open = open_asks_locked();
  share.give = share_locked(member);
  share.room = room_locked(member);
  return share;
}

}  // namespace vkv::detail
