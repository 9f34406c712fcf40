// SlotMappings: the backend calls that change which pages back a slot's addresses, each
// all or nothing, and the books an unmapping leaves.
#include "slot_mappings.h"

#include <algorithm>

namespace vkv::detail {

void SlotMappings::map_real(std::size_t slot_index, std::size_t region, std::size_t first, const PageHandle* handles,
                            std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address at = address(region, slot_index, first);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed > 0) backend_.unmap(at, zero_backed * page);
  try {
    map_handles(at, handles, count);
  } catch (...) {
    try {
      if (zero_backed > 0) backend_.back_with_zeros(at, zero_backed * page, config_.scratch_page);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void SlotMappings::map_handles(Address at, const PageHandle* handles, std::size_t count) {
  const std::size_t page = layout_.page_bytes();
  auto identity = [](PageHandle handle) { return handle; };
  std::size_t mapped = 0;
  try {
    while (mapped < count) {
      std::size_t end = run_end(handles, mapped, count, identity);
      if (end - mapped > 1) {
        backend_.map_large(at + mapped * page, handles[mapped], end - mapped);
      } else {  // single pages up to the next large page: one call
        while (end < count && run_end(handles, end, count, identity) == end + 1) ++end;
        backend_.map(at + mapped * page, handles + mapped, end - mapped);
      }
      mapped = end;
    }
  } catch (...) {
    try {
      if (mapped > 0) backend_.unmap(at, mapped * page);  // just mapped: nothing reads them yet
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void SlotMappings::unmap_real(std::size_t slot_index, std::size_t region, std::size_t first, const PageHandle* handles,
                              std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address at = address(region, slot_index, first);
  backend_.unmap(at, count * page);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed == 0) return;
  try {
    backend_.back_with_zeros(at, zero_backed * page, config_.scratch_page);
  } catch (...) {
    try {
      map_handles(at, handles, count);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void SlotMappings::unmap_regions(std::size_t slot_index, std::size_t keep, std::size_t count) {
  const Slot& slot = slots_[slot_index];
  std::size_t region = 0;
  try {
    for (; region < slot.pages.size(); ++region)
      unmap_real(slot_index, region, keep, slot.pages[region].data() + keep, count);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {  // every region keeps the same pages
      try {
        map_real(slot_index, r, keep, slot.pages[r].data() + keep, count);
      } catch (...) {
        // Already failing; the first error is the one that propagates.
      }
    }
    throw;
  }
}

void SlotMappings::back_with_zeros(std::size_t slot_index, std::size_t until) {
  const Slot& slot = slots_[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  if (until <= from) return;
  back_regions_with_zeros(slot_index, from, until);
  slots_.set_backed_end(slot_index, until);
}

void SlotMappings::back_regions_with_zeros(std::size_t slot_index, std::size_t from, std::size_t until) {
  const std::size_t bytes = (until - from) * layout_.page_bytes();
  std::size_t region = 0;
  try {
    for (; region < layout_.num_regions(); ++region)
      backend_.back_with_zeros(address(region, slot_index, from), bytes, config_.scratch_page);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {
      try {
        backend_.unmap(address(r, slot_index, from), bytes);
      } catch (...) {
        // Already failing; report the first error.
      }
    }
    throw;
  }
}

void SlotMappings::zero_fresh_pages(Address at, const Page* pages, std::size_t count, Stream stream) {
  const std::size_t page = layout_.page_bytes();
  std::size_t i = 0;
  while (i < count) {
    if (pages[i].clean) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < count && !pages[end].clean) ++end;
    backend_.zero(at + i * page, (end - i) * page, stream);
    i = end;
  }
}

void SlotMappings::zero_fresh_regions(std::size_t slot, std::size_t first, const Page* pages, std::size_t count,
                                      Stream stream) {
  const std::size_t regions = layout_.num_regions();
  const std::size_t page = layout_.page_bytes();
  const std::size_t unclean = static_cast<std::size_t>(
      std::count_if(pages, pages + regions * count, [](const Page& fresh) { return !fresh.clean; }));
  if (unclean == regions * count) {
    backend_.zero_strided(address(0, slot, first), count * page, regions, layout_.region_bytes(), stream);
    return;
  }
  if (unclean == 0) return;
  for (std::size_t r = 0; r < regions; ++r) zero_fresh_pages(address(r, slot, first), &pages[r * count], count, stream);
}

void SlotMappings::drop_mappings(const std::vector<PageHandle>& pages, std::size_t from, std::size_t to, bool clean,
                                 std::vector<Page>& into) {
  for (std::size_t i = from; i < to; i = run_end(
                                         pages.data(), i, to, [](PageHandle page) { return page; }))
    if (sharing_.drop_mapping(pages[i])) into.push_back({pages[i], clean});
}

void SlotMappings::give_back_pages(const Page* pages, std::size_t count) {
  for (std::size_t i = 0; i < count; i = run_end(
                                         pages, i, count, [](const Page& page) { return page.handle; }))
    pool_.give_back(pages[i]);
}

std::size_t SlotMappings::round_down_to_whole(const Slot& slot, std::size_t page) const noexcept {
  const std::size_t large = pool_.large_page_pages();
  if (large == 0 || page >= slot.mapped() || page % large == 0) return page;
  const std::size_t start = page - page % large;
  const std::vector<PageHandle>& pages = slot.pages.front();  // the same large pages in every region
  return pages[start] == pages[start + 1] ? start : page;
}

std::size_t SlotMappings::round_up_to_whole(const Slot& slot, std::size_t page) const noexcept {
  const std::size_t start = round_down_to_whole(slot, page);
  return start == page ? page : start + pool_.large_page_pages();
}

}  // namespace vkv::detail
