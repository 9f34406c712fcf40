// LentPages: what a cache could give its shared budget back, and how it releases it.
#include "lent_pages.h"

#include <algorithm>

#include "util/clock.h"

namespace vkv::detail {

std::size_t LentPages::cached_pages(const std::vector<std::size_t>& floors, bool freed_only) const {
  std::size_t pages = pool_.free_pages();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if (slot.busy() || (freed_only && slot.allocated)) continue;
    const std::size_t floor = mappings_.round_up_to_whole(slot, floors[s]);
    if (slot.mapped() > floor) pages += (slot.mapped() - floor) * layout_.num_regions();
  }
  return pages;
}

bool LentPages::wait_for_readers(std::unique_lock<std::mutex>& lock, const std::function<bool()>& relock) {
  const std::vector<std::size_t> floors = readers_.reclaimable_floors();
  std::vector<std::size_t> above;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if (!slot.busy() && slot.mapped() > mappings_.round_up_to_whole(slot, floors[s])) above.push_back(s);
  }
  // No fill is enqueued: the pages leave.
  const SlotReaders::Fence behind = readers_.fence(above, /*pending_events=*/true);
  if (!behind.events.empty()) {
    lock.unlock();
    readers_.wait_then_destroy(behind.events);  // a throw leaves the lock released
    if (!relock()) return false;
  }
  readers_.mark_done(behind);
  return true;
}

std::size_t LentPages::claimed_pages() const {
  std::size_t claimed = 0;
  for (const Slot& slot : slots_) claimed += std::min(slot.claimed, slot.mapped());
  return claimed * layout_.num_regions() - sharing_.duplicate_mappings();
}

std::size_t LentPages::release(std::size_t wanted, const std::vector<std::size_t>& floors, Victims victims,
                               bool may_wait, BudgetClient::ReleaseTimes& times_so_far) {
  const VictimKinds kinds = victims == Victims::freed_only ? VictimKinds::freed_only : VictimKinds::freed_then_surplus;
  const auto since = nanoseconds_since;
  // In chunks, each counted back to the budget as soon as it is released: an asker waiting
  // for a few pages goes on after the first chunk, not after the whole answer (on a GPU,
  // ~30 us a page of unmapping and releasing). Each chunk twice the one before: the books
  // are updated (their lock, the askers' wake-up) a few times an answer, not once a page,
  // and an asker of n pages waits for at most about 2n of them.
  std::size_t released = 0;
  std::size_t chunk = BudgetClient::kReleaseChunkPages;
  auto next_chunk = [&] { return std::min(chunk, wanted - released); };
  auto release = [&](const std::vector<Page>& pages) {
    PagePool::ReleaseTimes times;
    released += pool_.release_all(pages, &times);
    times_so_far.release_ns += times.release_ns;
    times_so_far.count_ns += times.count_ns;
    chunk *= 2;
  };
  const std::size_t large = std::max<std::size_t>(pool_.large_page_pages(), 1);
  while (released < wanted) {  // free pages first: nothing to unmap
    std::vector<Page> pages = pool_.take_free(next_chunk());
    if (pages.empty()) pages = pool_.take_free_large(std::max<std::size_t>(next_chunk() / large, 1));
    if (pages.empty()) break;
    release(pages);
  }
  // First the slots whose last readers are done (no wait for device work the asker does not
  // need: the owner's queue may hold a whole iteration), then, if `may_wait`, the others.
  std::vector<std::size_t> ready = floors;
  std::vector<std::size_t> waiting;  // slots the second pass may take that are not ready
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if ((slot.deferred_fill != 0 && !slot.fill_readers_done) ||
        (slot.free_event != 0 && !backend_.event_done(slot.free_event))) {
      ready[s] = std::max(ready[s], slot.mapped());
      if (!slot.busy() && slot.mapped() > mappings_.round_up_to_whole(slot, floors[s])) waiting.push_back(s);
    }
  }
  auto release_above = [&](const std::vector<std::size_t>& pass) {
    while (released < wanted) {
      // Victims' tails until the chunk is full (one unmap per region over each run), then
      // released and counted back together.
      std::vector<Page> pages;
      std::size_t taken = 0;
      const auto start = Clock::now();
      bool found = true;
      try {
        while (found && taken < next_chunk()) {
          const std::size_t before = pages.size();
          found = source_.reclaim_coldest(pages, next_chunk() - taken, pass, kinds);
          for (std::size_t i = before; i < pages.size(); ++i) taken += pool_.is_large(pages[i].handle) ? large : 1;
        }
      } catch (...) {
        times_so_far.unmap_ns += since(start);
        if (!pages.empty()) release(pages);  // unmapped already: they go
        throw;
      }
      times_so_far.unmap_ns += since(start);
      if (!pages.empty()) release(pages);
      if (!found) return;
    }
  };
  release_above(ready);
  if (!may_wait || released >= wanted) return released;
  if (!waiting.empty()) {  // one event per stream for them all, not one per victim
    readers_.wait_for(waiting, /*timed=*/true);
  }
  release_above(floors);
  return released;
}

}  // namespace vkv::detail
