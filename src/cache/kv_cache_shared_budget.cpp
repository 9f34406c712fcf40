// KvCache in a shared budget (vkv/shared_budget.h): asking the other members for pages
// when the cache runs short, and giving pages back when they ask. The books and the
// watcher thread are BudgetMembership's; what to give and how is decided here.
#include <algorithm>
#include <chrono>

#include "kv_cache_impl.h"
#include "util/clock.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv {

void KvCache::Impl::ask_shared_budget(std::unique_lock<std::mutex>& lock, std::size_t pages, std::size_t headroom) {
  const auto start = std::chrono::steady_clock::now();
  lock.unlock();
  try {
    membership_->ask(pages + headroom, pages);
  } catch (...) {
    lock.lock();
    throw;
  }
  const auto relock = std::chrono::steady_clock::now();
  lock.lock();
  budget_handoff_.ask_relock_ns += detail::nanoseconds_since(relock);
  membership_->claim_reserved();
  budget_asks_.calls += 1;
  budget_asks_.nanoseconds += detail::nanoseconds_since(start);
  try {
    budget_asks_.units += pool_.add_free(membership_->claimed_pages());
  } catch (const OutOfMemory&) {
    // The device itself is short (memory outside the budget): the call will say so.
  }
  membership_->release_claimed();  // what the pool could not take goes back
}

std::size_t KvCache::Impl::budget_ask_headroom(std::size_t missing) const {
  // In a burst every admission's step() is short by about one prompt: asking for the next
  // prompt's pages too (eager allocation's estimate) halves the asks. At most `missing`
  // more, and only where the others cache plenty (twice what this would ask): when they
  // are busy too, taking more than needed would make them ask it back (and preempt).
  const std::size_t next_prompt = layout_.pages_for_tokens(eager_tokens()) * layout_.num_regions();
  const std::size_t headroom = std::min(missing, next_prompt);
  return membership_->others_cached_pages() >= 2 * (missing + headroom) ? headroom : 0;
}

bool KvCache::Impl::reap_dead_members() noexcept { return membership_ && membership_->reap_dead() > 0; }

std::size_t KvCache::Impl::cached_bytes_for_budget() const {
  // A call holding the lock (a step mapping hundreds of pages) must not hold up the pledge:
  // the published figure serves (give_back_to_budget() gives what it can, no more).
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return membership_->published_cached_bytes();
  std::size_t pages = pool_.free_pages();
  const std::vector<std::size_t> floors = reclaimable_floors();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    const std::size_t floor = round_up_to_whole(slot, floors[s]);
    if (!slot.busy() && slot.mapped() > floor) pages += (slot.mapped() - floor) * layout_.num_regions();
  }
  return pages * layout_.page_bytes();  // unclaimed pages are never shared: each counts once
}

void KvCache::Impl::give_back_to_budget(std::size_t bytes) {
  if (detail::fork_generation() != fork_generation_) return;
  using Clock = std::chrono::steady_clock;
  const auto since = detail::nanoseconds_since;
  const auto start = Clock::now();
  const std::size_t page = layout_.page_bytes();
  std::size_t released = 0;
  std::uint64_t lock_wait_ns = 0;
  std::uint64_t event_wait_ns = 0;
  // Takes the lock. When a call of the owner holds it, maybe for a while (a step mapping
  // hundreds of pages), that call gives what it can from freed slots meanwhile
  // (serve_give_back()); the watcher gives the rest once the call is over.
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  auto lock_or_post = [&] {
    if (lock.try_lock()) return;
    const auto waiting = Clock::now();
    give_back_wanted_.store(bytes - std::min(bytes, released * page));
    lock.lock();
    const std::size_t left = give_back_wanted_.exchange(0);
    bytes = released * page + left;  // what the owner's calls gave is theirs to count
    lock_wait_ns += since(waiting);
  };
  lock_or_post();
  std::uint64_t event_wait_before = event_wait_ns_;
  const ReleaseTimes times_before = release_times_;  // what the owner's calls give meanwhile serves this answer too
  // Pages the mapper is moving are in no slot's books nor in the pool: they are left alone,
  // and so is a slot it works on (choose_victim() skips busy slots). No wait for it.
  auto wanted = [&] { return (bytes + page - 1) / page; };
  released = release_for_budget(wanted(), reclaimable_floors(), detail::VictimKinds::freed_then_surplus,
                                /*may_wait=*/false);
  if (released < wanted()) {
    // The rest is in slots whose last readers may still run (the owner's queue may hold a
    // whole iteration): wait for them with the lock released, so that the owner's calls go
    // on meanwhile, then take what is ready.
    const ReaderFence behind = events_behind_readers(reclaimable_floors());
    if (!behind.events.empty()) {
      event_wait_ns += event_wait_ns_ - event_wait_before;  // the owner's calls' waits are not the watcher's
      lock.unlock();
      const auto waiting = Clock::now();
      wait_then_destroy(behind.events);
      event_wait_ns += since(waiting);
      lock_or_post();
      event_wait_before = event_wait_ns_;
    }
    mark_readers_done(behind);
    released += release_for_budget(wanted() - std::min(wanted(), released), reclaimable_floors(),
                                   detail::VictimKinds::freed_then_surplus, /*may_wait=*/true);
  }
  publish_in_use();
  budget_handoff_.answer_unmap_ns += release_times_.unmap_ns - times_before.unmap_ns;
  budget_handoff_.answer_release_ns += release_times_.release_ns - times_before.release_ns;
  budget_handoff_.answer_count_ns += release_times_.count_ns - times_before.count_ns;
  budget_handoff_.answers += 1;
  budget_handoff_.answer_pages += released;
  budget_handoff_.answer_lock_wait_ns += lock_wait_ns;
  budget_handoff_.answer_event_wait_ns += event_wait_ns + (event_wait_ns_ - event_wait_before);
  budget_handoff_.answer_ns += since(start);
}

