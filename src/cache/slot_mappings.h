// Which pages back which range of a slot's addresses: real pages mapped (over zero
// backing, where there is some) and unmapped again, zero backing for ranges no page backs,
// the zero-fill of pages just mapped, and the books an unmapping leaves (a page mapped
// nowhere else any more goes back). A slot's pages [0, mapped) are real, [mapped,
// backed_end) zero-backed (zero_page), the rest unmapped (slot_table.h).
//
// Large pages lie whole at whole spans, the same in every region of a slot: they are
// mapped with one call and unmapped only whole (round_down_to_whole(), round_up_to_whole()).
//
// Mechanism only: which slot, which pages and when is the cache's; nothing here waits for
// device work in flight (the caller orders its unmappings after their readers).
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex (the
// mapper thread calls the backend-only ones without it, on a range that is its own).
#pragma once

#include <cstddef>
#include <vector>

#include "cache_context.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "slot_table.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

class SlotMappings {
 public:
  /// `cache` must outlive it; its config (zero_page, scratch_page) is read as it is then.
  explicit SlotMappings(CacheContext& cache)
      : backend_(cache.backend()),
        layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        sharing_(cache.sharing),
        pool_(cache.pool) {}
  SlotMappings(const SlotMappings&) = delete;
  SlotMappings& operator=(const SlotMappings&) = delete;

  /// The start of the reservation the slots lie in (before any other call).
  void set_base(Address base) noexcept { base_ = base; }
  /// Page `page` of region `region` of slot `slot`.
  Address address(std::size_t region, std::size_t slot, std::size_t page) const noexcept {
    return base_ + layout_.page_offset(region, slot, page);
  }

  // ---- backend calls only, all or nothing; the caller keeps the books -----------------
  /// Real pages at pages [first, first + count) of one region, replacing zero backing.
  void map_real(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* handles, std::size_t count);
  /// Maps `count` handles side by side at `address` (a large page as its run of equal
  /// handles, with one call).
  void map_handles(Address address, const PageHandle* handles, std::size_t count);
  /// Back from map_real() (`handles`: the pages mapped there, mapped again if backing
  /// with zeros fails).
  void unmap_real(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* handles,
                  std::size_t count);
  /// Unmaps pages [keep, keep + count) of every region of a slot (its books' pages); on a
  /// failure the regions already unmapped are mapped back (their errors dropped) and the
  /// first error propagates.
  void unmap_regions(std::size_t slot, std::size_t keep, std::size_t count);
  /// Pages [from, until) of every region of a slot, which must be unmapped, backed with
  /// zeros. Nothing reads an unmapped range, so undoing a region needs no wait.
  void back_regions_with_zeros(std::size_t slot, std::size_t from, std::size_t until);
  /// Zero-fills the pages of `pages` not known clean, mapped side by side at `address`.
  void zero_fresh_pages(Address address, const Page* pages, std::size_t count, Stream stream);
  /// Zero-fills pages [first, first + count) of every region of a slot, just mapped from
  /// `pages` (region r's at pages[r * count]): one launch when none is known clean.
  void zero_fresh_regions(std::size_t slot, std::size_t first, const Page* pages, std::size_t count, Stream stream);

  // ---- with the books --------------------------------------------------------------
  /// Backs pages [max(mapped, backed_end), until) of every region of a slot with zeros.
  void back_with_zeros(std::size_t slot, std::size_t until);
  /// One slot address less maps each page or large page of pages[from, to); those mapped
  /// nowhere else now go into `into`.
  void drop_mappings(const std::vector<PageHandle>& pages, std::size_t from, std::size_t to, bool clean,
                     std::vector<Page>& into);
  /// Gives pages[0, count) back to the pool, a large page (a run of equal handles) once.
  void give_back_pages(const Page* pages, std::size_t count);
  /// Large pages are unmapped whole: the start of the one covering page `page` of a slot
  /// without starting there, else `page`; and the end of that one, else `page`.
  std::size_t round_down_to_whole(const Slot& slot, std::size_t page) const noexcept;
  std::size_t round_up_to_whole(const Slot& slot, std::size_t page) const noexcept;

 private:
  Backend& backend_;
  const KvLayout& layout_;
  const CacheConfig& config_;
  SlotTable& slots_;
  PageSharing& sharing_;
  PagePool& pool_;
  Address base_ = 0;
};

}  // namespace vkv::detail
