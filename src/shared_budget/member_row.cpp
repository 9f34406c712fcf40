// One member's row on its own.
#include "member_row.h"

#include <algorithm>
#include <cstring>

namespace vkv::detail {

bool at_or_after(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(a - b) >= 0; }

ProcessIdentity identity_of(const BudgetMemberRecord& row) noexcept { return {row.pid, row.start_time}; }

ProcessIdentity speaker_of(const BudgetMemberRecord& row) noexcept {
  return {row.speaker_pid.load(std::memory_order_relaxed), row.speaker_start_time};
}

bool owes_answer(const BudgetMemberRecord& row, std::uint32_t request) noexcept {
  return row.pledged > 0 || !at_or_after(row.answered, request);
}

std::uint64_t floor_gap(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t floor = row.floor.load(std::memory_order_relaxed);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  return floor > held ? floor - held : 0;
}

std::uint64_t cap_room(const BudgetMemberRecord& row, std::uint64_t bytes, std::uint64_t more_held) noexcept {
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed) + more_held;
  if (cap == 0) return bytes;
  return std::min(bytes, cap > held ? cap - held : 0);
}

std::uint64_t over_cap(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  return cap != 0 && held > cap ? held - cap : 0;
}

std::uint64_t giveable(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  const std::uint64_t floor = row.floor.load(std::memory_order_relaxed);
  if (row.speaker_pid.load(std::memory_order_relaxed) != 0)
    return std::min<std::uint64_t>(row.spare.load(std::memory_order_relaxed), held > floor ? held - floor : 0);
  const std::uint64_t in_use = row.in_use.load(std::memory_order_relaxed);
  return held > std::max(in_use, floor) ? held - std::max(in_use, floor) : 0;
}

std::uint64_t can_give(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t can = giveable(row);
  return can > row.pledged ? can - row.pledged : 0;
}

std::uint64_t on_its_way_back(const BudgetMemberRecord& row) noexcept {
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  const std::uint64_t in_use = row.in_use.load(std::memory_order_relaxed);
  return held > in_use ? held - in_use : 0;
}

std::uint64_t standing_ask(const BudgetMemberRecord& row) noexcept {
  if (row.speaker_pid.load(std::memory_order_relaxed) == 0) return 0;
  std::uint64_t goal = row.goal.load(std::memory_order_relaxed);
  const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
  if (cap != 0) goal = std::min(goal, cap);
  const std::uint64_t held = row.held.load(std::memory_order_relaxed);
  return goal > held ? goal - held : 0;
}

std::uint64_t asking(const BudgetMemberRecord& row) noexcept {
  return std::max<std::uint64_t>(row.wanted, standing_ask(row));
}

void forget_speaker(BudgetMemberRecord& row) noexcept {
  row.speaker_pid.store(0, std::memory_order_relaxed);
  row.speaker_start_time = 0;
  row.spare.store(0, std::memory_order_relaxed);
  row.goal.store(0, std::memory_order_relaxed);
  row.announced = 0;
  row.announced_ns = 0;
}

void clear_row(BudgetMemberRecord& row) noexcept {
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

}  // namespace vkv::detail