KvCache::Impl::ReaderFence KvCache::Impl::events_behind_readers(const std::vector<std::size_t>& floors) {
  std::vector<std::size_t> above;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if (!slot.busy() && slot.mapped() > round_up_to_whole(slot, floors[s])) above.push_back(s);
  }
  return fence_readers(above, /*pending_events=*/true);
}

void KvCache::Impl::wait_then_destroy(const std::vector<std::pair<Stream, Event>>& events) {
  try {
    for (const auto& [stream, event] : events) backend_->wait_event(event);
  } catch (...) {
    for (const auto& [stream, event] : events) backend_->destroy_event(event);
    throw;
  }
  for (const auto& [stream, event] : events) backend_->destroy_event(event);
}

void KvCache::Impl::serve_give_back(const std::vector<std::size_t>& floors) {
  if (give_back_wanted_.load(std::memory_order_relaxed) == 0) return;
  const std::size_t bytes = give_back_wanted_.exchange(0);
  if (bytes == 0) return;  // the watcher got the lock first
  const std::size_t page = layout_.page_bytes();
  const std::size_t wanted = (bytes + page - 1) / page;
  std::size_t released = 0;
  try {
    // Freed slots only (an allocated slot's pages above its claim may be what this call
    // is about to claim: its claims are not in the books yet), and only pages no device
    // work reads any more: this call does not wait for its own queue.
    released = release_for_budget(wanted, floors, detail::VictimKinds::freed_only, /*may_wait=*/false);
  } catch (const std::exception& error) {
    // The owner's call goes on; the watcher tries again once it is over.
    detail::log_debug(detail::concat("shared budget: giving pages back during a call failed: ", error.what()));
  } catch (...) {
    detail::log_debug("shared budget: giving pages back during a call failed");
  }
  budget_handoff_.answer_pages += released;
  budget_handoff_.answer_pages_in_calls += released;
  if (released < wanted) give_back_wanted_.fetch_add((wanted - released) * page);
}

std::size_t KvCache::Impl::release_for_budget(std::size_t wanted, const std::vector<std::size_t>& floors,
                                              detail::VictimKinds kinds, bool may_wait) {
  using Clock = std::chrono::steady_clock;
  const auto since = detail::nanoseconds_since;
  // In chunks, each counted back to the budget as soon as it is released: an asker waiting
  // for a few pages goes on after the first chunk, not after the whole answer (on a GPU,
  // ~30 us a page of unmapping and releasing). Each chunk twice the one before: the books
  // are updated (their lock, the askers' wake-up) a few times an answer, not once a page,
  // and an asker of n pages waits for at most about 2n of them.
  std::size_t released = 0;
  std::size_t chunk = kReleaseChunkPages;
  auto next_chunk = [&] { return std::min(chunk, wanted - released); };
  auto release = [&](const std::vector<Page>& pages) {
    PagePool::ReleaseTimes times;
    released += pool_.release_all(pages, &times);
    release_times_.release_ns += times.release_ns;
    release_times_.count_ns += times.count_ns;
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
        (slot.free_event != 0 && !backend_->event_done(slot.free_event))) {
      ready[s] = std::max(ready[s], slot.mapped());
      if (!slot.busy() && slot.mapped() > round_up_to_whole(slot, floors[s])) waiting.push_back(s);
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
          found = reclaim_coldest(pages, next_chunk() - taken, pass, kinds);
          for (std::size_t i = before; i < pages.size(); ++i) taken += pool_.is_large(pages[i].handle) ? large : 1;
        }
      } catch (...) {
        release_times_.unmap_ns += since(start);
        if (!pages.empty()) release(pages);  // unmapped already: they go
        throw;
      }
      release_times_.unmap_ns += since(start);
      if (!pages.empty()) release(pages);
      if (!found) return;
    }
  };
  release_above(ready);
  if (!may_wait || released >= wanted) return released;
  if (!waiting.empty()) {  // one event per stream for them all, not one per victim
    const ReaderFence fence = fence_readers(waiting);
    const auto start = Clock::now();
    wait_then_destroy(fence.events);
    event_wait_ns_ += since(start);
    mark_readers_done(fence);
  }
  release_above(floors);
  return released;
}

