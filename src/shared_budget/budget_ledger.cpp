// BudgetLedger: the shared books, every change under the segment's robust mutex.
#include "budget_ledger.h"

#include <algorithm>
#include <cstring>

#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

// Request numbers wrap: `a` is at or after `b` when their difference, signed, is not negative.
bool at_or_after(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(a - b) >= 0; }

bool printable(char c) noexcept { return c >= 0x20 && c < 0x7f; }

// NUL-terminated, printable ASCII: what view() accepts back (a process name may hold
// other bytes, and cutting UTF-8 at 15 bytes would leave half a character).
void copy_text(char* into, std::size_t size, const std::string& text) noexcept {
  std::memset(into, 0, size);
  const std::size_t length = std::min(size - 1, text.size());
  for (std::size_t i = 0; i < length; ++i) into[i] = printable(text[i]) ? text[i] : '?';
}

// The text of a field copy_text() wrote; empty when it is not (no NUL, or other bytes).
bool read_text(const char* from, std::size_t size, std::string& text) {
  const std::size_t length = strnlen(from, size);
  if (length == size || !std::all_of(from, from + length, printable)) return false;
  text.assign(from, length);
  return true;
}

ProcessIdentity identity_of(const BudgetMemberRecord& row) noexcept { return {row.pid, row.start_time}; }

// A member `request` still waits for: it has not answered it yet, or owes a pledge.
bool owes_answer(const BudgetMemberRecord& row, std::uint32_t request) noexcept {
  return row.pledged > 0 || !at_or_after(row.answered, request);
}

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

void BudgetLedger::initialize(BudgetSegment& segment, std::size_t capacity, std::size_t device_total,
                              const std::string& device, const std::string& identity, unsigned mode,
                              std::size_t device_page_bytes) {
  segment.version = BudgetSegment::kVersion;
  segment.mode = mode & 0777;
  segment.device_page_bytes = device_page_bytes;
  segment.mutex.init();
  segment.capacity.store(capacity);
  segment.device_total = device_total;
  copy_text(segment.device, sizeof(segment.device), device);
  copy_text(segment.identity, sizeof(segment.identity), identity);
  segment.magic.store(BudgetSegment::kMagic, std::memory_order_release);
}

std::size_t BudgetLedger::join(std::size_t page_bytes) {
  const ProcessIdentity self = ProcessIdentity::self();
  const std::string command = self.command();
  Lock lock(*this);
  reap_locked();
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    BudgetMemberRecord& row = segment_.members[i];
    if (row.pid != 0) continue;
    clear_row(row);
    row.pid = self.pid;
    row.start_time = self.start_time;
    row.page_bytes = page_bytes;
    copy_text(row.command, sizeof(row.command), command);
    row.answered = segment_.requests.load();  // requests before it joined are not its to answer
    return i;
  }
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
  auto take = [&] {
    const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
    const std::uint64_t used = segment_.used.load(std::memory_order_relaxed);
    const std::uint64_t free = capacity > used ? capacity - used : 0;
    return std::min<std::uint64_t>(bytes, free / unit * unit);
  };
  std::uint64_t taken = take();
  if (taken < bytes && reap_locked() > 0) taken = take();  // a dead member's bytes are free
  segment_.members[member].held += taken;
  segment_.used.fetch_add(taken, std::memory_order_relaxed);
  return taken;
}

void BudgetLedger::release(std::size_t member, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  try {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    bytes = std::min<std::uint64_t>(bytes, row.held);
    row.held -= bytes;
    row.pledged -= std::min<std::uint64_t>(row.pledged, bytes);
    return_bytes(bytes);
  } catch (...) {
    log_debug("shared budget: a release was not counted (its mutex is broken)");
  }
  wake_releases();
}

std::uint32_t BudgetLedger::ask(std::size_t member, std::size_t bytes) {
  std::uint32_t request = 0;
  {
    Lock lock(*this);
    segment_.members[member].wanted = bytes;
    request = segment_.requests.fetch_add(1) + 1;
  }
  futex_wake_all(segment_.requests);
  return request;
}

