// KvCache: growing and shrinking the physical memory the cache holds while it runs,
// so that the framework's allocator or another process can use what it gives back; and
// giving all of it back while the engine sleeps (suspend(), resume(): suspension.h).
#include <algorithm>

#include "kv_cache_impl.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {

void KvCache::Impl::set_budget(std::size_t bytes) {
  rethrow_background_error();
  const std::size_t page = cache_.layout.page_bytes();
  VKV_EXPECTS(bytes >= page, "set_budget: bytes = ", bytes, " is less than one page (", page, " bytes)");
  const std::size_t budget = bytes / page;
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("set_budget");
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });  // pages in flight count too
  const std::size_t in_use = source_.pages_held_now();
  if (in_use > budget) {
    throw OutOfMemory(
        detail::concat(
            "set_budget(", bytes, ") allows ", budget, " pages (", detail::format_bytes(budget * page),
            ") but allocated slots claim ", in_use, " (", detail::format_bytes(in_use * page),
            "); free, preempt or swap out requests first, or retry after the next step() if pages mapped ahead are "
            "still in reach of work in flight"),
        in_use - budget, page);
  }
  const std::size_t old_budget = cache_.pool.budget_pages();
  const std::size_t old_watermark = watermark_pages_;
  cache_.pool.set_budget(budget);
  if (cache_.config.reclaim_watermark_pages == 0) watermark_pages_ = budget / 32;
  try {
    source_.shrink_to_budget();
  } catch (...) {
    cache_.pool.set_budget(old_budget);  // what was released stays released, within the old budget
    watermark_pages_ = old_watermark;
    throw;
  }
  if (mapper_) mapper_->wake();  // growing makes room for mapping ahead
}

std::size_t KvCache::Impl::trim() {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });
  cache_.host_frees.free_finished(/*wait=*/false);
  // The pages leave: no zero-fill, only their last readers done, one event per stream.
  std::vector<std::size_t> keep(cache_.slots.size());
  std::vector<std::size_t> above;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    keep[s] = mappings_.round_up_to_whole(cache_.slots[s],
                                          readers_.first_reclaimable_without_waiting(s));  // large pages go whole
    if (cache_.slots[s].mapped() > keep[s]) above.push_back(s);
  }
  readers_.wait_for(above);
  for (const std::size_t s : above) {
    std::vector<Page> pages;
    source_.unmap_tail(s, keep[s], pages);
    for (const Page& page : pages) cache_.pool.give_back(page);
  }
  return cache_.pool.trim(0) * cache_.layout.page_bytes();
}

void KvCache::Impl::suspend(Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.suspend(lock, stream);
}

void KvCache::Impl::resume(Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.resume(lock, stream);
  if (mapper_) mapper_->wake();
}

bool KvCache::Impl::is_suspended() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  return suspension_.suspended();
}

}  // namespace vkv
