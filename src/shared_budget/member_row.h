// What one member's row says on its own: the bytes it could give, asks for, may still take
// under its cap and keeps under its floor, whether it owes an answer, and who it is. The
// books (budget_books.h) add these up over the rows; every rule that looks at one member
// alone is written here once.
//
// Internal. Thread- and process-safety: pure functions of the row; the atomics are read
// relaxed, so a caller without the segment's mutex gets a hint. clear_row() and
// forget_speaker() write the row: with the mutex held.
#pragma once

#include <cstdint>

#include "budget_segment.h"
#include "interprocess/shared_memory.h"

namespace vkv::detail {

/// Request numbers wrap: `a` is at or after `b` when their difference, signed, is not negative.
bool at_or_after(std::uint32_t a, std::uint32_t b) noexcept;

/// The member's process.
ProcessIdentity identity_of(const BudgetMemberRecord& row) noexcept;
/// The process of the engine that answers for the member (pid 0: none).
ProcessIdentity speaker_of(const BudgetMemberRecord& row) noexcept;

/// Request `request` still waits for the member: it has not answered it yet, or owes a pledge.
bool owes_answer(const BudgetMemberRecord& row, std::uint32_t request) noexcept;

/// What its floor keeps that it does not hold: floor - held, or 0.
std::uint64_t floor_gap(const BudgetMemberRecord& row) noexcept;
/// Of `bytes`, what its cap leaves room for (all of them without a cap), were it to hold
/// `more_held` more.
std::uint64_t cap_room(const BudgetMemberRecord& row, std::uint64_t bytes, std::uint64_t more_held = 0) noexcept;
/// What it holds above its cap (a cap lowered at run time); 0 without a cap.
std::uint64_t over_cap(const BudgetMemberRecord& row) noexcept;

/// What an ask can get from the member: what it holds, its requests do not claim (as of its
/// last published call) and its floor does not keep; for a member an engine answers for,
/// what its speaker said it could give, above the floor.
std::uint64_t giveable(const BudgetMemberRecord& row) noexcept;
/// giveable() less what it promised already.
std::uint64_t can_give(const BudgetMemberRecord& row) noexcept;
/// What it holds that its last published call says is not in use: on its way back (pages
/// waiting for the device work that reads them) or free in its pool.
std::uint64_t on_its_way_back(const BudgetMemberRecord& row) noexcept;

/// A spoken-for member's standing ask: what its speaker's goal lacks beyond what it holds,
/// within its cap (a member short only of its own cap asks nobody).
std::uint64_t standing_ask(const BudgetMemberRecord& row) noexcept;
/// What the member asks for: its ask in flight or its standing ask, the larger.
std::uint64_t asking(const BudgetMemberRecord& row) noexcept;

/// No engine answers for the member any more: its standing ask, spare and promises go.
void forget_speaker(BudgetMemberRecord& row) noexcept;
/// A free row again (pid 0), every field zero: a dead member's floor goes with it.
void clear_row(BudgetMemberRecord& row) noexcept;

}  // namespace vkv::detail
