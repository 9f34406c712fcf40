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
  for (std::size_t s = 0; s < floors.size(); ++s) whole_floors[s] = round_up_to_whole(slots_[s], floors[s]);
  const std::size_t victim = detail::choose_victim(slots_, whole_floors, kinds, /*exclude=*/slots_.size());
  if (victim == slots_.size()) return false;
  // No zero-fill: the pages leave (unmap_tail()). A fill still deferred shrinks to what stays.
  const std::size_t regions = layout_.num_regions();
  const std::size_t mapped = slots_[victim].mapped();
  const std::size_t per_region = std::min(mapped - whole_floors[victim], (wanted + regions - 1) / regions);
  const std::size_t keep = round_down_to_whole(slots_[victim], mapped - per_region);
  order_after_readers(victim, keep);
  unmap_tail(victim, keep, into);
  return true;
}

void KvCache::Impl::unmap_tail(std::size_t slot_index, std::size_t keep, std::vector<Page>& into) {
  Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  if (mapped <= keep) return;
  VKV_ASSERT(round_down_to_whole(slot, keep) == keep);  // large pages go whole
  wait_last_readers(slot_index);                        // the driver's unmap does not wait for kernels still reading
  std::size_t region = 0;
  try {
    for (; region < slot.pages.size(); ++region)
      unmap_real(slot_index, region, keep, slot.pages[region].data() + keep, mapped - keep);
  } catch (...) {
    remap_unmapped_regions(slot_index, region, keep, mapped - keep);  // every region keeps the same pages
    throw;
  }
  VKV_ASSERT(!slot.busy());  // a busy slot's pages are the mapper's until it is done
  // Unclaimed pages were zero-filled (by an earlier fill, or by the mapper), and waited for
  // above: clean; but for those a fill still deferred covers, which they leave without (a
  // large page is clean or not as a whole). A shared page stays with its other slots.
  const std::size_t dirty_end =
      keep < slot.claimed ? mapped : std::min(mapped, round_up_to_whole(slot, std::max(keep, slot.deferred_fill)));
  for (std::vector<PageHandle>& pages : slot.pages) {
    drop_mappings(pages, keep, dirty_end, /*clean=*/false, into);
    drop_mappings(pages, dirty_end, mapped, /*clean=*/true, into);
    pages.resize(keep);
  }
  if (slot.deferred_fill > keep) {  // what stays is still filled before anyone reads it
    slot.deferred_fill = keep;
    if (keep == 0) {
      slot.fill_readers_done = false;
      --deferred_fills_;
    }
  }
}

void KvCache::Impl::drop_mappings(const std::vector<PageHandle>& pages, std::size_t from, std::size_t to, bool clean,
                                  std::vector<Page>& into) {
  for (std::size_t i = from; i < to; i = detail::run_end(
                                         pages.data(), i, to, [](PageHandle page) { return page; }))
    if (sharing_.drop_mapping(pages[i])) into.push_back({pages[i], clean});
}

void KvCache::Impl::give_back_pages(const Page* pages, std::size_t count) {
  for (std::size_t i = 0; i < count; i = detail::run_end(
                                         pages, i, count, [](const Page& page) { return page.handle; }))
    pool_.give_back(pages[i]);
}

std::size_t KvCache::Impl::round_down_to_whole(const Slot& slot, std::size_t page) const noexcept {
  const std::size_t large = pool_.large_page_pages();
  if (large == 0 || page >= slot.mapped() || page % large == 0) return page;
  const std::size_t start = page - page % large;
  const std::vector<PageHandle>& pages = slot.pages.front();  // the same large pages in every region
  return pages[start] == pages[start + 1] ? start : page;
}

std::size_t KvCache::Impl::round_up_to_whole(const Slot& slot, std::size_t page) const noexcept {
  const std::size_t start = round_down_to_whole(slot, page);
  return start == page ? page : start + pool_.large_page_pages();
}

void KvCache::Impl::remap_unmapped_regions(std::size_t slot_index, std::size_t regions, std::size_t keep,
                                           std::size_t count) noexcept {
  for (std::size_t r = 0; r < regions; ++r) {
    try {
      map_real(slot_index, r, keep, slots_[slot_index].pages[r].data() + keep, count);
    } catch (...) {
      // Already failing; the first error is the one that propagates.
    }
  }
}

