// Engines that answer for their members: their reports, and each member's share of the asks.
#include "engine_shares.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "budget_lock.h"
#include "member_registry.h"
#include "member_row.h"

namespace vkv::detail {
namespace {

// The calling process, read from /proc once (again after a fork).
ProcessIdentity this_process() {
  static std::mutex mutex;
  static ProcessIdentity cached;
  std::lock_guard<std::mutex> lock(mutex);
  if (cached.pid != static_cast<std::int32_t>(getpid())) cached = ProcessIdentity::self();
  return cached;
}

}  // namespace

std::uint64_t open_asks(const BudgetBooks& books) noexcept {
  const BudgetSegment& segment = books.segment();
  std::uint64_t asked = books.shortfall_beyond_wanted();
  std::uint64_t promised = segment.reserved;
  for (const BudgetMemberRecord& row : segment.members) {
    if (row.pid == 0) continue;
    asked += asking(row);
    promised += row.pledged;
  }
  // What the askers can take without anyone giving: the free capacity, the floors' gaps of
  // the members not asking kept.
  const std::uint64_t capacity = segment.capacity.load(std::memory_order_relaxed);
  const std::uint64_t kept =
      segment.used.load(std::memory_order_relaxed) + books.floor_gaps(BudgetSegment::kMaxMembers, /*askers_too=*/false);
  const std::uint64_t covered = promised + (capacity > kept ? capacity - kept : 0);
  return asked > covered ? asked - covered : 0;
}

std::uint64_t share_wanted(const BudgetBooks& books, std::size_t member) noexcept {
  const BudgetSegment& segment = books.segment();
  const BudgetMemberRecord& self = segment.members[member];
  if (self.pid == 0 || asking(self) > 0) return 0;
  // Above its cap first, whoever asks.
  auto own_of = [&segment](std::size_t i) {
    const BudgetMemberRecord& row = segment.members[i];
    const std::uint64_t over = over_cap(row);
    return std::min(can_give(row), over > row.pledged ? over - row.pledged : 0);
  };
  const std::uint64_t own = own_of(member);
  std::uint64_t open = open_asks(books);
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
    const BudgetMemberRecord& row = segment.members[i];
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

std::uint64_t room_of(const BudgetBooks& books, std::size_t member) noexcept {
  const BudgetMemberRecord& row = books.row(member);
  return std::min(books.reserved_for(member), standing_ask(row)) + cap_room(row, books.free_for(member));
}

EngineShare EngineShares::share_locked(std::size_t member) const noexcept {
  const BudgetBooks books(segment_);
  EngineShare share;
  share.found = true;
  share.asking = standing_ask(segment_.members[member]);
  share.open = open_asks(books);
  share.give = share_wanted(books, member);
  share.room = room_of(books, member);
  return share;
}

void EngineShares::reap_if_no_room_locked(std::size_t member) noexcept {
  if (room_of(BudgetBooks(segment_), member) > 0) return;
  const std::int64_t now = monotonic_ns();
  if (now - reaped_at_ns_ < std::chrono::nanoseconds(kReannounce).count()) return;
  reaped_at_ns_ = now;
  reap_locked(segment_);
}

void EngineShares::forget_dead_speakers_locked() noexcept {
  // Only those asking: a dead engine's ask must not cost anyone a page (a /proc read each).
  for (BudgetMemberRecord& row : segment_.members)
    if (row.pid != 0 && standing_ask(row) > 0 && !speaker_of(row).alive()) forget_speaker(row);
}

std::size_t EngineShares::find_label_locked(const std::string& label) const noexcept {
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

EngineShare EngineShares::speak_for(const std::string& label, const EngineReport& report) {
  EngineShare share;
  bool wake = false;
  {
    BudgetLock lock(segment_);
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
    // Settled: every block given before is released. What is still on its way back (held,
    // no longer in use: pages waiting for their readers) stays promised until it comes back;
    // the rest of the promise (a page several blocks shared gives back less) is forgotten.
    if (report.settled) row.pledged = std::min(row.pledged, on_its_way_back(row));
    row.pledged += report.given;
    const std::int64_t now = monotonic_ns();
    if (report.given > 0) {
      row.give_backs.fetch_add(1, std::memory_order_relaxed);
      row.last_answer_ns.store(now, std::memory_order_relaxed);
    }
    share = share_locked(member);
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
    BudgetBooks(segment_).fit_reservation();  // an ask that ended frees what was reserved for it
  }
  if (wake) futex_wake_all(segment_.requests);
  return share;
}

EngineShare EngineShares::share_of(const std::string& label) {
  BudgetLock lock(segment_);
  forget_dead_speakers_locked();
  const std::size_t member = find_label_locked(label);
  if (member == BudgetSegment::kMaxMembers) return EngineShare{};
  reap_if_no_room_locked(member);
  return share_locked(member);
}

}  // namespace vkv::detail
