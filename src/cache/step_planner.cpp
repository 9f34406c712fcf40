// StepPlanner: what step(seq_lens) must map and copy, and the checks of its seq_lens.
#include "step_planner.h"

#include <algorithm>
#include <unordered_map>

#include "vkv/error.h"

namespace vkv::detail {

void StepPlanner::expect_valid(const std::size_t* seq_lens, std::size_t count) const {
  VKV_EXPECTS(count == slots_.size(), "seq_lens has ", count, " entries: it must have max_batch_size = ", slots_.size(),
              " (0 for slots not in use)");
  VKV_EXPECTS(seq_lens != nullptr || count == 0, "seq_lens is null");
  for (std::size_t s = 0; s < count; ++s) {
    VKV_EXPECTS(seq_lens[s] <= config_.max_context_len, "seq_lens[", s, "] = ", seq_lens[s],
                " exceeds max_context_len = ", config_.max_context_len);
    VKV_EXPECTS(seq_lens[s] == 0 || slots_[s].allocated, "seq_lens[", s, "] = ", seq_lens[s], " but slot ", s,
                " is not allocated (alloc_reqid() first)");
    VKV_EXPECTS(seq_lens[s] == 0 || !slots_[s].swapped, "seq_lens[", s, "] = ", seq_lens[s], " but slot ", s,
                " is swapped out (swap_in() first, or give it 0)");
  }
}

StepPlan StepPlanner::plan(const std::size_t* seq_lens, std::size_t count, std::size_t horizon) const {
  StepPlan plan;
  plan.claims.assign(count, 0);
  const std::size_t regions = layout_.num_regions();
  std::unordered_map<PageHandle, std::size_t> copies_of;  // the last slot mapping a page keeps it
  for (std::size_t s = 0; s < count; ++s) {
    const Slot& slot = slots_[s];
    plan.claims[s] = std::max(slot.claimed, layout_.pages_for_tokens(seq_lens[s]));
    if (plan.claims[s] > slot.mapped()) plan.to_map += (plan.claims[s] - slot.mapped()) * regions;
    if (!sharing_.empty() && seq_lens[s] > slot.seq_len) {
      // Tokens [seq_len, new seq_len) are about to be written: a shared page there is copied.
      // A shared large page is copied whole.
      const std::vector<PageHandle>& pages = slot.pages.front();
      const std::size_t end = std::min(slot.mapped(), layout_.pages_for_tokens(seq_lens[s]));
      std::size_t page =
          mappings_.round_down_to_whole(slot, slot.seq_len * layout_.token_bytes() / layout_.page_bytes());
      while (page < end) {
        const std::size_t run = run_end(pages.data(), page, pages.size(), [](PageHandle handle) { return handle; });
        const PageHandle handle = pages[page];
        if (sharing_.is_shared(handle) && copies_of[handle]++ != sharing_.mappings(handle) - 1)
          for (std::size_t i = page; i < run; ++i) plan.copies.push_back({s, i});
        page = run;
      }
    }
    // The mapper is mapping (or unmapping) pages this slot needs, or pages the new horizon
    // puts in reach of the next iteration's reads: they are nearly done.
    if (slot.busy() && (plan.claims[s] > slot.busy_from || (slot.allocated && slot.busy_from < horizon)))
      plan.waits_for_mapper = true;
  }
  plan.missing = plan.to_map + plan.copies.size() * regions;
  return plan;
}

}  // namespace vkv::detail
