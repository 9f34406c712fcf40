// Mapping fresh pages at the end of slots, the one way both step() (and the calls that
// map what they need: swap_in, prepare_*) and the mapper grow a slot: get the pages
// (large ones at the whole spans a slot grows over, single pages around them), map every
// region of the slot over its zero backing, zero-fill the pages not known clean, and undo
// the mappings (UndoLog, after the device work queued on them) if anything fails.
//
// step()'s way holds the lock: pages may be reclaimed from other slots (PageSource), the
// books follow each mapping, and shared pages the slots are about to write get private
// copies (copy-on-write). The mapper's way maps ahead from free memory only: its pages
// are created and mapped without the lock, on a slot range marked busy, and its books
// follow once it is done; a region whose undo fails is stranded (out of the pool, mapped
// past its slot's books) until unmap_stranded() manages.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex (the
// mapper's grow_ahead() releases it for its backend calls).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

#include "cache_context.h"
#include "call_profile.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "page_source.h"
#include "shared_budget/budget_client.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "undo_log.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

class SlotGrowth {
 public:
  /// Everything given must outlive it. It counts the pages the mapper took in
  /// `cache.in_flight_pages` and tells `cache.unit_done` when a unit ends.
  SlotGrowth(CacheContext& cache, SlotMappings& mappings, SlotReaders& readers, PageSource& source)
      : backend_(cache.backend()),
        layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        pool_(cache.pool),
        sharing_(cache.sharing),
        mappings_(mappings),
        readers_(readers),
        source_(source),
        budget_(cache.budget),
        profile_(cache.profile),
        unit_done_(cache.unit_done),
        in_flight_pages_(cache.in_flight_pages) {}
  SlotGrowth(const SlotGrowth&) = delete;
  SlotGrowth& operator=(const SlotGrowth&) = delete;

  /// step()'s way: maps every slot up to claims[s] pages per region and gives `copies`
  /// private copies of the shared pages they name, with `missing` pages in all (reclaimed
  /// from slots above `claims` where the pool has too few). Each backend step registers
  /// its undo in `undo`; the caller commits. Every mapping is made before any zero-fill
  /// is enqueued, so a failed map is undone at once; once device work is queued, undoing
  /// waits for it (the undo log's stream waiter). @throws OutOfMemory naming `call`.
  void map_missing(const std::vector<std::size_t>& claims, const std::vector<PageRef>& copies, std::size_t missing,
                   Stream stream, UndoLog& undo, const char* call);
  /// The mapper's way: maps pages ahead in `slot` towards `target` pages per region (a
  /// large page per region where a whole span lies ahead, else at most a unit's single
  /// pages), from free memory only, zero-filled on `stream` and waited for. Called with
  /// the lock held; releases it for the backend calls. False when there was nothing to take.
  bool grow_ahead(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t target, Stream stream);

  /// Whether the mapper is moving pages: pages it took (in flight), or a slot it works on.
  /// A shortage is decided once it has put them down.
  bool mapper_busy() const noexcept {
    return in_flight_pages_ > 0 ||
           std::any_of(slots_.begin(), slots_.end(), [](const Slot& slot) { return slot.busy(); });
  }
  /// Tries again to unmap stranded pages (of slots the mapper is not working on) and
  /// gives back those it could; before anything maps past a slot's books.
  void unmap_stranded() noexcept;
  /// Pages stranded now (a large page once per page it covers).
  std::size_t stranded_pages() const noexcept;

 private:
  // Pages a failed mapper unit could not unmap (its undo failed too).
  struct Stranded {
    std::size_t slot, region, first;
    std::vector<PageHandle> handles;  // a large page once per page it covers
  };
  // The core both ways share: maps pages [first, first + count) of every region of `slot`
  // from pages[next...] (region after region; a large page as its run of equal entries),
  // `next` moving past each region as it is mapped and its unmapping registered in
  // `undo`. Without `stranded` the caller holds the lock: the slot's books follow each
  // mapping (and its undo); with it they are the caller's, and a region whose unmapping
  // fails in undo goes there.
  void map_fresh(std::size_t slot, std::size_t first, const std::vector<Page>& pages, std::size_t& next,
                 std::size_t count, UndoLog& undo, std::vector<Stranded>* stranded);
  // Appends the pages of a slot's pages [first, until) to `into`, region by region: large
  // pages (`large`: one per region, span after span) at the whole spans from the first
  // whole span at or after `first` on, one entry per page they cover; single pages from
  // `singles` (which it advances) around them.
  void lay_out(std::size_t first, std::size_t until, const std::vector<Page>& large, const Page*& singles,
               std::vector<Page>& into) const;
  // Large pages for the whole large-page spans slots grow into (claims[s] beyond what
  // they map), in every region of a span or in none, as far as the pool has them without
  // reclaiming: [slot] -> `regions` pages per span, the slot's first spans in order.
  std::vector<std::vector<Page>> take_large_pages(const std::vector<std::size_t>& claims);
  // Gives each slot in `copies` a private copy of the shared page it names, from
  // pages[next...] (kv_cache_sharing.cpp's rules: slot_growth.cpp).
  void copy_on_write(const std::vector<PageRef>& copies, const std::vector<Page>& pages, std::size_t& next,
                     Stream stream, UndoLog& undo);

  Backend& backend_;
  const KvLayout& layout_;
  const CacheConfig& config_;
  SlotTable& slots_;
  PagePool& pool_;
  PageSharing& sharing_;
  SlotMappings& mappings_;
  SlotReaders& readers_;
  PageSource& source_;
  BudgetClient& budget_;
  CallProfile& profile_;
  std::condition_variable& unit_done_;
  std::size_t& in_flight_pages_;
  std::vector<Stranded> stranded_;
};

}  // namespace vkv::detail
