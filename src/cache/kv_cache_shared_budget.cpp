// KvCache in a shared budget (vkv/shared_budget.h): asking the other members for pages
// when the cache runs short, and giving pages back when they ask. The books and the
// watcher thread are BudgetMembership's; what to give and how is decided here.
#include <algorithm>
#include <chrono>

#include "kv_cache_impl.h"
#include "util/fork_guard.h"
#include "vkv/error.h"

namespace vkv {

void KvCache::Impl::ask_shared_budget(std::unique_lock<std::mutex>& lock, std::size_t pages) {
  const auto start = std::chrono::steady_clock::now();
  lock.unlock();
  try {
    membership_->ask(pages);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  membership_->claim_reserved();
  budget_asks_.calls += 1;
  budget_asks_.nanoseconds += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
  try {
    budget_asks_.units += pool_.add_free(membership_->claimed_pages());
  } catch (const OutOfMemory&) {
    // The device itself is short (memory outside the budget): the call will say so.
  }
  membership_->release_claimed();  // what the pool could not take goes back
}

bool KvCache::Impl::reap_dead_members() noexcept { return membership_ && membership_->reap_dead() > 0; }

std::size_t KvCache::Impl::cached_bytes_for_budget() const {
  std::lock_guard<std::mutex> lock(mutex_);
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
  // Pages the mapper is moving are in no slot's books nor in the pool: they are left alone,
  // and so is a slot it works on (choose_victim() skips busy slots). No wait for it.
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t page = layout_.page_bytes();
  const std::size_t wanted = (bytes + page - 1) / page;
  std::size_t released = pool_.trim(pool_.free_pages() - std::min(pool_.free_pages(), wanted));
  const std::vector<std::size_t> floors = reclaimable_floors();
  while (released < wanted) {
    std::vector<Page> pages;
    if (!reclaim_coldest(pages, wanted - released, floors, detail::VictimKinds::freed_then_surplus)) break;
    for (const Page& unmapped : pages) {
      released += pool_.is_large(unmapped.handle) ? pool_.large_page_pages() : 1;
      pool_.release(unmapped);
    }
  }
  publish_in_use();
}

void KvCache::Impl::publish_in_use() noexcept {
  if (!membership_) return;
  std::size_t claimed = 0;
  for (const Slot& slot : slots_) claimed += std::min(slot.claimed, slot.mapped());
  const std::size_t pages = claimed * layout_.num_regions() - sharing_.duplicate_mappings();
  membership_->publish_in_use(pages * layout_.page_bytes());
}

}  // namespace vkv
