// The books as people read them (SharedBudget::stats(), python -m vkv.budget show and
// top): the totals and one entry per live member. The rows are checked as they are read,
// since anything that can write the object could have written garbage into them.
//
// Internal. Thread- and process-safety: read_view() locks the segment's mutex (BudgetLock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "budget_segment.h"

namespace vkv::detail {

/// What stats() reports of one member.
struct BudgetMemberView {
  std::int32_t pid = 0;
  std::string command;
  std::size_t page_bytes = 0;
  std::size_t held_bytes = 0;
  std::size_t in_use_bytes = 0;
  std::size_t wanted_bytes = 0;
  std::size_t row = 0;
  std::string label;
  MemberLimits limits;
  std::uint64_t asks = 0;
  std::uint64_t give_backs = 0;
  std::uint64_t given_bytes = 0;
  std::int64_t since_answer_ns = -1;  ///< -1: never answered
  std::int32_t speaker_pid = 0;       ///< the scheduler that answers for it; 0 = none
};

/// What stats() reports of the whole budget.
struct BudgetView {
  std::size_t capacity_bytes = 0;
  std::size_t used_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t device_total_bytes = 0;
  std::string device;
  std::vector<BudgetMemberView> members;
};

/// The books now, the dead counted out first.
/// @throws Error when a row is corrupted (naming the row and the field).
BudgetView read_view(BudgetSegment& segment);

}  // namespace vkv::detail
