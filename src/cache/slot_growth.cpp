// SlotGrowth: fresh pages mapped at the end of slots, for step() and for the mapper.
#include "slot_growth.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <set>
#include <utility>

#include "background_planner.h"
#include "util/clock.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv::detail {

void SlotGrowth::map_missing(const std::vector<std::size_t>& claims, const std::vector<PageRef>& copies,
                             std::size_t missing, Stream stream, UndoLog& undo, const char* call) {
  if (!stranded_.empty()) unmap_stranded();  // before mapping past slots' books; pages for the pool
  source_.expect_obtainable(missing, claims, call);
  for (std::size_t s = 0; s < slots_.size(); ++s)
    if (claims[s] > slots_[s].mapped()) readers_.order_after_readers(s, slots_[s].mapped());
  const std::size_t regions = layout_.num_regions();
  // Every page in the order it is used: the copies' single pages first, then slot by
  // slot, region by region (lay_out()).
  std::vector<Page> pages;
  std::size_t next = 0;  // pages[next...] are not mapped yet
  UndoLog unused;
  unused.push([&] { mappings_.give_back_pages(pages.data() + next, pages.size() - next); });
  {
    const std::vector<std::vector<Page>> large = take_large_pages(claims);
    std::size_t large_total = 0;
    for (const std::vector<Page>& taken : large) large_total += taken.size() * pool_.large_page_pages();
    std::vector<Page> singles;
    try {
      singles = source_.obtain(missing - large_total, claims);
      const std::size_t copied = copies.size() * regions;
      std::vector<Page> laid(singles.begin(), singles.begin() + static_cast<std::ptrdiff_t>(copied));
      const Page* next_single = singles.data() + copied;
      for (std::size_t s = 0; s < slots_.size(); ++s)
        if (claims[s] > slots_[s].mapped()) lay_out(slots_[s].mapped(), claims[s], large[s], next_single, laid);
      VKV_ASSERT(next_single == singles.data() + singles.size());
      pages = std::move(laid);
    } catch (...) {
      for (const std::vector<Page>& taken : large)
        for (const Page& page : taken) pool_.give_back(page);
      for (const Page& page : singles) pool_.give_back(page);
      throw;
    }
  }
  // From here on the call holds every page it maps: a watcher waiting for the lock may
  // have freed slots' pages at once (serve_give_back()), between slots' driver calls.
  budget_.serve_give_back(claims);
  if (!copies.empty()) copy_on_write(copies, pages, next, stream, undo);

  struct Fresh {
    std::size_t slot, first_page;
    std::size_t first;  // index into pages: region r's run starts at first + r * count
    std::size_t count;
  };
  std::vector<Fresh> fresh;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    const std::size_t mapped = slot.mapped();
    if (claims[s] <= mapped) continue;
    const std::size_t count = claims[s] - mapped;
    fresh.push_back({s, mapped, next, count});
    map_fresh(s, mapped, pages, next, count, undo, /*stranded=*/nullptr);
    if (config_.zero_page) {
      const std::size_t backed_end = slot.backed_end;
      slots_.set_backed_end(s, std::max(backed_end, claims[s]));
      undo.push([this, s, backed_end] { slots_.set_backed_end(s, backed_end); });
    }
    budget_.serve_give_back(claims);
  }
  VKV_ASSERT(next == pages.size());                 // every page obtained found its place
  if (!fresh.empty()) undo.enqueued_device_work();  // from the first zero-fill on, undo waits for them
  for (const Fresh& run : fresh)
    mappings_.zero_fresh_regions(run.slot, run.first_page, &pages[run.first], run.count, stream);
  unused.commit();
}

