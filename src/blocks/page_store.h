// PageStore: the physical side of the block-backing layer. Each page of the reservation is
//   unmapped  nothing under it, or the scratch page (config.scratch_page)
//   held      a page of the pool mapped there: some backed block has bytes on it
//   pending   still mapped, no backed block on it any more, waiting for an event behind
//             the device work that may still read it before it goes back to the pool
//   parked    as pending, but part of a large page some of whose pages are still held:
//             a large page goes back only whole, once none of its pages is held (a chunk
//             just mapped whole parks the pages not asked for, with no event to wait for)
// It maps fresh pages in runs with their zero-fills on a stream of its own. With large
// pages (config.large_page_size) the reservation is cut into chunks of a large page each,
// from its first page: a chunk with nothing mapped in it is mapped whole, in one create,
// map and access call instead of one a page (on CUDA ~10x the bytes a second), its pages
// not asked for parked -- the layer backs the lowest blocks, so the next backs continue
// into them -- and under it lies one scratch large page, unmapped in one call; the other
// pages go page by page, in one map call a run. It takes pending and parked pages back
// when a block on them is backed again (zero-filled behind their event: a page backed anew
// always starts as zeros); and gives pending pages back to the pool -- unmapped, the
// scratch page under them again, released to the device and the budget -- once their
// events completed (a whole large page with a scratch large page under it: scratch_cover.h).
// The driver's unmap does not wait for running kernels: nothing is unmapped before its event.
//
// map_fresh() and take_back() register how to undo what they did in the caller's log
// (undo_log.h: a mapping is put back only after the stream's work). A failed settle()
// leaves the pages it did not give back pending.
//
// Internal. Thread-safety: none; the layer's mutex serializes every call.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/page_pool.h"
#include "cache/undo_log.h"
#include "scratch_cover.h"
#include "vkv/backend.h"
#include "vkv/stats.h"

namespace vkv::detail {

class PageStore {
 public:
  enum class State : std::uint8_t { unmapped, held, pending, parked };
  static constexpr std::size_t kEveryPage = static_cast<std::size_t>(-1);

  /// Creates its stream. `backend` and `pool` must outlive it; runs of fresh pages are
  /// mapped in the pool's large pages where it has them (PagePool::large_page_pages()).
  /// @throws DriverError.
  PageStore(Backend& backend, PagePool& pool, std::size_t num_pages, bool scratch_page);
  /// Destroys its events and stream; release_everything() first gives the pages back.
  ~PageStore();
  PageStore(const PageStore&) = delete;
  PageStore& operator=(const PageStore&) = delete;

  /// The reservation's first byte (once reserved).
  void set_base(Address base) noexcept {
    base_ = base;
    scratch_.set_base(base);
  }
  Address address(std::size_t page) const noexcept { return base_ + page * pool_page_bytes_; }
  Stream stream() const noexcept { return stream_; }
  State state(std::size_t page) const noexcept { return states_[page]; }
  std::size_t held_pages() const noexcept { return held_; }
  std::size_t pending_pages() const noexcept { return pending_.size(); }
  std::size_t parked_pages() const noexcept { return parked_; }
  /// Pending or parked: mapped, with no backed block on it; take_back() takes it.
  bool unused_but_mapped(std::size_t page) const noexcept {
    return states_[page] == State::pending || states_[page] == State::parked;
  }

