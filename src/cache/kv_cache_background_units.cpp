// KvCache: the mapper's units of work, planned under the lock (background_planner.h), their slow backend
// calls made without it (the slot's pages at or past busy_from are the mapper's meanwhile).
#include <algorithm>
#include <chrono>
#include <iterator>

#include "kv_cache_impl.h"
#include "util/clock.h"
#include "util/internal_assert.h"

namespace vkv {

bool KvCache::Impl::background_busy() const noexcept {
  return in_flight_pages_ > 0 ||
         std::any_of(slots_.begin(), slots_.end(), [](const Slot& slot) { return slot.busy(); });
}

std::size_t KvCache::Impl::map_ahead_now() {
  rethrow_background_error();
  std::size_t units = 0;
  while (background_work()) ++units;
  return units;
}

bool KvCache::Impl::background_work() {
  std::unique_lock<std::mutex> lock(mutex_);
  // While suspended nothing takes the pages suspend() gave back (kv_cache_suspend.cpp).
  const detail::BackgroundUnit unit =
      suspension_ ? detail::BackgroundUnit{} : planner_.next(/*settle_events=*/true, eager_tokens(), watermark_pages_);
  switch (unit.kind) {
    case detail::BackgroundUnit::Kind::grow:
      return grow_in_background(lock, unit.slot, unit.pages);
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

class KvCache::Impl::UnitExit {
 public:
  UnitExit(Impl& cache, std::unique_lock<std::mutex>& lock, std::size_t slot)
      : cache_(cache), lock_(lock), slot_(slot) {}
  ~UnitExit() {
    if (!lock_.owns_lock()) lock_.lock();
    if (slot_ < cache_.slots_.size()) cache_.slots_[slot_].busy_from = detail::kNotBusy;
    cache_.background_done_.notify_all();
  }
  UnitExit(const UnitExit&) = delete;
  UnitExit& operator=(const UnitExit&) = delete;

 private:
  Impl& cache_;
  std::unique_lock<std::mutex>& lock_;
  std::size_t slot_;  // slots_.size() for a unit that works on no slot
};

bool KvCache::Impl::grow_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t target) {
  if (!stranded_.empty()) unmap_stranded();  // before mapping past the slot's books
  Slot& slot = slots_[slot_index];
  const std::size_t regions = layout_.num_regions();
  const std::size_t first = slot.mapped();
  const std::size_t span = pool_.large_page_pages();
  // A large page per region where a whole span lies ahead, else single pages, and only
  // from memory nobody else has: mapping ahead never takes pages from another slot.
  std::vector<Page> large;  // one per region
  std::size_t large_to_create = 0;
  std::size_t per_region = 0;
  if (span > 0 && first % span == 0 && target - first >= span) {
    large = pool_.take_free_large(regions);
    large_to_create = regions - large.size();
    const std::size_t reserved = pool_.begin_create(large_to_create * span);
    if (reserved == large_to_create * span) {
      per_region = span;
    } else {
      pool_.end_create(reserved, 0);
      for (const Page& page : large) pool_.give_back(page);
      large.clear();
      large_to_create = 0;
    }
  }
  std::vector<Page> pages;  // region after region; a large page once per page it covers
  std::size_t to_create = 0;
  if (per_region == 0) {
    per_region = std::min({target - first, pool_.obtainable_pages() / regions,
                           std::max<std::size_t>(1, detail::BackgroundPlanner::kPagesPerUnit / regions)});
    if (span > 0) {  // leave a whole span ahead to a large page
      const std::size_t boundary = (first / span + 1) * span;
      if (boundary + span <= target) per_region = std::min(per_region, boundary - first);
    }
    if (per_region == 0) return false;
    pool_.make_room_for_singles(per_region * regions);
    pages = pool_.take_free(per_region * regions);
    to_create = pool_.begin_create(per_region * regions - pages.size());
    // obtainable_pages() is a hint under a shared budget: the claim may come back short
    // (another member took the room, a resize lowered it). Map whole regions of what came.
    const std::size_t got = pages.size() + to_create;
    if (got < per_region * regions) {
      per_region = got / regions;
      std::size_t surplus = got - per_region * regions;
      const std::size_t unreserved = std::min(surplus, to_create);
      pool_.end_create(unreserved, 0);
      to_create -= unreserved;
      for (surplus -= unreserved; surplus > 0; --surplus) {
        pool_.give_back(pages.back());
        pages.pop_back();
      }
      if (per_region == 0) return false;
    }
  }
  const std::size_t count = per_region * regions;
  VKV_ASSERT(pages.size() + to_create == count || (per_region == span && large.size() + large_to_create == regions));
  const bool large_unit = !large.empty() || large_to_create > 0;
  in_flight_pages_ += count;
  slot.busy_from = first;
  lock.unlock();
  const UnitExit exit(*this, lock, slot_index);
  const auto started = std::chrono::steady_clock::now();

  // Pages at or past busy_from, and backed_end, belong to this thread until it is cleared.
  std::size_t created = 0;
  std::size_t regions_mapped = 0;
  bool zero_filling = false;
  try {
    for (; created < to_create; ++created) pages.push_back(pool_.new_page());
    for (; created < large_to_create; ++created) large.push_back(pool_.new_large_page());
    for (const Page& page : large) pages.insert(pages.end(), span, page);
    VKV_ASSERT(pages.size() == count);  // never a handle from past the pages claimed
    std::vector<PageHandle> handles(per_region);
    for (; regions_mapped < regions; ++regions_mapped) {
      const Page* run = &pages[regions_mapped * per_region];
      for (std::size_t i = 0; i < per_region; ++i) handles[i] = run[i].handle;
      mappings_.map_real(slot_index, regions_mapped, first, handles.data(), per_region);
    }
    // Published pages must read as zeros to whoever gets them, on any stream.
    if (std::any_of(pages.begin(), pages.end(), [](const Page& page) { return !page.clean; })) {
      zero_filling = true;
      mappings_.zero_fresh_regions(slot_index, first, pages.data(), per_region, background_stream_);
      backend_->synchronize(background_stream_);
    }
  } catch (...) {
    try {
      if (zero_filling) backend_->synchronize(background_stream_);  // never unmap under a queued zero-fill
    } catch (...) {
      // A dead context runs nothing any more.
    }
    // A region whose unmapping fails too keeps its pages mapped: they are stranded, out of
    // the pool until unmapping them succeeds, rather than mapped twice.
    std::vector<Stranded> stranded;
    for (std::size_t r = 0; r < regions_mapped; ++r) {
      std::vector<PageHandle> handles(per_region);
      for (std::size_t i = 0; i < per_region; ++i) handles[i] = pages[r * per_region + i].handle;
      try {
        mappings_.unmap_real(slot_index, r, first, handles.data(), per_region);
      } catch (...) {
        stranded.push_back({slot_index, r, first, std::move(handles)});  // the first error is reported
      }
    }
    auto is_stranded = [&stranded](std::size_t region) {
      return std::any_of(stranded.begin(), stranded.end(), [region](const Stranded& s) { return s.region == region; });
    };
    lock.lock();
    if (large_unit) {
      for (std::size_t i = regions - large_to_create; i < large.size(); ++i) pool_.adopt_large(large[i].handle);
      for (std::size_t r = 0; r < large.size(); ++r)
        if (!is_stranded(r)) pool_.give_back({large[r].handle, false});  // a zero-fill may have begun
      pool_.end_create(large_to_create * span, created * span);
    } else {
      for (std::size_t i = 0; i < pages.size(); ++i)
        if (!is_stranded(i / per_region)) pool_.give_back({pages[i].handle, false});
      pool_.end_create(to_create, created);
    }
    stranded_.insert(stranded_.end(), std::make_move_iterator(stranded.begin()),
                     std::make_move_iterator(stranded.end()));
    in_flight_pages_ -= count;
    throw;
  }
  const auto elapsed = std::chrono::steady_clock::now() - started;
  lock.lock();
  profile_.count_mapped_ahead(count, elapsed);
  for (std::size_t i = regions - large_to_create; i < large.size(); ++i) pool_.adopt_large(large[i].handle);
  for (std::size_t r = 0; r < regions; ++r)
    for (std::size_t i = 0; i < per_region; ++i) slot.pages[r].push_back(pages[r * per_region + i].handle);
  if (config_.zero_page) slot.backed_end = std::max(slot.backed_end, first + per_region);
  in_flight_pages_ -= count;
  return true;
}

bool KvCache::Impl::shrink_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index,
                                         std::size_t pages) {
  Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  const std::size_t keep = mapped - pages;
  slot.busy_from = keep;
  lock.unlock();
  const UnitExit exit(*this, lock, slot_index);
  mappings_.unmap_regions(slot_index, keep, pages);
  lock.lock();
  // Unclaimed (step() waits for a busy slot before claiming past busy_from): clean.
  for (std::vector<PageHandle>& handles : slot.pages) {
    std::vector<Page> unmapped;
    mappings_.drop_mappings(handles, keep, mapped, /*clean=*/true, unmapped);
    for (const Page& page : unmapped) pool_.give_back(page);
    handles.resize(keep);
  }
  return true;
}

bool KvCache::Impl::cover_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t until) {
  Slot& slot = slots_[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  slot.busy_from = from;  // nobody maps there meanwhile; the range is unmapped, so nothing reads it
  lock.unlock();
  const UnitExit exit(*this, lock, slot_index);
  mappings_.back_regions_with_zeros(slot_index, from, until);
  lock.lock();
  slot.backed_end = until;
  return true;
}

bool KvCache::Impl::create_in_background(std::unique_lock<std::mutex>& lock, std::size_t pages) {
  const std::size_t reserved = pool_.begin_create(pages);
  if (reserved == 0) return false;
  in_flight_pages_ += reserved;
  lock.unlock();
  const UnitExit exit(*this, lock, slots_.size());
  std::vector<Page> created;
  auto publish = [&] {  // whatever was created goes to the pool, also when the device ran out
    lock.lock();
    for (const Page& page : created) pool_.give_back(page);
    pool_.end_create(reserved, created.size());
    in_flight_pages_ -= reserved;
  };
  try {
    while (created.size() < reserved) created.push_back(pool_.new_page());
  } catch (...) {
    publish();
    throw;
  }
  publish();
  return true;
}

}  // namespace vkv
