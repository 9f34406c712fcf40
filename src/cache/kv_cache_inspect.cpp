// KvCache: inspection (stats, slot state) and the invariants the parts must keep together.
#include <algorithm>
#include <chrono>
#include <string>

#include "kv_cache_impl.h"
#include "undo_log.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {

// ---- inspection -----------------------------------------------------------------------

std::size_t KvCache::Impl::num_free_slots() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  return static_cast<std::size_t>(
      std::count_if(cache_.slots.begin(), cache_.slots.end(), [](const Slot& slot) { return !slot.allocated; }));
}

bool KvCache::Impl::is_allocated(std::size_t slot) const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  cache_.slots.expect_in_range(slot);
  return cache_.slots[slot].allocated;
}

std::size_t KvCache::Impl::mapped_pages(std::size_t slot) const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  cache_.slots.expect_in_range(slot);
  return cache_.slots[slot].mapped();
}

std::string KvCache::Impl::explain(Address address) const {
  detail::expect_same_process(fork_generation_);
  return checks_.explain(address);  // takes the lock
}

CacheStats KvCache::Impl::stats() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  CacheStats stats;
  stats.page_bytes = cache_.layout.page_bytes();
  stats.reserved_bytes = cache_.layout.reserved_bytes();
  stats.budget_pages = cache_.pool.budget_pages();
  stats.pages_created = cache_.pool.created_pages();
  stats.pages_free = cache_.pool.free_pages();
  std::size_t claimed_mappings = 0;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    stats.pages_in_reach += (std::min(slot.mapped(), readers_.first_reclaimable_without_waiting(s)) - slot.claimed) *
                            cache_.layout.num_regions();
    stats.page_mappings += slot.mapped() * cache_.layout.num_regions();
    claimed_mappings += slot.claimed * cache_.layout.num_regions();
    stats.active_slots += slot.allocated ? 1 : 0;
    stats.tokens_in_use += slot.seq_len;
    stats.swapped_slots += slot.swapped ? 1 : 0;
    stats.swapped_bytes += slot.swap.bytes;
    if (slot.allocated && slot.expected_tokens > 0) {
      const std::size_t expected =
          std::min(cache_.layout.pages_per_slot(), cache_.layout.pages_for_tokens(slot.expected_tokens));
      stats.pages_expected += (expected - std::min(expected, slot.mapped())) * cache_.layout.num_regions();
    }
  }
  // Shared pages lie below their slots' claims: each extra mapping is a claimed one.
  const std::size_t duplicates = cache_.sharing.duplicate_mappings();
  stats.pages_shared = cache_.sharing.shared_pages();
  stats.large_pages = cache_.pool.large_pages();
  stats.pages_mapped = stats.page_mappings - duplicates;
  stats.pages_in_use = claimed_mappings - duplicates;
  stats.pages_cached = stats.pages_mapped - stats.pages_in_use;
  stats.step = cache_.profile.steps();
  stats.mapped_ahead = cache_.profile.mapped_ahead();
  stats.budget_asks = cache_.budget.asks();
  stats.budget_handoff = cache_.budget.handoff();
  if (cache_.statistics != nullptr) stats.backend = cache_.statistics->stats();
  stats.backend.cleanup_failures = cache_.backend().cleanup_failures();
  return stats;
}

// Each part checks its own; what they must agree on together is checked here.
void KvCache::Impl::check_invariants() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  cache_.slots.check(cache_.layout, cache_.config.zero_page);
  cache_.sharing.check(cache_.slots);
  suspension_.check();
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  for (std::size_t s = 0; s < cache_.slots.size(); ++s)
    expect(!cache_.sharing.holds_shared(cache_.slots[s]) || cache_.slots[s].shared_a_page,
           "slot " + std::to_string(s) + " holds shared pages only after a fork or share_prefix shared a page of it");
  std::size_t physical = 0;  // distinct pages mapped in some slot
  for (const Slot& slot : cache_.slots)
    for (const auto& pages : slot.pages)
      for (PageHandle page : pages) physical += cache_.sharing.is_shared(page) ? 0 : 1;
  physical += cache_.sharing.shared_pages();
  const std::size_t stranded = growth_.stranded_pages();
  expect(cache_.pool.created_pages() == cache_.pool.free_pages() + physical + cache_.in_flight_pages + stranded,
         "created pages = free + mapped + in flight in the mapper + stranded by a double failure");
  expect(cache_.pool.created_pages() <= cache_.pool.budget_pages(), "created pages <= budget");
  expect(cache_.budget.counts_exactly(cache_.pool.created_pages()),
         "the shared budget counts exactly the pages this cache created");
  // Large pages: whole, at whole spans, the same in every region of a slot, known to the pool.
  const std::size_t span = cache_.pool.large_page_pages();
  for (const Slot& slot : cache_.slots) {
    for (const auto& pages : slot.pages) {
      for (std::size_t i = 0, end = 0; i < pages.size(); i = end) {
        end = detail::run_end(pages.data(), i, pages.size(), [](PageHandle page) { return page; });
        const bool large = end - i > 1;
        expect(large == cache_.pool.is_large(pages[i]), "a run of equal pages in a slot is a large page of the pool's");
        expect(!large || (end - i == span && i % span == 0), "a large page lies whole at a whole span");
        const std::vector<PageHandle>& front = slot.pages.front();
        expect(large == (i + 1 < front.size() && front[i] == front[i + 1]),
               "a slot maps a large page at the same span in every region");
      }
    }
  }
}

}  // namespace vkv
