// PageSource: pages for a call, from the pool and then from slots (reclamation: which
// slot is choose_victim()'s, this is how).
#include "page_source.h"

#include <algorithm>

#include "util/format.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv::detail {

std::vector<Page> PageSource::obtain(std::size_t count, const std::vector<std::size_t>& floors) {
  std::vector<Page> pages = pool_.take_up_to(count);
  try {
    while (pages.size() < count) {
      std::vector<Page> reclaimed;
      if (!reclaim_coldest(reclaimed, count - pages.size(), floors)) {
        throw OutOfMemory(concat(count, " pages needed, ", pages.size(),
                                 " obtained and no unclaimed mapped page left: the shared budget's room went"
                                 " to another member or a resize meanwhile"),
                          count - pages.size(), layout_.page_bytes());
      }
      // Single pages serve as they are; a large page serves as room for single ones.
      for (std::size_t i = 0; i < reclaimed.size(); ++i) {
        if (pool_.is_large(reclaimed[i].handle)) {
          pool_.give_back(reclaimed[i]);
        } else {
          pages.push_back(reclaimed[i]);
        }
      }
      if (pages.size() < count) {
        std::vector<Page> more = pool_.take_up_to(count - pages.size());
        pages.insert(pages.end(), more.begin(), more.end());
      }
    }
  } catch (...) {
    for (const Page& page : pages) pool_.give_back(page);
    throw;
  }
  // Reclamation takes whole pages from every region; what this call does not need is free now.
  while (pages.size() > count) {
    pool_.give_back(pages.back());
    pages.pop_back();
  }
  VKV_ASSERT(pages.size() == count);
  return pages;
}

bool PageSource::reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& floors,
                                 VictimKinds kinds) {
  // Large pages go whole: a slot keeps the one its floor falls in.
  std::vector<std::size_t> whole_floors(floors.size());
  for (std::size_t s = 0; s < floors.size(); ++s) whole_floors[s] = mappings_.round_up_to_whole(slots_[s], floors[s]);
  const std::size_t victim = choose_victim(slots_, whole_floors, kinds, /*exclude=*/slots_.size());
  if (victim == slots_.size()) return false;
  // No zero-fill: the pages leave (unmap_tail()). A fill still deferred shrinks to what stays.
  const std::size_t regions = layout_.num_regions();
  const std::size_t mapped = slots_[victim].mapped();
  const std::size_t per_region = std::min(mapped - whole_floors[victim], (wanted + regions - 1) / regions);
  const std::size_t keep = mappings_.round_down_to_whole(slots_[victim], mapped - per_region);
  readers_.order_after_readers(victim, keep);
  unmap_tail(victim, keep, into);
  return true;
}

void PageSource::unmap_tail(std::size_t slot_index, std::size_t keep, std::vector<Page>& into) {
  const Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  if (mapped <= keep) return;
  VKV_ASSERT(mappings_.round_down_to_whole(slot, keep) == keep);  // large pages go whole
  readers_.wait_last_readers(slot_index);  // the driver's unmap does not wait for kernels still reading
  mappings_.unmap_regions(slot_index, keep, mapped - keep);
  VKV_ASSERT(!slot.busy());  // a busy slot's pages are the mapper's until it is done
  // Unclaimed pages were zero-filled (by an earlier fill, or by the mapper), and waited for
  // above: clean; but for those a fill still deferred covers, which they leave without (a
  // large page is clean or not as a whole). A shared page stays with its other slots.
  const std::size_t dirty_end =
      keep < slot.claimed ? mapped
                          : std::min(mapped, mappings_.round_up_to_whole(slot, std::max(keep, slot.deferred_fill)));
  for (std::size_t r = 0; r < slot.pages.size(); ++r) {
    mappings_.drop_mappings(slot.pages[r], keep, dirty_end, /*clean=*/false, into);
    mappings_.drop_mappings(slot.pages[r], dirty_end, mapped, /*clean=*/true, into);
    slots_.truncate_pages(slot_index, r, keep);
  }
  readers_.shrink_fill(slot_index, keep);
}

std::size_t PageSource::obtainable_pages(const std::vector<std::size_t>& claims) const {
  std::size_t unclaimed = 0;  // mapped pages no slot claims and the mapper is not working on
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const std::size_t mapped = slots_[s].mapped();
    const std::size_t floor = mappings_.round_up_to_whole(slots_[s], claims[s]);  // large pages go whole
    if (!slots_[s].busy() && mapped > floor) unclaimed += mapped - floor;
  }
  return pool_.obtainable_pages() + unclaimed * layout_.num_regions();
}

void PageSource::expect_obtainable(std::size_t missing, const std::vector<std::size_t>& claims,
                                   const char* call) const {
  const std::size_t obtainable = obtainable_pages(claims);
  if (missing <= obtainable) return;
  std::size_t claimed_mapped = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) claimed_mapped += std::min(slots_[s].mapped(), claims[s]);
  const std::size_t regions = layout_.num_regions();
  const std::size_t page = layout_.page_bytes();
  throw OutOfMemory(concat(call, " needs ", missing, " more pages (", format_bytes(missing * page), ") but only ",
                           obtainable, " can be had: budget ", pool_.budget_pages(), " pages of ", format_bytes(page),
                           ", ", claimed_mapped * regions - sharing_.duplicate_mappings(), " held by allocated slots",
                           budget_.room_text(), "; free, preempt or swap out requests, or raise the budget"),
                    missing - obtainable, page);
}

std::size_t PageSource::pages_short(std::size_t missing, std::size_t slot, std::size_t claim) const {
  std::vector<std::size_t> claims = slots_.claims();
  claims[slot] = std::max(claims[slot], claim);
  const std::size_t obtainable = obtainable_pages(claims);
  return missing > obtainable ? missing - obtainable : 0;
}

std::size_t PageSource::pages_held_now() const {
  std::size_t pages = 0;  // claimed, or (zero_page) in reach of work in flight: neither can go now
  for (std::size_t s = 0; s < slots_.size(); ++s)
    pages += std::min(slots_[s].mapped(),
                      mappings_.round_up_to_whole(slots_[s], readers_.first_reclaimable_without_waiting(s))) *
             layout_.num_regions();
  return pages - sharing_.duplicate_mappings();  // shared pages lie below their slots' claims
}

void PageSource::shrink_to_budget() {
  const std::vector<std::size_t> claims = readers_.reclaimable_floors();
  if (pool_.created_pages() > pool_.budget_pages() + pool_.free_pages()) {
    // Mapped pages go too: their last readers first, one event per stream for all slots.
    std::vector<std::size_t> above;
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].mapped() > mappings_.round_up_to_whole(slots_[s], claims[s])) above.push_back(s);
    readers_.wait_for(above);
  }
  while (pool_.created_pages() > pool_.budget_pages()) {
    const std::size_t excess = pool_.created_pages() - pool_.budget_pages();
    if (pool_.free_pages() > 0) {
      pool_.trim(pool_.free_pages() - std::min(pool_.free_pages(), excess));
      continue;
    }
    std::vector<Page> pages;
    if (!reclaim_coldest(pages, excess, claims)) throw Error("internal: set_budget found no unclaimed mapped page");
    for (const Page& page : pages) pool_.give_back(page);
  }
}

}  // namespace vkv::detail
