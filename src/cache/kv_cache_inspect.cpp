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
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(
      std::count_if(slots_.begin(), slots_.end(), [](const Slot& slot) { return !slot.allocated; }));
}

bool KvCache::Impl::is_allocated(std::size_t slot) const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(mutex_);
  slots_.expect_in_range(slot);
  return slots_[slot].allocated;
}

std::size_t KvCache::Impl::mapped_pages(std::size_t slot) const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(mutex_);
  slots_.expect_in_range(slot);
  return slots_[slot].mapped();
}

std::string KvCache::Impl::explain(Address address) const {
  detail::expect_same_process(fork_generation_);
  return checks_.explain(address);  // takes the lock
}

CacheStats KvCache::Impl::stats() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats stats;
  stats.page_bytes = layout_.page_bytes();
  stats.reserved_bytes = layout_.reserved_bytes();
  stats.budget_pages = pool_.budget_pages();
  stats.pages_created = pool_.created_pages();
  stats.pages_free = pool_.free_pages();
  std::size_t claimed_mappings = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    stats.pages_in_reach +=
        (std::min(slot.mapped(), readers_.first_reclaimable_without_waiting(s)) - slot.claimed) * layout_.num_regions();
    stats.page_mappings += slot.mapped() * layout_.num_regions();
    claimed_mappings += slot.claimed * layout_.num_regions();
    stats.active_slots += slot.allocated ? 1 : 0;
    stats.tokens_in_use += slot.seq_len;
    stats.swapped_slots += slot.swapped ? 1 : 0;
    stats.swapped_bytes += slot.swap.bytes;
    if (slot.allocated && slot.expected_tokens > 0) {
      const std::size_t expected = std::min(layout_.pages_per_slot(), layout_.pages_for_tokens(slot.expected_tokens));
      stats.pages_expected += (expected - std::min(expected, slot.mapped())) * layout_.num_regions();
    }
  }
  // Shared pages lie below their slots' claims: each extra mapping is a claimed one.
  const std::size_t duplicates = sharing_.duplicate_mappings();
  stats.pages_shared = sharing_.shared_pages();
  stats.large_pages = pool_.large_pages();
  stats.pages_mapped = stats.page_mappings - duplicates;
  stats.pages_in_use = claimed_mappings - duplicates;
  stats.pages_cached = stats.pages_mapped - stats.pages_in_use;
  stats.step = profile_.steps();
  stats.mapped_ahead = profile_.mapped_ahead();
  stats.budget_asks = budget_.asks();
  stats.budget_handoff = budget_.handoff();
  if (statistics_ != nullptr) stats.backend = statistics_->stats();
  stats.backend.cleanup_failures = backend_->cleanup_failures();
  return stats;
}

// Each part checks its own; what they must agree on together is checked here.
void KvCache::Impl::check_invariants() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(mutex_);
  slots_.check(layout_, config_.zero_page);
  sharing_.check(slots_);
  if (suspension_) suspension_->check(slots_);
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  for (std::size_t s = 0; s < slots_.size(); ++s)
    expect(!sharing_.holds_shared(slots_[s]) || slots_[s].shared_a_page,
           "slot " + std::to_string(s) + " holds shared pages only after a fork or share_prefix shared a page of it");
  std::size_t physical = 0;  // distinct pages mapped in some slot
  for (const Slot& slot : slots_)
    for (const auto& pages : slot.pages)
      for (PageHandle page : pages) physical += sharing_.is_shared(page) ? 0 : 1;
  physical += sharing_.shared_pages();
  const std::size_t stranded = growth_.stranded_pages();
  expect(pool_.created_pages() == pool_.free_pages() + physical + in_flight_pages_ + stranded,
         "created pages = free + mapped + in flight in the mapper + stranded by a double failure");
  expect(pool_.created_pages() <= pool_.budget_pages(), "created pages <= budget");
  expect(budget_.counts_exactly(pool_.created_pages()),
         "the shared budget counts exactly the pages this cache created");
  // Large pages: whole, at whole spans, the same in every region of a slot, known to the pool.
  const std::size_t span = pool_.large_page_pages();
  for (const Slot& slot : slots_) {
    for (const auto& pages : slot.pages) {
      for (std::size_t i = 0, end = 0; i < pages.size(); i = end) {
        end = detail::run_end(pages.data(), i, pages.size(), [](PageHandle page) { return page; });
        const bool large = end - i > 1;
        expect(large == pool_.is_large(pages[i]), "a run of equal pages in a slot is a large page of the pool's");
        expect(!large || (end - i == span && i % span == 0), "a large page lies whole at a whole span");
        const std::vector<PageHandle>& front = slot.pages.front();
        expect(large == (i + 1 < front.size() && front[i] == front[i + 1]),
               "a slot maps a large page at the same span in every region");
      }
    }
  }
}

}  // namespace vkv
