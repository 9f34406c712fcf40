// KvCache: growing and shrinking the physical memory the cache holds while it runs,
// so that the framework's allocator or another process can use what it gives back.
#include <algorithm>

#include "kv_cache_impl.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {

std::size_t KvCache::Impl::pages_set_budget_keeps() const {
  std::size_t pages = 0;  // claimed, or (zero_page) in reach of work in flight: neither can go now
  for (std::size_t s = 0; s < slots_.size(); ++s)
    pages += std::min(slots_[s].mapped(),
                      mappings_.round_up_to_whole(slots_[s], readers_.first_reclaimable_without_waiting(s))) *
             layout_.num_regions();
  return pages - sharing_.duplicate_mappings();  // shared pages lie below their slots' claims
}

void KvCache::Impl::set_budget(std::size_t bytes) {
  rethrow_background_error();
  const std::size_t page = layout_.page_bytes();
  VKV_EXPECTS(bytes >= page, "set_budget: bytes = ", bytes, " is less than one page (", page, " bytes)");
  const std::size_t budget = bytes / page;
  std::unique_lock<std::mutex> lock(mutex_);
  expect_not_suspended("set_budget");
  background_done_.wait(lock, [&] { return !background_busy(); });  // pages in flight count too
  const std::size_t in_use = pages_set_budget_keeps();
  if (in_use > budget) {
    throw OutOfMemory(
        detail::concat(
            "set_budget(", bytes, ") allows ", budget, " pages (", detail::format_bytes(budget * page),
            ") but allocated slots claim ", in_use, " (", detail::format_bytes(in_use * page),
            "); free, preempt or swap out requests first, or retry after the next step() if pages mapped ahead are "
            "still in reach of work in flight"),
        in_use - budget, page);
  }
  const std::size_t old_budget = pool_.budget_pages();
  const std::size_t old_watermark = watermark_pages_;
  pool_.set_budget(budget);
  if (config_.reclaim_watermark_pages == 0) watermark_pages_ = budget / 32;
  try {
    shrink_to_budget();
  } catch (...) {
    pool_.set_budget(old_budget);  // what was released stays released, within the old budget
    watermark_pages_ = old_watermark;
    throw;
  }
  if (mapper_) mapper_->wake();  // growing makes room for mapping ahead
}

std::size_t KvCache::Impl::trim() {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  background_done_.wait(lock, [&] { return !background_busy(); });
  free_finished_host_copies(/*wait=*/false);
  // The pages leave: no zero-fill, only their last readers done, one event per stream.
  std::vector<std::size_t> keep(slots_.size());
  std::vector<std::size_t> above;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    keep[s] =
        mappings_.round_up_to_whole(slots_[s], readers_.first_reclaimable_without_waiting(s));  // large pages go whole
    if (slots_[s].mapped() > keep[s]) above.push_back(s);
  }
  readers_.wait_for(above);
  for (const std::size_t s : above) {
    std::vector<Page> pages;
    source_.unmap_tail(s, keep[s], pages);
    for (const Page& page : pages) pool_.give_back(page);
  }
  return pool_.trim(0) * layout_.page_bytes();
}

// Releases pages until no more exist than the budget allows: free ones first, then
// unclaimed mappings, coldest first. The caller made sure the claimed ones fit.
void KvCache::Impl::shrink_to_budget() {
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
    if (!source_.reclaim_coldest(pages, excess, claims))
      throw Error("internal: set_budget found no unclaimed mapped page");
    for (const Page& page : pages) pool_.give_back(page);
  }
}

}  // namespace vkv