void KvCache::Impl::map_real(std::size_t slot_index, std::size_t region, std::size_t first, const PageHandle* handles,
                             std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address address = page_address(region, slot_index, first);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed > 0) backend_->unmap(address, zero_backed * page);
  try {
    map_handles(address, handles, count);
  } catch (...) {
    try {
      if (zero_backed > 0) backend_->back_with_zeros(address, zero_backed * page, config_.scratch_page);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void KvCache::Impl::map_handles(Address address, const PageHandle* handles, std::size_t count) {
  const std::size_t page = layout_.page_bytes();
  auto identity = [](PageHandle handle) { return handle; };
  std::size_t mapped = 0;
  try {
    while (mapped < count) {
      std::size_t end = detail::run_end(handles, mapped, count, identity);
      if (end - mapped > 1) {
        backend_->map_large(address + mapped * page, handles[mapped], end - mapped);
      } else {  // single pages up to the next large page: one call
        while (end < count && detail::run_end(handles, end, count, identity) == end + 1) ++end;
        backend_->map(address + mapped * page, handles + mapped, end - mapped);
      }
      mapped = end;
    }
  } catch (...) {
    try {
      if (mapped > 0) backend_->unmap(address, mapped * page);  // just mapped: nothing reads them yet
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void KvCache::Impl::unmap_real(std::size_t slot_index, std::size_t region, std::size_t first, const PageHandle* handles,
                               std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address address = page_address(region, slot_index, first);
  backend_->unmap(address, count * page);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed == 0) return;
  try {
    backend_->back_with_zeros(address, zero_backed * page, config_.scratch_page);
  } catch (...) {
    try {
      map_handles(address, handles, count);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void KvCache::Impl::unmap_stranded() noexcept {
  auto unmap_and_give_back = [this](const Stranded& range) {
    // The mapper's range, or one whose readers no event follows yet: try again later.
    if (slots_[range.slot].busy() || slots_[range.slot].deferred_fill != 0) return false;
    try {
      order_after_readers(range.slot, range.first);  // padded reads of zero-backed addresses read them
      unmap_real(range.slot, range.region, range.first, range.handles.data(), range.handles.size());
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

void KvCache::Impl::back_with_zeros(std::size_t slot_index, std::size_t until) {
  Slot& slot = slots_[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  if (until <= from) return;
  back_regions_with_zeros(slot_index, from, until);
  slot.backed_end = until;
}

void KvCache::Impl::back_regions_with_zeros(std::size_t slot_index, std::size_t from, std::size_t until) {
  const std::size_t bytes = (until - from) * layout_.page_bytes();
  std::size_t region = 0;
  try {
    for (; region < layout_.num_regions(); ++region)
      backend_->back_with_zeros(page_address(region, slot_index, from), bytes, config_.scratch_page);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {
      try {
        backend_->unmap(page_address(r, slot_index, from), bytes);
      } catch (...) {
        // Already failing; report the first error.
      }
    }
    throw;
  }
}

void KvCache::Impl::order_after_readers(std::size_t slot_index, std::size_t first) {
  if (!config_.zero_page) return;  // without zero backing nothing reads beyond a slot's tokens
  Slot& slot = slots_[slot_index];
  if (first >= std::max(slot.mapped(), slot.backed_end)) return;  // unmapped from there on: unreadable
  wait_last_readers(slot_index);                                  // the previous owner's padded reads
  if (slot.allocated && first < read_windows_.horizon(slot.allocated_at, /*include_current=*/false)) {
    const auto start = std::chrono::steady_clock::now();
    read_windows_.wait();
    event_wait_ns_ += detail::nanoseconds_since(start);
  }
}

std::vector<std::size_t> KvCache::Impl::reclaimable_floors() const {
  std::vector<std::size_t> floors(slots_.size());
  for (std::size_t s = 0; s < slots_.size(); ++s) floors[s] = first_reclaimable_without_waiting(s);
  return floors;
}

std::size_t KvCache::Impl::first_reclaimable_without_waiting(std::size_t slot_index) const {
  const Slot& slot = slots_[slot_index];
  if (!config_.zero_page || !slot.allocated) return slot.claimed;
  return std::max(slot.claimed, read_windows_.horizon(slot.allocated_at, /*include_current=*/true));
}

void KvCache::Impl::zero_fresh_pages(Address address, const Page* pages, std::size_t count, Stream stream) {
  const std::size_t page = layout_.page_bytes();
  std::size_t i = 0;
  while (i < count) {
    if (pages[i].clean) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < count && !pages[end].clean) ++end;
    backend_->zero(address + i * page, (end - i) * page, stream);
    i = end;
  }
}

void KvCache::Impl::zero_fresh_regions(std::size_t slot, std::size_t first, const Page* pages, std::size_t count,
                                       Stream stream) {
  const std::size_t regions = layout_.num_regions();
  const std::size_t page = layout_.page_bytes();
  const std::size_t unclean = static_cast<std::size_t>(
      std::count_if(pages, pages + regions * count, [](const Page& fresh) { return !fresh.clean; }));
  if (unclean == regions * count) {
    backend_->zero_strided(page_address(0, slot, first), count * page, regions, layout_.region_bytes(), stream);
    return;
  }
  if (unclean == 0) return;
  for (std::size_t r = 0; r < regions; ++r)
    zero_fresh_pages(page_address(r, slot, first), &pages[r * count], count, stream);
}

void KvCache::Impl::order_after_free_event(const Slot& slot, Stream stream) {
  if (slot.free_event != 0 && slot.free_event_stream != stream) backend_->stream_wait_event(stream, slot.free_event);
}

void KvCache::Impl::wait_free_event(Slot& slot) {
  VKV_ASSERT(slot.deferred_fill == 0 || slot.fill_readers_done);  // else no event follows the last owner's work yet
  if (slot.free_event == 0) return;
  const auto start = std::chrono::steady_clock::now();
  backend_->wait_event(slot.free_event);
  event_wait_ns_ += detail::nanoseconds_since(start);
  backend_->destroy_event(slot.free_event);
  slot.free_event = 0;
}

}  // namespace vkv