void KvCache::Impl::release_when_idle() {
  if (detail::fork_generation() != fork_generation_) return;
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || idle_released_) return;  // a call holds it: not idle
  const auto idle = std::chrono::milliseconds(config_.shared_budget_idle_ms);
  if (std::chrono::steady_clock::now() - last_step_at_ < idle) return;
  idle_released_ = true;
  // Allocated slots keep what they map ahead: a paused request's next step needs it. In
  // chunks (~2 ms of driver calls on a GPU), stopping as soon as a step() waits for the lock:
  // its idle spell is over.
  constexpr std::size_t kChunk = 64;
  std::size_t released = 0;
  auto release_ready = [&] {
    for (;;) {
      const std::size_t given =
          release_for_budget(kChunk, reclaimable_floors(), detail::VictimKinds::freed_only, /*may_wait=*/false);
      released += given;
      if (given < kChunk || steps_waiting_.load() > 0) return given >= kChunk;
    }
  };
  if (release_ready()) {  // a step() waits: it goes first
    budget_handoff_.idle_pages += released;
    publish_in_use();
    return;
  }
  const ReaderFence behind = events_behind_readers(reclaimable_floors());
  if (!behind.events.empty()) {
    lock.unlock();
    wait_then_destroy(behind.events);
    lock.lock();
    if (!idle_released_) return;  // a step() meanwhile ended the idle spell: its pages stay
  }
  mark_readers_done(behind);
  // What the fills just enqueued (done at once on some backends) or the wait made ready.
  release_ready();
  budget_handoff_.idle_pages += released;
  publish_in_use();
}

std::size_t KvCache::Impl::budget_trim_headroom() const {
  return 2 * layout_.pages_for_tokens(eager_tokens()) * layout_.num_regions();
}

std::size_t KvCache::Impl::freed_cached_pages(const std::vector<std::size_t>& floors) const {
  std::size_t pages = pool_.free_pages();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if (slot.allocated || slot.busy()) continue;
    const std::size_t floor = round_up_to_whole(slot, floors[s]);
    if (slot.mapped() > floor) pages += (slot.mapped() - floor) * layout_.num_regions();
  }
  return pages;
}

bool KvCache::Impl::trim_under_pressure() {
  if (detail::fork_generation() != fork_generation_) return false;
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;  // a call holds it: the next poll tries again
  const std::size_t headroom = budget_trim_headroom();
  std::vector<std::size_t> floors = reclaimable_floors();
  const std::size_t cached = freed_cached_pages(floors);
  if (cached <= headroom) return false;
  // Freed slots only (a running request's pages mapped ahead are its next steps'), and only
  // pages whose readers are done: no wait here, where the watcher would answer an ask late.
  // The owner's next step() enqueues the others' zero-fills; a later poll finds them ready.
  const std::size_t released = release_for_budget(std::min(kReleaseChunkPages, cached - headroom), floors,
                                                  detail::VictimKinds::freed_only, /*may_wait=*/false);
  budget_handoff_.pressure_pages += released;
  budget_handoff_.pressure_ns += detail::nanoseconds_since(start);
  if (released == 0) return false;
  publish_in_use();
  floors = reclaimable_floors();
  return freed_cached_pages(floors) > headroom && steps_waiting_.load() == 0;
}

void KvCache::Impl::publish_in_use() noexcept {
  if (!membership_) return;
  std::size_t claimed = 0;
  for (const Slot& slot : slots_) claimed += std::min(slot.claimed, slot.mapped());
  const std::size_t pages = claimed * layout_.num_regions() - sharing_.duplicate_mappings();
  membership_->publish_in_use(pages * layout_.page_bytes());
}

}  // namespace vkv