bool SlotGrowth::grow_ahead(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t target,
                            Stream stream) {
  if (!stranded_.empty()) unmap_stranded();  // before mapping past the slot's books
  const Slot& slot = slots_[slot_index];
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
  std::vector<Page> singles;  // region after region
  std::size_t to_create = 0;
  if (per_region == 0) {
    per_region = std::min({target - first, pool_.obtainable_pages() / regions,
                           std::max<std::size_t>(1, BackgroundPlanner::kPagesPerUnit / regions)});
    if (span > 0) {  // leave a whole span ahead to a large page
      const std::size_t boundary = (first / span + 1) * span;
      if (boundary + span <= target) per_region = std::min(per_region, boundary - first);
    }
    if (per_region == 0) return false;
    pool_.make_room_for_singles(per_region * regions);
    singles = pool_.take_free(per_region * regions);
    to_create = pool_.begin_create(per_region * regions - singles.size());
    // obtainable_pages() is a hint under a shared budget: the claim may come back short
    // (another member took the room, a resize lowered it). Map whole regions of what came.
    const std::size_t got = singles.size() + to_create;
    if (got < per_region * regions) {
      per_region = got / regions;
      std::size_t surplus = got - per_region * regions;
      const std::size_t unreserved = std::min(surplus, to_create);
      pool_.end_create(unreserved, 0);
      to_create -= unreserved;
      for (surplus -= unreserved; surplus > 0; --surplus) {
        pool_.give_back(singles.back());
        singles.pop_back();
      }
      if (per_region == 0) return false;
    }
  }
  const std::size_t count = per_region * regions;
  VKV_ASSERT(singles.size() + to_create == count || (per_region == span && large.size() + large_to_create == regions));
  const bool large_unit = !large.empty() || large_to_create > 0;
  in_flight_pages_ += count;
  slots_.mark_busy(slot_index, first);
  lock.unlock();
  const UnitExit exit(slots_, unit_done_, lock, slot_index);
  const Clock::time_point started = Clock::now();

  // Pages at or past busy_from, and backed_end, belong to this thread until it is cleared.
  std::size_t created = 0;
  std::vector<Page> pages;  // region after region; a large page once per page it covers
  std::vector<Stranded> stranded;
  try {
    UndoLog undo([this, stream] { backend_.synchronize(stream); });  // never unmap under a queued zero-fill
    for (; created < to_create; ++created) singles.push_back(pool_.new_page());
    for (; created < large_to_create; ++created) large.push_back(pool_.new_large_page());
    const Page* next_single = singles.data();
    lay_out(first, first + per_region, large, next_single, pages);
    VKV_ASSERT(pages.size() == count);  // never a handle from past the pages claimed
    std::size_t next = 0;
    map_fresh(slot_index, first, pages, next, per_region, undo, &stranded);
    // Published pages must read as zeros to whoever gets them, on any stream.
    if (std::any_of(pages.begin(), pages.end(), [](const Page& page) { return !page.clean; })) {
      undo.enqueued_device_work();
      mappings_.zero_fresh_regions(slot_index, first, pages.data(), per_region, stream);
      backend_.synchronize(stream);
    }
    undo.commit();
  } catch (...) {
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
      for (std::size_t i = 0; i < singles.size(); ++i)
        if (!is_stranded(i / per_region)) pool_.give_back({singles[i].handle, false});
      pool_.end_create(to_create, created);
    }
    stranded_.insert(stranded_.end(), std::make_move_iterator(stranded.begin()),
                     std::make_move_iterator(stranded.end()));
    in_flight_pages_ -= count;
    throw;
  }
  const Clock::duration elapsed = Clock::now() - started;
  lock.lock();
  profile_.count_mapped_ahead(count, elapsed);
  for (std::size_t i = regions - large_to_create; i < large.size(); ++i) pool_.adopt_large(large[i].handle);
  std::vector<PageHandle> handles(per_region);
  for (std::size_t r = 0; r < regions; ++r) {
    for (std::size_t i = 0; i < per_region; ++i) handles[i] = pages[r * per_region + i].handle;
    slots_.append_pages(slot_index, r, handles.data(), per_region);
  }
  if (config_.zero_page) slots_.set_backed_end(slot_index, std::max(slot.backed_end, first + per_region));
  in_flight_pages_ -= count;
  return true;
}
void SlotGrowth::lay_out(std::size_t first, std::size_t until, const std::vector<Page>& large, const Page*& singles,
                         std::vector<Page>& into) const {
  const std::size_t span = pool_.large_page_pages();
  const std::size_t regions = layout_.num_regions();
  const std::size_t spans = large.size() / regions;
  const std::size_t first_span = span == 0 ? first : (first + span - 1) / span * span;
  for (std::size_t r = 0; r < regions; ++r) {
    for (std::size_t page = first; page < until;) {
      if (page >= first_span && page < first_span + spans * span) {
        into.insert(into.end(), span, large[(page - first_span) / span * regions + r]);
        page += span;
      } else {
        into.push_back(*singles++);
        page += 1;
      }
    }
  }
}

void SlotGrowth::map_fresh(std::size_t s, std::size_t first, const std::vector<Page>& pages, std::size_t& next,
                           std::size_t count, UndoLog& undo, std::vector<Stranded>* stranded) {
  std::vector<PageHandle> handles(count);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
    for (std::size_t i = 0; i < count; ++i) handles[i] = pages[next + i].handle;
    mappings_.map_real(s, r, first, handles.data(), count);
    next += count;
    if (stranded != nullptr) {
      // A region whose unmapping fails too keeps its pages mapped: they are stranded, out
      // of the pool until unmapping them succeeds, rather than mapped twice.
      undo.push_remap([this, s, r, first, handles, stranded] {
        try {
          mappings_.unmap_real(s, r, first, handles.data(), handles.size());
        } catch (...) {
          stranded->push_back({s, r, first, handles});  // the first error is the one reported
        }
      });
      continue;
    }
    slots_.append_pages(s, r, handles.data(), handles.size());
    undo.push_remap([this, s, r, first] {
      const std::vector<PageHandle>& list = slots_[s].pages[r];
      mappings_.unmap_real(s, r, first, list.data() + first, list.size() - first);
      std::vector<Page> unmapped;
      mappings_.drop_mappings(list, first, list.size(), /*clean=*/false, unmapped);
      for (const Page& page : unmapped) pool_.give_back(page);
      slots_.truncate_pages(s, r, first);
    });
  }
}

