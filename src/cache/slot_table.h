// The slots: which are allocated, what each claims, which pages each maps, and the order
// alloc_reqid() hands them out in. The logical state every later decision follows (the
// same call sequence must give the same slots on every tensor-parallel rank).
//
// Invariants (check()): a slot maps the same number of pages in every region; a free
// slot claims nothing and is not swapped out; a swapped-out slot claims nothing; a
// slot's seq_len is claimed and its claim is mapped; zero backing covers an allocated
// slot to its end; only a slot without tokens (free, swapped out, or allocated and not
// stepped yet) has a deferred zero-fill, of pages it maps.
//
// Every change to a slot is one of the table's named transitions (mark_allocated(),
// set_tokens(), append_pages(), mark_busy(), defer_fill(), ...); the parts read slots
// through const references.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vkv/backend.h"
#include "vkv/layout.h"

namespace vkv::detail {

/// A slot's books hold a large page as one entry per page it covers, equal handles in a
/// row (a single page appears at most once in a region), so per-page loops still count
/// pages; code that hands pages on (to the pool, to the sharing counts) visits each run
/// once. The end of the run that starts at `first`, before `end`.
template <typename Entry, typename HandleOf>
std::size_t run_end(const Entry* entries, std::size_t first, std::size_t end, HandleOf handle_of) {
  std::size_t last = first + 1;
  while (last < end && handle_of(entries[last]) == handle_of(entries[first])) ++last;
  return last;
}

/// KvCache::Impl's marker for a slot no background unit is working on.
inline constexpr std::size_t kNotBusy = static_cast<std::size_t>(-1);

/// Page `page` (of every region) of slot `slot`.
struct PageRef {
  std::size_t slot, page;
};

/// Host memory holding a swapped-out slot; `ready` follows the copy into or out of it.
struct HostCopy {
  Address host = 0;
  std::size_t bytes = 0;
  Event ready = 0;
};

struct Slot {
  bool allocated = false;
  std::size_t seq_len = 0;  // from the last step()
  // Pages per region the owner has needed since alloc_reqid(). Mapped pages beyond it
  // hold zeros and no kernel of the owner writes them: as reclaimable as a freed slot's.
  std::size_t claimed = 0;
  std::vector<std::vector<PageHandle>> pages;  // [region][page]: pages [0, n) mapped in each region
  // Pages [mapped(), backed_end) of every region are backed by the zero page (zero_page
  // on); pages from backed_end on are not mapped.
  std::size_t backed_end = 0;
  std::uint64_t allocated_at = 0;  // steps done when it was allocated (ReadWindows)
  Event free_event = 0;            // behind the slot's last zero-fill; 0 once waited for
  // The stream free_event was recorded on: later work on that stream is ordered after it
  // without a wait (a cuStreamWaitEvent costs ~10 us on the caller's thread).
  Stream free_event_stream = 0;
  // Pages [0, deferred_fill) of every region hold the tokens of an owner who left
  // (free_reqid, swap_out) until their zero-fill, deferred to the next call that needs
  // it, is enqueued on fill_stream (slot_readers.cpp); 0 once it is.
  std::size_t deferred_fill = 0;
  Stream fill_stream = 0;
  // While the fill is deferred: the owner's last work, which no event follows yet, has
  // been waited for (an event recorded on fill_stream), so pages may leave the cache
  // without the fill (pages_leave_without_fill(), slot_readers.cpp); and which deferral
  // this is (a watcher that waited with the lock released marks only the one it saw).
  bool fill_readers_done = false;
  std::uint64_t fill_mark = 0;
  std::uint64_t freed_at = 0;    // free order, for least-recently-freed reclamation
  std::size_t kept_at_free = 0;  // claimed when freed: alloc_reqid()'s preference
  // A fork() or share_prefix() since alloc_reqid() put a whole page of this slot's tokens
  // at another slot too. Logical: with large pages that page may have been copied, not
  // shared, depending on the pool (so on the rank); the slot choice follows this instead.
  bool shared_a_page = false;
  // While the mapper maps or unmaps pages [busy_from, ...) of this slot outside the lock,
  // kNotBusy otherwise. Nobody else touches the slot's pages at or past it.
  std::size_t busy_from = kNotBusy;
  bool swapped = false;
  HostCopy swap;  // where swap_out() put the tokens
  // Tokens the owner said it will step the slot up to (expect_tokens()): the mapper maps
  // their pages ahead, unclaimed. A hint only: no slot choice, claim or shortage reads it.
  std::size_t expected_tokens = 0;

  std::size_t mapped() const noexcept { return pages.empty() ? 0 : pages.front().size(); }
  bool busy() const noexcept { return busy_from != kNotBusy; }
};

/// The seq_len a swapped-out slot had: its host copy holds that many tokens per region.
inline std::size_t swapped_tokens(const Slot& slot, const KvLayout& layout) noexcept {
  return slot.swap.bytes / (layout.token_bytes() * layout.num_regions());
}

class SlotTable {
 public:
  SlotTable(std::size_t slots, std::size_t regions);

  std::size_t size() const noexcept { return slots_.size(); }
  /// @throws InvalidArgument naming `slot` and max_batch_size when it is out of range.
  void expect_in_range(std::size_t slot) const;
  /// Slots are read here and changed only by the transitions below.
  const Slot& operator[](std::size_t slot) const noexcept { return slots_[slot]; }
  std::vector<Slot>::const_iterator begin() const noexcept { return slots_.begin(); }
  std::vector<Slot>::const_iterator end() const noexcept { return slots_.end(); }

