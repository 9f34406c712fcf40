// Pages mapped at more than one slot's addresses (fork, share_prefix): how many times.
// A page absent here is mapped once.
//
// Sharing pairs the same page index of the same region in two slots (a shared prefix
// sits at the same token positions). Only allocated slots hold shared pages, all below
// their claim; freeing or swapping out a slot drops its shared pages at once. So pages
// that can be reclaimed are never shared, and the rest of the page accounting holds.
//
// A large page is shared whole or not at all, and counted once per slot address, like a
// page; it weighs its pages in shared_pages() and duplicate_mappings().
//
// Invariants (check()): a page's count equals the slot addresses mapping it; a counted
// page is mapped at least twice; a page is shared in every region of a slot or in none.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <unordered_map>

#include "slot_table.h"

namespace vkv::detail {

class PageSharing {
 public:
  bool empty() const noexcept { return shares_.empty(); }
  /// Pages mapped more than once (a large page counts its pages).
  std::size_t shared_pages() const noexcept;
  bool is_shared(PageHandle page) const { return shares_.count(page) != 0; }
  /// Slot addresses mapping `page` (1 for a page mapped once).
  std::size_t mappings(PageHandle page) const;
  /// True when `slot` maps any shared page (checked in its first region: all or none).
  bool holds_shared(const Slot& slot) const;
  /// One more slot maps `page`, which covers `pages` pages (more than 1: a large page).
  void add_mapping(PageHandle page, std::size_t pages = 1);
  /// One slot less maps `page`; true when that was its last mapping (it may go back to the pool).
  bool drop_mapping(PageHandle page);
  /// Extra mappings beyond one per page: what page_mappings counts over pages_mapped.
  std::size_t duplicate_mappings() const noexcept;

  /// @throws Error naming the broken invariant (see the file comment).
  void check(const SlotTable& slots) const;

 private:
  struct Share {
    std::size_t mappings = 2;  // slot addresses
    std::size_t pages = 1;     // pages it covers
  };
  std::unordered_map<PageHandle, Share> shares_;  // pages mapped more than once
};

}  // namespace vkv::detail
