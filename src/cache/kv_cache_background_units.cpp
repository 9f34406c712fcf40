// KvCache: the mapper's units of work, planned under the lock (background_planner.h), their slow backend
// calls made without it (the slot's pages at or past busy_from are the mapper's meanwhile).
#include <algorithm>
#include <chrono>
#include <iterator>

#include "kv_cache_impl.h"
#include "util/clock.h"
#include "util/internal_assert.h"

namespace vkv {

std::size_t KvCache::Impl::map_ahead_now() {
  rethrow_background_error();
  std::size_t units = 0;
  auto any_busy = [&] {
    return std::any_of(cache_.slots.begin(), cache_.slots.end(), [](const Slot& slot) { return slot.busy(); });
  };
  for (;;) {
    while (background_work()) ++units;
    // The plan skips a slot the mapper thread is in a unit of: wait for that unit, then plan
    // again (the slot may want more), so that on return nothing is left, in flight or not.
    std::unique_lock<std::mutex> lock(cache_.mutex);
    if (!any_busy()) return units;
    cache_.unit_done.wait(lock, [&] { return !any_busy(); });
  }
}

bool KvCache::Impl::background_work() {
  std::unique_lock<std::mutex> lock(cache_.mutex);
  // While suspended nothing takes the pages suspend() gave back (suspension.h).
  const detail::BackgroundUnit unit =
      suspension_.suspended() ? detail::BackgroundUnit{}
                              : planner_.next(/*settle_events=*/true,
                                              detail::eager_tokens(cache_.config, cache_.prompts), watermark_pages_);
  switch (unit.kind) {
    case detail::BackgroundUnit::Kind::grow:
      return growth_.grow_ahead(lock, unit.slot, unit.pages, background_stream_);
    case detail::BackgroundUnit::Kind::shrink:
      return shrink_in_background(lock, unit.slot, unit.pages);
    case detail::BackgroundUnit::Kind::cover:
      return cover_in_background(lock, unit.slot, unit.pages);
    case detail::BackgroundUnit::Kind::create:
      return create_in_background(lock, unit.pages);
    case detail::BackgroundUnit::Kind::none:
      break;
  }
  return false;
}

bool KvCache::Impl::shrink_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index,
                                         std::size_t pages) {
  const Slot& slot = cache_.slots[slot_index];
  const std::size_t mapped = slot.mapped();
  const std::size_t keep = mapped - pages;
  cache_.slots.mark_busy(slot_index, keep);
  lock.unlock();
  const detail::UnitExit exit(cache_.slots, cache_.unit_done, lock, slot_index);
  mappings_.unmap_regions(slot_index, keep, pages);
  lock.lock();
  // Unclaimed (step() waits for a busy slot before claiming past busy_from): clean.
  for (std::size_t r = 0; r < slot.pages.size(); ++r) {
    std::vector<Page> unmapped;
    mappings_.drop_mappings(slot.pages[r], keep, mapped, /*clean=*/true, unmapped);
    for (const Page& page : unmapped) cache_.pool.give_back(page);
    cache_.slots.truncate_pages(slot_index, r, keep);
  }
  return true;
}

bool KvCache::Impl::cover_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t until) {
  const Slot& slot = cache_.slots[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  cache_.slots.mark_busy(slot_index, from);  // nobody maps there meanwhile; the range is unmapped, so nothing reads it
  lock.unlock();
  const detail::UnitExit exit(cache_.slots, cache_.unit_done, lock, slot_index);
  mappings_.back_regions_with_zeros(slot_index, from, until);
  lock.lock();
  cache_.slots.set_backed_end(slot_index, until);
  return true;
}

bool KvCache::Impl::create_in_background(std::unique_lock<std::mutex>& lock, std::size_t pages) {
  const std::size_t reserved = cache_.pool.begin_create(pages);
  if (reserved == 0) return false;
  cache_.in_flight_pages += reserved;
  lock.unlock();
  const detail::UnitExit exit(cache_.slots, cache_.unit_done, lock, cache_.slots.size());
  std::vector<Page> created;
  auto publish = [&] {  // whatever was created goes to the pool, also when the device ran out
    lock.lock();
    for (const Page& page : created) cache_.pool.give_back(page);
    cache_.pool.end_create(reserved, created.size());
    cache_.in_flight_pages -= reserved;
  };
  try {
    while (created.size() < reserved) created.push_back(cache_.pool.new_page());
  } catch (...) {
    publish();
    throw;
  }
  publish();
  return true;
}

}  // namespace vkv