  /// The free slot alloc_reqid() hands out next: the one that kept the most pages when
  /// freed (mark_freed()'s `kept`), lowest index on ties; size() when none is free. With eager allocation on
  /// (set_eager_pages() > 0), the eager slot instead, unless a freed slot kept at least
  /// as many pages as eager allocation maps. Depends on the calls made alone, never on
  /// what the mapper has done yet: tensor-parallel ranks agree on it.
  std::size_t next_to_allocate() const noexcept;
  /// The slot the mapper maps the next prefill's pages into. It stays the same across
  /// frees (a request that leaves does not take the pages mapped for the next one) and
  /// moves on when it is allocated: to the freed slot that kept the most pages.
  std::size_t eager_slot() const noexcept { return eager_slot_; }
  /// Pages per region eager allocation maps in the eager slot (0: off).
  void set_eager_pages(std::size_t pages) noexcept { eager_pages_ = pages; }
  std::size_t free_count() const noexcept;
  /// What each slot claims now.
  std::vector<std::size_t> claims() const;

  /// The books of an allocation (the caller ordered its stream after the zero-fill).
  void mark_allocated(std::size_t slot, std::uint64_t steps_so_far) noexcept;
  /// Undoes mark_allocated() of a call that failed: free again, preferred as before
  /// (`eager_slot` is what eager_slot() said before it).
  void unmark_allocated(std::size_t slot, std::size_t kept_at_free, std::size_t eager_slot) noexcept;
  /// The books of a free: `kept` pages stay for the next owner's preference.
  void mark_freed(std::size_t slot, std::size_t kept) noexcept;

  // ---- the other transitions: the books follow what the caller did ------------------
  /// step() and share_prefix(): the slot holds `seq_len` tokens over `claimed` pages.
  void set_tokens(std::size_t slot, std::size_t seq_len, std::size_t claimed) noexcept;
  /// swap_out(): its tokens are in `copy`; it claims and expects nothing until swap_in().
  void mark_swapped_out(std::size_t slot, const HostCopy& copy) noexcept;
  /// swap_in(): back with `seq_len` tokens over `claimed` pages; the host copy is the
  /// caller's to free.
  void mark_swapped_in(std::size_t slot, std::size_t seq_len, std::size_t claimed) noexcept;
  /// free_reqid() of a swapped-out slot: forgets its host copy and returns it to free.
  HostCopy take_swap(std::size_t slot) noexcept;
  /// expect_tokens(): the mapper's hint.
  void set_expected_tokens(std::size_t slot, std::size_t tokens) noexcept { slots_[slot].expected_tokens = tokens; }
  /// fork() or share_prefix() put a whole page of the slot's tokens at another slot.
  void mark_shared_a_page(std::size_t slot) noexcept { slots_[slot].shared_a_page = true; }

  /// `count` pages mapped after the last of region `region`.
  void append_pages(std::size_t slot, std::size_t region, const PageHandle* pages, std::size_t count);
  /// Region `region` maps `pages` now, in place of what it mapped.
  void set_pages(std::size_t slot, std::size_t region, std::vector<PageHandle> pages) noexcept;
  /// Pages [first, first + count) of region `region` are `pages` now (copy-on-write).
  void replace_pages(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* pages,
                     std::size_t count) noexcept;
  /// Region `region` keeps its first `keep` pages; the rest were unmapped.
  void truncate_pages(std::size_t slot, std::size_t region, std::size_t keep) noexcept;
  /// Zero backing reaches page `pages` (zero_page); nothing past it is mapped.
  void set_backed_end(std::size_t slot, std::size_t pages) noexcept { slots_[slot].backed_end = pages; }

  /// A background unit maps or unmaps the slot's pages from `first` on without the lock.
  void mark_busy(std::size_t slot, std::size_t first) noexcept { slots_[slot].busy_from = first; }
  void mark_not_busy(std::size_t slot) noexcept { slots_[slot].busy_from = kNotBusy; }
  /// `event`, recorded on `stream`, follows the slot's last zero-fill (the caller
  /// destroyed the one before); clear_free_event() once it was waited for and destroyed.
  void set_free_event(std::size_t slot, Event event, Stream stream) noexcept;
  void clear_free_event(std::size_t slot) noexcept { slots_[slot].free_event = 0; }
  /// The slot's claimed pages hold a leaving owner's tokens until a zero-fill on
  /// `stream`, deferred; `mark` names this deferral.
  void defer_fill(std::size_t slot, Stream stream, std::uint64_t mark) noexcept;
  /// The deferred fill covers the first `keep` pages only (0: none left, enqueued or moot).
  void shrink_fill(std::size_t slot, std::size_t keep) noexcept;
  /// The owner's last work ahead of the deferred fill is known done.
  void mark_fill_readers_done(std::size_t slot) noexcept { slots_[slot].fill_readers_done = true; }

  /// @throws Error naming the broken invariant (see the file comment).
  void check(const KvLayout& layout, bool zero_page) const;

 private:
  // The free slot that kept the most pages, lowest index on ties; size() when none is free.
  std::size_t most_kept() const noexcept;
  bool is_free(std::size_t slot) const noexcept { return slot < slots_.size() && !slots_[slot].allocated; }

  std::vector<Slot> slots_;
  std::uint64_t frees_ = 0;  // free_reqid() calls so far: each free's freed_at
  std::size_t eager_slot_ = 0;
  std::size_t eager_pages_ = 0;
};

}  // namespace vkv::detail
