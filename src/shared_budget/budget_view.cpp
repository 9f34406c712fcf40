// Reading the books for people, checking each row as it is read.
#include "budget_view.h"

#include <algorithm>

#include "budget_lock.h"
#include "member_registry.h"
#include "member_row.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv::detail {

BudgetView read_view(BudgetSegment& segment) {
  BudgetLock lock(segment);
  reap_locked(segment);
  const std::int64_t now = monotonic_ns();
  BudgetView view;
  view.capacity_bytes = segment.capacity.load(std::memory_order_relaxed);
  view.used_bytes = segment.used.load(std::memory_order_relaxed);
  view.reserved_bytes = segment.reserved;
  view.device_total_bytes = segment.device_total;
  VKV_EXPECTS(read_text(segment.device, sizeof(segment.device), view.device),
              "a shared budget's device name is corrupted (not NUL-terminated text): remove the budget and create it "
              "again");
  for (std::size_t i = 0; i < BudgetSegment::kMaxMembers; ++i) {
    const BudgetMemberRecord& row = segment.members[i];
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

}  // namespace vkv::detail