std::vector<std::vector<Page>> SlotGrowth::take_large_pages(const std::vector<std::size_t>& claims) {
  std::vector<std::vector<Page>> large(slots_.size());
  const std::size_t span = pool_.large_page_pages();
  if (span == 0) return large;
  const std::size_t regions = layout_.num_regions();
  try {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      for (std::size_t first = (slots_[s].mapped() + span - 1) / span * span; first + span <= claims[s];
           first += span) {
        const std::size_t taken = large[s].size();
        while (large[s].size() < taken + regions) {
          std::optional<Page> page = pool_.take_large();
          if (!page) {
            for (std::size_t i = taken; i < large[s].size(); ++i) pool_.give_back(large[s][i]);
            large[s].resize(taken);
            return large;
          }
          large[s].push_back(*page);
        }
      }
    }
  } catch (...) {
    for (const std::vector<Page>& pages : large)
      for (const Page& page : pages) pool_.give_back(page);
    throw;
  }
  return large;
}

// Gives each slot in `copies` a private copy of the shared page it names, from
// pages[next...]; a shared large page is copied whole, into single pages, its pages
// following each other in `copies`. The copy comes from another slot mapping the same
// page that keeps it (an allocated one, whose claimed pages nothing unmaps under the
// lock): never from one copied later in this loop, which unmaps it under the queued copy.
void SlotGrowth::copy_on_write(const std::vector<PageRef>& copies, const std::vector<Page>& pages, std::size_t& next,
                               Stream stream, UndoLog& undo) {
  // The writer's earlier kernels may still read the shared page through its address.
  const Event readers = backend_.record_event(stream);
  try {
    backend_.wait_event(readers);
  } catch (...) {
    backend_.destroy_event(readers);
    throw;
  }
  backend_.destroy_event(readers);

  const std::size_t page_bytes = layout_.page_bytes();
  auto identity = [](PageHandle page) { return page; };
  std::set<std::pair<std::size_t, std::size_t>> copied;  // (slot, page)
  for (const PageRef& ref : copies) copied.emplace(ref.slot, ref.page);
  for (std::size_t c = 0; c < copies.size();) {
    const PageRef ref = copies[c];
    const std::vector<PageHandle>& writer = slots_[ref.slot].pages.front();
    const std::size_t count = run_end(writer.data(), ref.page, writer.size(), identity) - ref.page;
    for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
      const PageHandle shared = slots_[ref.slot].pages[r][ref.page];
      std::size_t holder = 0;
      while (holder < slots_.size() &&
             (slots_[holder].mapped() <= ref.page || slots_[holder].pages[r][ref.page] != shared ||
              copied.count({holder, ref.page}) != 0))
        ++holder;
      if (holder == slots_.size()) throw Error("internal: a shared page has no other slot mapping it");
      std::vector<PageHandle> fresh(count);
      for (std::size_t i = 0; i < count; ++i) fresh[i] = pages[next + i].handle;
      const std::vector<PageHandle> shared_run(count, shared);
      const Address address = mappings_.address(r, ref.slot, ref.page);
      backend_.unmap(address, count * page_bytes);
      try {
        backend_.map(address, fresh.data(), count);
      } catch (...) {
        mappings_.map_handles(address, shared_run.data(), count);
        throw;
      }
      next += count;
      slots_.replace_pages(ref.slot, r, ref.page, fresh.data(), fresh.size());
      sharing_.drop_mapping(shared);
      undo.push_remap([this, ref, r, address, shared_run, fresh, page_bytes] {
        backend_.unmap(address, shared_run.size() * page_bytes);
        mappings_.map_handles(address, shared_run.data(), shared_run.size());
        slots_.replace_pages(ref.slot, r, ref.page, shared_run.data(), shared_run.size());
        sharing_.add_mapping(shared_run.front(), shared_run.size());
        for (PageHandle page : fresh) pool_.give_back({page, false});
      });
      undo.enqueued_device_work();
      backend_.copy(address, mappings_.address(r, holder, ref.page), count * page_bytes, stream);
    }
    c += count;
  }
}

void SlotGrowth::unmap_stranded() noexcept {
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
    for (std::size_t i = 0; i < count; i = run_end(range.handles.data(), i, count, identity))
      pool_.give_back({range.handles[i], false});  // a large page once
    return true;
  };
  stranded_.erase(std::remove_if(stranded_.begin(), stranded_.end(), unmap_and_give_back), stranded_.end());
}

std::size_t SlotGrowth::stranded_pages() const noexcept {
  std::size_t pages = 0;
  for (const Stranded& range : stranded_) pages += range.handles.size();
  return pages;
}

}  // namespace vkv::detail