std::size_t BudgetLedger::others_cached(std::size_t member) const noexcept {
  std::uint64_t cached = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    const std::uint64_t held = row.held.load(std::memory_order_relaxed);
    const std::uint64_t in_use = row.in_use.load(std::memory_order_relaxed);
    if (i != member && row.pid.load(std::memory_order_relaxed) != 0 && held > in_use) cached += held - in_use;
  }
  return cached;
}

bool BudgetLedger::ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap) {
  Lock lock(*this);
  if (reap) reap_locked();
  return segment_.reserved >= std::min<std::uint64_t>(enough, segment_.members[member].wanted) ||
         all_answered_locked(request, member);
}

bool BudgetLedger::all_answered(std::uint32_t request, std::size_t except) {
  Lock lock(*this);
  reap_locked();
  return all_answered_locked(request, except);
}

bool BudgetLedger::all_answered_locked(std::uint32_t request, std::size_t except) const noexcept {
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0 || i == except) continue;
    if (owes_answer(row, request)) return false;
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
    taken = std::min(segment_.reserved, row.wanted);
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

std::size_t BudgetLedger::pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked_out) {
  Lock lock(*this);
  std::uint64_t wanted = 0;
  std::uint64_t pledged = 0;
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment_.members[i];
    if (row.pid == 0) continue;
    if (i != member) wanted += row.wanted;
    pledged += row.pledged;
  }
  const std::uint64_t promised = segment_.reserved + pledged;
  const std::uint64_t asked = wanted + excess();
  if (asked_out != nullptr) *asked_out = asked;
  const std::uint64_t given = std::min<std::uint64_t>(can_give, asked > promised ? asked - promised : 0);
  segment_.members[member].pledged += given;
  return given;
}

void BudgetLedger::answered(std::size_t member, std::uint32_t request) noexcept {
  try {
    Lock lock(*this);
    BudgetMemberRecord& row = segment_.members[member];
    row.pledged = 0;
    if (at_or_after(request, row.answered)) row.answered = request;
  } catch (...) {
    log_debug("shared budget: an answer was not recorded (its mutex is broken)");
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
    segment_.capacity.store(capacity, std::memory_order_relaxed);
    fit_reservation();
    over = excess() > 0;
    if (over) segment_.requests.fetch_add(1);
  }
  if (over) futex_wake_all(segment_.requests);
  wake_releases();
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
    BudgetMemberView member{row.pid,   "", row.page_bytes, row.held, row.in_use.load(std::memory_order_relaxed),
                            row.wanted};
    const char* broken = nullptr;
    if (row.pid < 0)
      broken = "a negative pid";
    else if (!read_text(row.command, sizeof(row.command), member.command))
      broken = "a command that is not text";
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
  row.held = 0;
  row.wanted = 0;
  row.pledged = 0;
  row.in_use.store(0, std::memory_order_relaxed);
}

// `bytes` just left some member's `held`: into the reservation as far as askers want them
// and the capacity allows, the rest out of `used`.
void BudgetLedger::return_bytes(std::size_t bytes) noexcept {
  const std::uint64_t wanted = wanted_total();
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  if (segment_.used.load(std::memory_order_relaxed) < bytes) {
    // The books are off (they can only be if something else wrote them): never wrap.
    recount_locked();
    segment_.used.fetch_add(bytes, std::memory_order_relaxed);  // `bytes` left a row already
  }
  const std::uint64_t used_without = segment_.used.load(std::memory_order_relaxed) - bytes;
  const std::uint64_t room = std::min(wanted > segment_.reserved ? wanted - segment_.reserved : 0,
                                      capacity > used_without ? capacity - used_without : 0);
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
    if (row.pid != 0) wanted += row.wanted;
  return wanted;
}

std::uint64_t BudgetLedger::excess() const noexcept {
  const std::uint64_t capacity = segment_.capacity.load(std::memory_order_relaxed);
  const std::uint64_t used = segment_.used.load(std::memory_order_relaxed);
  return used > capacity ? used - capacity : 0;
}

void BudgetLedger::wake_releases() noexcept {
  segment_.releases.fetch_add(1);
  futex_wake_all(segment_.releases);
}

}  // namespace vkv::detail
