// KvCache: changing a slot's mappings (real pages in, zero backing back), and taking
// pages back from slots (reclamation: which slot is choose_victim()'s, this is how).
#include <algorithm>
#include <chrono>

#include "kv_cache_impl.h"
#include "reclaim_policy.h"
#include "undo_log.h"
#include "util/clock.h"
#include "util/format.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv {

// Pages from the pool, then reclaimed from slots above their floors (claims, for an engine
// call that waits for in-flight readers after ReadWindows::close_current(); or
// reclaimable_floors() for a call that cannot). Exactly `count` pages, or OutOfMemory with
// every page given back: what the pool grants may fall short of what obtainable_pages()
// said (a shared budget's room is a hint), so a shortage is found here too.
std::vector<Page> KvCache::Impl::obtain_pages(std::size_t count, const std::vector<std::size_t>& floors) {
  std::vector<Page> pages = pool_.take_up_to(count);
  try {
    while (pages.size() < count) {
      std::vector<Page> reclaimed;
      if (!reclaim_coldest(reclaimed, count - pages.size(), floors)) {
        throw OutOfMemory(detail::concat(count, " pages needed, ", pages.size(),
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

bool KvCache::Impl::reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& floors,
                                    detail::VictimKinds kinds) {
  // Large pages go whole: a slot keeps the one its floor falls in.
  std::vector<std::size_t> whole_floors(floors.size());
  for (std::size_t s = 0; s < floors.size(); ++s) whole_floors[s] = mappings_.round_up_to_whole(slots_[s], floors[s]);
  const std::size_t victim = detail::choose_victim(slots_, whole_floors, kinds, /*exclude=*/slots_.size());
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

void KvCache::Impl::unmap_tail(std::size_t slot_index, std::size_t keep, std::vector<Page>& into) {
  Slot& slot = slots_[slot_index];
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
  for (std::vector<PageHandle>& pages : slot.pages) {
    mappings_.drop_mappings(pages, keep, dirty_end, /*clean=*/false, into);
    mappings_.drop_mappings(pages, dirty_end, mapped, /*clean=*/true, into);
    pages.resize(keep);
  }
  readers_.shrink_fill(slot_index, keep);
}

void KvCache::Impl::unmap_stranded() noexcept {
  auto unmap_and_give_back = [this](const Stranded& range) {
    // The mapper's range, or one whose readers no event follows yet: try again later.
    if (slots_[range.slot].busy() || slots_[range.slot].deferred_fill != 0) return false;
    try {
      readers_.order_after_readers(range.slot, range.first);  // padded reads of zero-backed addresses read them
      mappings_.unmap_real(range.slot, range.region, range.first, range.handles.data(), range.handles.size());
    } catch (...) {
      return false;  // still failing: try again later
    }
    const std::size_t count = range.handles.size();
    auto identity = [](PageHandle page) { return page; };
    for (std::size_t i = 0; i < count; i = detail::run_end(range.handles.data(), i, count, identity))
      pool_.give_back({range.handles[i], false});  // a large page once
    return true;
  };
  stranded_.erase(std::remove_if(stranded_.begin(), stranded_.end(), unmap_and_give_back), stranded_.end());
}

}  // namespace vkv