  /// The scratch page under every page (construction, with scratch_page): a scratch large
  /// page on each whole chunk, so that mapping the chunk unmaps one mapping, not one a page.
  /// All or nothing. @throws DriverError / OutOfMemory.
  void cover_all_with_scratch();
  /// Maps pool pages at `pages` (ascending, unmapped) and zero-fills those not known to be
  /// zeros on stream(); they are held. A chunk with nothing mapped yet is mapped whole where
  /// the budget has room for its other pages too (they are parked). All or nothing:
  /// @throws OutOfMemory naming the shortfall (nothing changed, no page taken); DriverError.
  void map_fresh(const std::vector<std::size_t>& pages, UndoLog& undo);
  /// Pending or parked `pages` (ascending) are held again, zero-filled on stream() behind
  /// their events; the other pending pages of their large pages are parked. @throws DriverError.
  void take_back(const std::vector<std::size_t>& pages, UndoLog& undo);
  /// Held `pages` no backed block has bytes on any more: pending until `event` completes
  /// (parked while their large page has held pages). Takes ownership of `event` (destroyed
  /// once no page waits for it; at once when `pages` is empty).
  void add_pending(const std::vector<std::size_t>& pages, Event event) noexcept;
  /// Gives back the pending pages whose events completed (`wait`: waits for them all; a
  /// large page once all its pages' have), at most about `most` of them (the highest; a
  /// large page whole); returns how many went. Counts them and the time in `given_back`.
  /// @throws DriverError (the pages not given back stay pending).
  std::size_t settle(bool wait, CallStats& given_back, std::size_t most = kEveryPage);
  /// Waits for the zero-fills enqueued on stream(). @throws DriverError.
  void finish_device_work();
  /// The layer is going away and the device is idle: unmaps every page (and the scratch
  /// page), releases the pool's pages. Never throws.
  void release_everything() noexcept;
  /// A forked child: what the store holds is the parent's; its destructor releases none of it.
  void abandon() noexcept { scratch_.abandon(); }
  /// Checks the page states against the counts' backed pages. @throws Error.
  void check(const std::vector<bool>& backed) const;

 private:
  struct PendingEvent {
    Event event = 0;        // 0: none, the pages were mapped fresh and no device work read them
    std::size_t pages = 0;  // pending and parked pages that wait for it
    bool alive = false;
    bool ready = false;  // settle(): completed
    bool asked = false;  // settle(): queried (or waited for) already
  };
  // Calls `run(first, count)` for each run of consecutive pages in `pages` (ascending) for
  // which `selected(page)` holds.
  template <typename Selected, typename Run>
  static void for_each_run(const std::vector<std::size_t>& pages, Selected selected, Run run);
  static constexpr std::uint32_t kSinglePage = static_cast<std::uint32_t>(-1);
  // The chunks of `pages` (ascending, unmapped) to map whole: those with nothing mapped,
  // inside the reservation, as long as the budget has room for them and the other pages.
  std::vector<std::size_t> whole_chunks(const std::vector<std::size_t>& pages) const;
  // The first page of the large page `page` is part of; kSinglePage for a page of its own.
  std::size_t large_first(std::size_t page) const noexcept { return large_first_[page]; }
  bool in_large(std::size_t page) const noexcept { return large_first_[page] != kSinglePage; }
  // Maps [first, first + count) as it was mapped before: large pages whole, the others in one call.
  void map_as_before(std::size_t first, std::size_t count);
  void unmap_run(std::size_t first, std::size_t count);
  // An entry of events_ for `event` with `pages` waiting (a destroyed entry's slot reused).
  std::uint32_t add_event(Event event, std::size_t pages);
  // The large page starting at `first`: its parked pages become pending, if none is held.
  void pend_if_unheld(std::size_t first) noexcept;
  // held_, parked_, pending_ and the events' page counts again from states_ (undoing).
  void recount() noexcept;
  void drop_unused_events() noexcept;
  // Blocks until `event` completed. The driver's wait spins a core (CUDA's events are not
  // blocking-sync ones) for as long as the forward runs: this sleeps between queries
  // instead, up to kQuietWait, then waits the driver's way.
  void wait_quietly(Event event);
  static constexpr std::chrono::milliseconds kQuietWait{200};

  Backend& backend_;
  PagePool& pool_;
  std::size_t pool_page_bytes_;
  bool scratch_page_;
  ScratchCover scratch_;  // under unmapped pages, where scratch_page_
  Address base_ = 0;
  Stream stream_ = 0;
  std::vector<State> states_;
  std::size_t large_pages_;                   // pages a large page has; 0: none
  std::vector<PageHandle> handles_;           // a large page's handle on each of its pages
  std::vector<std::uint32_t> large_first_;    // per page: the first page of its large page
  std::vector<std::uint32_t> pending_event_;  // per pending or parked page: its entry in events_
  std::vector<std::size_t> pending_;          // the pending pages, in no order
  std::vector<PendingEvent> events_;
  std::size_t held_ = 0;
  std::size_t parked_ = 0;
};

}  // namespace vkv::detail
