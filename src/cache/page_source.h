// Where the pages a call maps come from: the pool first, then pages slots map beyond
// their floors (their claims, or what work in flight may read), coldest first
// (choose_victim(), reclaim_policy.h), unmapped whole (a large page as a whole). How
// many can be had, the shortage a call would meet (OutOfMemory naming it), and
// unmapping a slot's tail after its last readers.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <vector>

#include "cache_context.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "reclaim_policy.h"
#include "shared_budget/budget_client.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "vkv/layout.h"

namespace vkv::detail {

class PageSource {
 public:
  /// Everything given must outlive it.
  PageSource(CacheContext& cache, SlotMappings& mappings, SlotReaders& readers)
      : layout_(cache.layout),
        slots_(cache.slots),
        pool_(cache.pool),
        sharing_(cache.sharing),
        mappings_(mappings),
        readers_(readers),
        budget_(cache.budget) {}
  PageSource(const PageSource&) = delete;
  PageSource& operator=(const PageSource&) = delete;

  /// Pages (all regions) a call could have with slots keeping `claims` (per region): the
  /// pool's, and what slots the mapper is not working on map above them (whole large pages).
  std::size_t obtainable_pages(const std::vector<std::size_t>& claims) const;
  /// How many of `missing` pages could not be had with `slot` claiming `claim` pages
  /// (the others what they claim now).
  std::size_t pages_short(std::size_t missing, std::size_t slot, std::size_t claim) const;
  /// @throws OutOfMemory naming `call`, `missing`, what can be had and why, when
  /// obtainable_pages(claims) falls short of `missing`.
  void expect_obtainable(std::size_t missing, const std::vector<std::size_t>& claims, const char* call) const;
  /// Pages from the pool, then reclaimed from slots above their floors (claims, for an
  /// engine call that waits for in-flight readers after ReadWindows::close_current(); or
  /// SlotReaders::reclaimable_floors() for a call that cannot). Exactly `count` pages, or
  /// OutOfMemory with every page given back: what the pool grants may fall short of what
  /// obtainable_pages() said (a shared budget's room is a hint), so a shortage is found here too.
  std::vector<Page> obtain(std::size_t count, const std::vector<std::size_t>& floors);
  /// Unmaps up to `wanted` pages (all regions) of the slot choose_victim(kinds) names into
  /// `into`; false when no slot has a page above its floor.
  bool reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& floors,
                       VictimKinds kinds = VictimKinds::surplus_then_freed);
  /// Unmaps pages [keep, mapped) of every region of a slot (`keep` splits no large page)
  /// after their last readers: those mapped nowhere else go into `into`.
  void unmap_tail(std::size_t slot, std::size_t keep, std::vector<Page>& into);

  // ---- the budget (set_budget(), prepare_set_budget()) --------------------------------
  /// Pages that cannot be released now: what allocated slots claim, and (zero_page) pages
  /// work in flight may read; a shared page once.
  std::size_t pages_held_now() const;
  /// Releases pages until no more exist than the pool's budget allows: free ones first,
  /// then unclaimed mappings (after their last readers), coldest first. The caller made
  /// sure pages_held_now() fits. @throws as the backend's calls.
  void shrink_to_budget();

 private:
  const KvLayout& layout_;
  SlotTable& slots_;
  PagePool& pool_;
  const PageSharing& sharing_;
  SlotMappings& mappings_;
  SlotReaders& readers_;
  const BudgetClient& budget_;
};

}  // namespace vkv::detail
