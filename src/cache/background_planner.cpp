// BackgroundPlanner: what the background mapper does next, most urgent first.
#include "background_planner.h"

#include <algorithm>
#include <vector>

#include "reclaim_policy.h"

namespace vkv::detail {

BackgroundUnit BackgroundPlanner::next(bool settle_events, std::size_t eager, std::size_t watermark_pages) {
  const std::size_t max_pages = layout_.pages_per_slot();
  const std::size_t regions = layout_.num_regions();
  const bool can_grow = pool_.obtainable_pages() >= regions;  // ahead mapping uses free memory only
  // A freed slot's pages may still be read by its last owner's work: only after its event.
  auto readers_done = [&](std::size_t s) {
    const Slot& slot = slots_[s];
    if (slot.deferred_fill != 0) return false;  // the next step() enqueues it and wakes the mapper
    if (slot.free_event == 0) return true;
    if (!settle_events) return true;
    if (!backend_.event_done(slot.free_event)) return false;  // later: the next step() wakes the mapper
    backend_.destroy_event(slot.free_event);
    slots_.clear_free_event(s);
    return true;
  };
  // With a scratch page the caller may write anywhere at any time (vLLM zero-fills its whole
  // buffer): a page mapped ahead or reclaimed here would be swapped under its writes (a fault
  // between the unmap and the map, or its bytes in a page a slot later claims as zeros). So
  // the mapper maps nothing ahead and reclaims nothing then; it only creates pages (4.).
  const bool may_remap = !config_.scratch_page;
  // Checked mode maps nothing ahead: every page a slot's addresses reach is one step()
  // backed for its owner, so that an access beyond faults (access_checks.h).
  const bool maps_ahead = may_remap && !config_.checked;
  // 1. Lookahead: each allocated slot's next iterations, where no work in flight reads
  //    (with zero backing, below the read horizon only step() may swap pages).
  for (std::size_t s = 0; s < slots_.size() && can_grow && maps_ahead; ++s) {
    const Slot& slot = slots_[s];
    if (!slot.allocated || slot.busy() || slot.seq_len == 0) continue;
    const std::size_t target =
        std::min(max_pages,
                 layout_.pages_for_tokens(std::min(config_.max_context_len, slot.seq_len + config_.lookahead_tokens)));
    if (target > slot.mapped() && slot.mapped() >= readers_.first_reclaimable_without_waiting(s))
      return {BackgroundUnit::Kind::grow, s, target};
  }
  // 1b. Expected lengths (expect_tokens()): a long prompt's pages while its earlier chunks
  //     compute, after every slot's next iterations. Not while the previous owner's
  //     zero-fill is still deferred or (zero_page) its readers may be in flight.
  for (std::size_t s = 0; s < slots_.size() && can_grow && maps_ahead; ++s) {
    const Slot& slot = slots_[s];
    if (!slot.allocated || slot.swapped || slot.busy() || slot.expected_tokens == 0) continue;
    const std::size_t target = std::min(max_pages, layout_.pages_for_tokens(slot.expected_tokens));
    if (target > slot.mapped() && slot.deferred_fill == 0 && (!config_.zero_page || readers_done(s)) &&
        slot.mapped() >= readers_.first_reclaimable_without_waiting(s))
      return {BackgroundUnit::Kind::grow, s, target};
  }
  // 2. Eager allocation: the next prefill's pages in the slot alloc_reqid() hands out next.
  const std::size_t next = slots_.next_to_allocate();
  if (maps_ahead && can_grow && eager > 0 && next < slots_.size() && !slots_[next].busy()) {
    const std::size_t target = std::min(max_pages, layout_.pages_for_tokens(eager));
    if (target > slots_[next].mapped() && (!config_.zero_page || readers_done(next)))
      return {BackgroundUnit::Kind::grow, next, target};
  }
  // 3. Below the watermark, unmap the least recently freed slot's pages into the pool, so
  //    that step() does not have to; only once that slot's last readers are done.
  const std::size_t obtainable = pool_.obtainable_pages();
  if (may_remap && obtainable < watermark_pages) {
    // Not the slot handed out next: its pages are the next prefill's.
    const std::size_t victim =
        choose_victim(slots_, std::vector<std::size_t>(slots_.size(), 0), VictimKinds::freed_only, next);
    if (victim < slots_.size() && readers_done(victim)) {
      const std::size_t mapped = slots_[victim].mapped();
      const std::size_t pages = std::min(mapped, (watermark_pages - obtainable + regions - 1) / regions);
      return {BackgroundUnit::Kind::shrink, victim,
              mapped - mappings_.round_down_to_whole(slots_[victim], mapped - pages)};
    }
  }
  // 4. With zero backing, pages in reach of work in flight are swapped by step() itself:
  //    keep free pages created for it, so that it does not wait for cuMemCreate.
  if (config_.zero_page) {
    std::size_t in_reach = 0;  // allocated slots whose next page the mapper may not map ahead
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].allocated && slots_[s].mapped() < readers_.first_reclaimable_without_waiting(s))
        in_reach += regions;
    const std::size_t wanted = std::min(in_reach, kPagesPerUnit);
    if (pool_.free_pages() < wanted && pool_.obtainable_pages() > pool_.free_pages())
      return {BackgroundUnit::Kind::create, 0, wanted - pool_.free_pages()};
  }
  // 5. Zero backing of slots not yet handed out (where it costs per page), the next one first.
  if (config_.zero_page && may_remap) {
    for (std::size_t k = 0; k <= slots_.size(); ++k) {
      const std::size_t s = k == 0 ? next : k - 1;
      if (s >= slots_.size() || slots_[s].allocated || slots_[s].busy()) continue;
      const std::size_t from = std::max(slots_[s].mapped(), slots_[s].backed_end);
      if (from < max_pages)
        return {BackgroundUnit::Kind::cover, s,
                std::min(max_pages, from + std::max<std::size_t>(1, kPagesPerCoverUnit / regions))};
    }
  }
  return {};
}

}  // namespace vkv::detail
