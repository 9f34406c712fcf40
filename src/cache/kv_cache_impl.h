// KvCache::Impl: the parts of a cache and how its calls compose them.
//
//   SlotTable     slot_table.h      who is allocated, what each claims and maps, alloc order
//   BudgetClient  budget_client.h   the cache's half of a shared budget's protocol (CachePages)
//   PageSharing   page_sharing.h    pages mapped at several slots (fork, share_prefix)
//   PagePool      page_pool.h       physical pages: free, created, the budget
//   ReadWindows   read_windows.h    what device work in flight may still read
//   choose_victim reclaim_policy.h  which pages go back first
//   Mapper        mapper.h          the background thread; what it does is planned here
//   Backend       backend.h         the device (behind the statistics adaptor if asked)
//
// Each public call checks its arguments, waits for the mapper where it must, and then
// changes the parts under one mutex; a call that fails undoes what it did (undo_log.h),
// in stream order. The methods live in the files named after what they do:
// kv_cache.cpp (construction, alloc, free, the public forwarders), kv_cache_step.cpp,
// kv_cache_fill.cpp (the zero-fill free_reqid() and swap_out() leave to later calls),
// kv_cache_mappings.cpp (mapping and unmapping a slot's pages, reclamation),
// kv_cache_background_plan.cpp and kv_cache_background_units.cpp (the mapper's work),
// kv_cache_sharing.cpp, kv_cache_swap.cpp, kv_cache_elastic.cpp, kv_cache_prepare.cpp,
// kv_cache_slot_calls.cpp, kv_cache_budget_pages.cpp, kv_cache_inspect.cpp (stats, invariants).
//
// Lock order: the cache's mutex, then the backend's own locks; the mapper thread takes
// the same mutex and makes its slow backend calls without it (a busy slot's pages at or
// past busy_from are its own meanwhile). Nothing under the mutex takes Python's GIL.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "mapper.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "prompt_history.h"
#include "read_windows.h"
#include "reclaim_policy.h"
#include "shared_budget/budget_client.h"
#include "slot_table.h"
#include "vkv/kv_cache.h"
#include "vkv/statistics_backend.h"

namespace vkv {
namespace detail {
class UndoLog;
}

class KvCache::Impl final : private detail::BudgetClient::CachePages {
 public:
  Impl(const CacheConfig& config, std::shared_ptr<Backend> backend);
  ~Impl() override;

  // ---- the public calls (kv_cache.h documents them) --------------------------------
  std::size_t alloc_reqid(Stream stream);
  std::vector<std::size_t> alloc_reqids(std::size_t count, bool contiguous, Stream stream);
  void free_reqid(std::size_t slot, Stream stream);
  void step(const std::size_t* seq_lens, std::size_t count, Stream stream);
  void step_slots(const std::size_t* slots, const std::size_t* seq_lens, std::size_t count, Stream stream);
  std::vector<std::size_t> seq_lens() const;
  void set_deferred_reclamation(bool on);
  void expect_tokens(std::size_t slot, std::size_t tokens);
  std::size_t map_ahead_now();
  void stop_background() noexcept;
  std::size_t fork(std::size_t src, Stream stream);
  void share_prefix(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream);
  void swap_out(std::size_t slot, Stream stream);
  void swap_in(std::size_t slot, Stream stream);
  bool is_swapped(std::size_t slot) const;
  void suspend(Stream stream);
  void resume(Stream stream);
  bool is_suspended() const;
  void set_budget(std::size_t bytes);
  std::size_t trim();
  Preparation prepare_step(const std::size_t* seq_lens, std::size_t count, Stream stream);
  Preparation prepare_swap_in(std::size_t slot, Stream stream);
  Preparation prepare_fork(std::size_t src);
  Preparation prepare_share_prefix(std::size_t src, std::size_t dst, std::size_t tokens);
  Preparation prepare_set_budget(std::size_t bytes);
  std::size_t num_free_slots() const;
  bool is_allocated(std::size_t slot) const;
  std::size_t mapped_pages(std::size_t slot) const;
  CacheStats stats() const;
  StepProfile last_step_profile() const;
  void check_invariants() const;

  const CacheConfig& config() const noexcept { return config_; }
  const KvLayout& layout() const noexcept { return layout_; }
  Address base() const noexcept { return base_; }
  Backend& backend() const noexcept { return *backend_; }

 private:
  using Slot = detail::Slot;
  // Most pages one background unit maps or unmaps: bounds how long step() can wait for
  // the mapper on a slot (about 0.5 ms on an H100).
  static constexpr std::size_t kPagesPerBackgroundUnit = 16;
  // Most pages one unit backs with zeros (~37 us each on an H100): about 2.4 ms.
  static constexpr std::size_t kPagesPerCoverUnit = 64;
  // Page `page` (of every region) of slot `slot`.
  struct PageRef {
    std::size_t slot, page;
  };
  // One unit of the mapper's work, planned under the lock (kv_cache_background_plan.cpp).
  struct BackgroundUnit {
    enum class Kind { none, grow, shrink, cover, create } kind = Kind::none;
    std::size_t slot = 0;
    // grow: target pages per region; shrink: pages per region to unmap; cover: back with
    // zeros up to; create: pages to create into the pool
    std::size_t pages = 0;
  };

  Address page_address(std::size_t region, std::size_t slot, std::size_t page) const noexcept {
    return base_ + layout_.page_offset(region, slot, page);
  }
  // The seq_len a swapped-out slot had: its host copy holds that many tokens per region.
  std::size_t swapped_tokens(const Slot& slot) const noexcept {
    return slot.swap.bytes / (layout_.token_bytes() * layout_.num_regions());
  }

  // ---- entry checks and waits (kv_cache.cpp) ---------------------------------------
  void expect_slot_in_range(std::size_t slot) const;
  // Every public call's first check: the cache is unusable in a forked child.
  void expect_usable_in_this_process() const;
  void rethrow_background_error();
  void wait_not_busy(std::unique_lock<std::mutex>& lock, std::size_t slot);
  // The opening of fork, share_prefix, swap_out and swap_in: check, wait until `slot` is
  // not busy and (pages > 0) that many pages can be had with it claiming `claim`, check
  // again (the waits let other threads in).
  // With a shared budget, it asks the other members for what the cache cannot find.
  void settle(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages, std::size_t claim,
              const std::function<void()>& expect_valid);
  std::size_t allocate_slot(std::unique_lock<std::mutex>& lock, std::size_t slot, Stream stream);
  void drop_all_pages(std::size_t slot, Stream stream, bool return_to_device);

  // ---- zero-fills deferred from free_reqid() and swap_out() (kv_cache_fill.cpp) ----
  // The owner leaving `slot` may have written its claimed pages: their zero-fill on
  // `stream` is due before anyone else reads or maps over them (pages reclaimed meanwhile
  // leave unfilled, after the owner's last work: fence_readers()). No backend call.
  void defer_fill(std::size_t slot, Stream stream);
  // Enqueues `slot`'s deferred zero-fill, if any, and records free_event behind it; on
  // failure it stays deferred. For an allocated slot (its new owner's first call that
  // touches its pages), `consumer`'s later work is ordered after the fill.
  void enqueue_fill(std::size_t slot, std::optional<Stream> consumer = std::nullopt);
  // enqueue_fill() for every slot: at the start of step() and prepare_step() (`consumer`:
  // their stream).
  void enqueue_deferred_fills(std::optional<Stream> consumer = std::nullopt);
  // Pages that leave the cache (to the device, the pool's next taker zero-fills them as it
  // does fresh pages) need no fill, only their last readers done. Events behind those
  // readers, one per stream: a deferred fill's stream (the leaving owner's last work, which
  // no event follows yet), and with `pending_events` a pending free_event's stream too (an
  // event recorded now follows more work than free_event: only worth it for a wait with the
  // lock released, where it replaces a wait for free_event with the lock held).
  struct ReaderFence {
    std::vector<std::pair<Stream, Event>> events;              // to wait for, then destroy
    std::vector<std::pair<std::size_t, std::uint64_t>> fills;  // deferred fills seen: slot, fill_mark
  };
  // With the lock held: records the events of `slots`' last readers (none enqueues a fill).
  // All or nothing.
  ReaderFence fence_readers(const std::vector<std::size_t>& slots, bool pending_events = false);
  // Once `fence`'s events completed (waited for, maybe with the lock released meanwhile):
  // the deferred fills it saw that are still the same deferral have their readers done (a
  // free_event of theirs is still waited for, or queried, as any other).
  void mark_readers_done(const ReaderFence& fence) noexcept;
  // Before pages of `slot` are unmapped: waits for its last readers (an event on its fill
  // stream if its fill is deferred and nobody waited yet, then its free_event).
  void wait_last_readers(std::size_t slot);

  // ---- step and mapping what is missing (kv_cache_step.cpp) ------------------------
  // What step(seq_lens) must do: the claims it leaves, the shared pages slots are about
  // to write into (copy-on-write), the pages to map, and whether the mapper is busy on
  // pages it needs (then wait and plan again). prepare_step() plans the same way.
  struct StepPlan {
    std::vector<std::size_t> claims;
    std::vector<PageRef> copies;
    std::size_t to_map = 0;   // pages, all regions
    std::size_t missing = 0;  // to_map and a page per region for every copy
    bool waits_for_mapper = false;
  };
  StepPlan plan_step(const std::size_t* seq_lens, std::size_t count, std::size_t horizon) const;
  // step() with mutex_ held (step_slots() builds its seq_lens under the same lock).
  // Returns whether the mapper has work: the caller wakes it once it released the lock,
  // so that the mapper does not wake up only to block on it (and the unlock wake it again).
  bool step_locked(std::unique_lock<std::mutex>& lock, const std::size_t* seq_lens, std::size_t count, Stream stream,
                   std::chrono::steady_clock::time_point start);
  // Wakes the mapper (without the lock) and times it for last_step_profile().
  void wake_mapper();
  void expect_valid_seq_lens(const std::size_t* seq_lens, std::size_t count) const;
  // Tokens eager allocation maps in the eager slot: config.eager_tokens, or the prompt
  // history's estimate when adaptive; never past max_context_len.
  std::size_t eager_tokens() const noexcept;
  std::size_t obtainable_pages(const std::vector<std::size_t>& claims) const;
  void wait_for_pages(std::unique_lock<std::mutex>& lock, std::size_t missing, std::size_t slot, std::size_t claim);
  // The claims after `slot` claims `claim` pages, and how many of `missing` they leave short.
  std::size_t pages_short(std::size_t missing, std::size_t slot, std::size_t claim) const;
  void expect_obtainable(std::size_t missing, const std::vector<std::size_t>& claims, const char* call) const;
  void map_missing(const std::vector<std::size_t>& claims, const std::vector<PageRef>& copies, std::size_t missing,
                   Stream stream, detail::UndoLog& undo, const char* call);
  std::vector<std::vector<Page>> take_large_pages(const std::vector<std::size_t>& claims);
  std::vector<Page> lay_out_grant(const std::vector<std::size_t>& claims, const std::vector<std::vector<Page>>& large,
                                  const std::vector<Page>& singles, std::size_t copies) const;
  // Undo log for an engine call on `stream`: undoing a mapping waits for the call's device work.
  std::function<void()> stream_waiter(Stream stream);

  // ---- a slot's mappings and reclamation (kv_cache_mappings.cpp) -----------------------
  // Real pages at pages [first, first + count) of one region, replacing zero backing; and
  // back (`handles`: the pages mapped there, mapped again if backing with zeros fails).
  // Backend calls only, all or nothing; the caller keeps the books.
  void map_real(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* handles, std::size_t count);
  // Maps `count` handles side by side at `address` (a large page as its run of equal
  // handles, with one call). All or nothing.
  void map_handles(Address address, const PageHandle* handles, std::size_t count);
  void unmap_real(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* handles,
                  std::size_t count);
  // Tries again to unmap stranded_ pages (of slots the mapper is not working on) and gives
  // back those it could; before anything maps past a slot's books. Caller holds the lock.
  void unmap_stranded() noexcept;
  // Backs pages [backed_end, until) of every region of a slot with zeros (the books too).
  void back_with_zeros(std::size_t slot, std::size_t until);
  // Backend calls only, all or nothing: pages [from, until) of every region of a slot,
  // which must be unmapped, backed with zeros. Nothing reads an unmapped range, so
  // undoing a region needs no wait.
  void back_regions_with_zeros(std::size_t slot, std::size_t from, std::size_t until);
  void zero_fresh_pages(Address address, const Page* pages, std::size_t count, Stream stream);
  // Zero-fills pages [first, first + count) of every region of a slot, just mapped from
  // `pages` (region r's at pages[r * count]): one launch when none is known clean.
  void zero_fresh_regions(std::size_t slot, std::size_t first, const Page* pages, std::size_t count, Stream stream);
  // Before an engine call changes the mappings of `slot` from page `first` on: waits for
  // the work in flight that may read them (after ReadWindows::close_current()).
  void order_after_readers(std::size_t slot, std::size_t first);
  // The first page of `slot` that a call which cannot wait for in-flight readers (trim,
  // set_budget, the mapper) may take: its claim, or the read horizon where that is higher.
  std::size_t first_reclaimable_without_waiting(std::size_t slot) const;
  std::vector<std::size_t> reclaimable_floors() const override;
  void wait_free_event(Slot& slot);
  // Work enqueued on `stream` from now on runs after free_event (no call on its own stream).
  void order_after_free_event(const Slot& slot, Stream stream);
  std::vector<Page> obtain_pages(std::size_t count, const std::vector<std::size_t>& floors);
  // Unmaps up to `wanted` pages (all regions) of the slot choose_victim(kinds) names into
  // `into`; false when no slot has a page above its floor.
  bool reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& floors,
                       detail::VictimKinds kinds = detail::VictimKinds::surplus_then_freed);
  // Unmaps pages [keep, mapped) of every region of a slot (`keep` splits no large page):
  // those mapped nowhere else go into `into`.
  void unmap_tail(std::size_t slot, std::size_t keep, std::vector<Page>& into);
  // One slot address less maps each page or large page of pages[from, to); those mapped
  // nowhere else now go into `into`.
  void drop_mappings(const std::vector<PageHandle>& pages, std::size_t from, std::size_t to, bool clean,
                     std::vector<Page>& into);
  // Gives pages[0, count) back to the pool, a large page (a run of equal handles) once.
  void give_back_pages(const Page* pages, std::size_t count);
  // Large pages are unmapped whole: the start of the one covering page `page` of a slot
  // without starting there, else `page`; and the end of that one, else `page`.
  std::size_t round_down_to_whole(const Slot& slot, std::size_t page) const noexcept;
  std::size_t round_up_to_whole(const Slot& slot, std::size_t page) const noexcept;
  // Maps back pages [keep, keep + count) of regions [0, regions) of a slot, whose unmap
  // succeeded before another region's failed; errors are dropped (the first one propagates).
  void remap_unmapped_regions(std::size_t slot, std::size_t regions, std::size_t keep, std::size_t count) noexcept;

  // ---- sharing, swapping, elastic memory, preparation ------------------------------
  void copy_on_write(const std::vector<PageRef>& copies, const std::vector<Page>& pages, std::size_t& next,
                     Stream stream, detail::UndoLog& undo);
  void share_into(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream, detail::UndoLog& undo);
  // What share_into(src, dst, tokens) does with pages (per region): src's [0, aliased)
  // mapped at dst, dst's [0, replaced) given up, `fresh` pages from the pool for src's
  // [aliased, full) and, without a kept page of dst's there, the partly filled page.
  struct ShareShape {
    std::size_t full = 0, partial_bytes = 0, aliased = 0, replaced = 0, fresh = 0;
    bool keeps_tail = false;  // dst keeps its pages [replaced, mapped), the partly filled one first
  };
  ShareShape share_shape(std::size_t src, std::size_t dst, std::size_t tokens) const;
  void free_finished_host_copies(bool wait);
  // Pages set_budget() cannot release now: what allocated slots claim, and (zero_page)
  // pages work in flight may read.
  std::size_t pages_set_budget_keeps() const;
  void shrink_to_budget();
  std::size_t obtain_share_pages(std::unique_lock<std::mutex>& lock, std::size_t src, std::size_t dst,
                                 std::size_t tokens);
  // Maps `to_map` pages a call will claim (`claims`) without claiming them, and makes
  // `to_free` more free in the pool (a copy-on-write's pages): the pages missing (0 when
  // none), or nothing when it waited for the mapper and the caller must plan again.
  std::optional<std::size_t> map_unclaimed(std::unique_lock<std::mutex>& lock, const std::vector<std::size_t>& claims,
                                           std::size_t to_map, std::size_t to_free, Stream stream, const char* call);
  void expect_valid_fork(std::size_t src) const;
  void expect_valid_share(std::size_t src, std::size_t dst, std::size_t tokens) const;

  // ---- the pages it lends its budget client (kv_cache_budget_pages.cpp) -------------
  using Victims = detail::BudgetClient::Victims;
  std::size_t cached_pages(const std::vector<std::size_t>& floors, bool freed_only) const override;
  // In chunks, each counted back to the budget as it goes: the first of
  // BudgetClient::kReleaseChunkPages, each next one twice the one before.
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>& floors, Victims victims, bool may_wait,
                      detail::BudgetClient::ReleaseTimes& times) override;
  bool wait_for_readers(std::unique_lock<std::mutex>& lock, const std::function<bool()>& relock) override;
  std::uint64_t event_wait_ns() const override { return event_wait_ns_; }
  std::size_t claimed_pages() const override;
  std::size_t next_prompt_pages() const override;
  std::size_t add_free_pages(std::size_t pages) override { return pool_.add_free(pages); }
  // Waits for each of `events`, then destroys them all (also when a wait throws).
  void wait_then_destroy(const std::vector<std::pair<Stream, Event>>& events);

  // ---- suspension (kv_cache_suspend.cpp) ---------------------------------------------
  // What suspend() kept: each page allocated slots claimed, once (a shared page once),
  // page k at host.host + k * page_bytes, and where each slot had it.
  struct Suspension {
    detail::HostCopy host;
    struct KeptSlot {
      std::size_t seq_len = 0, claimed = 0;
      std::vector<std::vector<std::size_t>> pages;  // [region][page]: k; empty for a slot with nothing kept
    };
    std::vector<KeptSlot> slots;
  };
  // The first check of a call that changes slots or pages: InvalidArgument naming `call`.
  void expect_not_suspended(const char* call) const;
  // free_reqid() while suspended: the slot's kept pages are not brought back.
  void forget_suspended_slot(std::size_t slot) noexcept;
  // check_invariants()' part: while suspended no slot maps, claims or holds tokens.
  void check_suspension() const;

  // ---- the mapper's work (kv_cache_background_plan.cpp, kv_cache_background_units.cpp) ------------
  // A unit's exit, however it leaves (done or thrown): the lock held again, its slot no
  // longer busy, waiters told. Constructed with the lock released.
  class UnitExit;
  BackgroundUnit next_background_unit(bool settle_events);
  bool background_work();
  bool background_busy() const noexcept;
  bool grow_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t target);
  bool shrink_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages);
  bool cover_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t until);
  bool create_in_background(std::unique_lock<std::mutex>& lock, std::size_t pages);

  CacheConfig config_;
  std::shared_ptr<Backend> backend_;         // the top of the adaptor stack
  StatisticsBackend* statistics_ = nullptr;  // in that stack when config.backend_statistics
  KvLayout layout_;
  detail::BudgetClient budget_;  // config.shared_budget's; before pool_, which counts against it
  PagePool pool_;
  Address base_ = 0;
  detail::SlotTable slots_;
  detail::PageSharing sharing_;
  std::vector<detail::HostCopy> host_frees_;  // host memory to free once `ready` completes
  detail::PromptHistory prompts_;             // recent prompt lengths, for adaptive eager allocation
  std::size_t watermark_pages_ = 0;
  std::size_t in_flight_pages_ = 0;  // taken by the mapper: neither in the pool nor in a slot
  std::size_t deferred_fills_ = 0;   // slots whose deferred_fill is not 0
  std::uint64_t fill_marks_ = 0;     // defer_fill() calls so far: each deferral's fill_mark
  // Pages a failed mapper unit could not unmap (its undo failed too): mapped past their
  // slot's books, out of the pool until unmap_stranded() succeeds.
  struct Stranded {
    std::size_t slot, region, first;
    std::vector<PageHandle> handles;  // a large page once per page it covers
  };
  std::vector<Stranded> stranded_;
  Stream background_stream_ = 0;
  CallStats step_stats_;
  CallStats mapped_ahead_;                      // the mapper's grow units (CacheStats::mapped_ahead)
  StepProfile step_profile_;                    // the last step()'s, filled as it goes
  std::atomic<std::uint64_t> last_wake_ns_{0};  // its wake-up of the mapper, made after the lock
  // The last free_reqid()'s and alloc_reqid()'s wall time and lock wait (last_step_profile()).
  struct CallTiming {
    std::uint64_t total_ns = 0, lock_wait_ns = 0;
  };
  CallTiming free_timing_, alloc_timing_;
  std::uint64_t event_wait_ns_ = 0;  // host waits for events so far (wait_free_event, read windows)
  detail::ReadWindows read_windows_;
  std::uint64_t fork_generation_ = 0;  // detail::fork_generation() at construction
  // What suspend() kept, until resume() succeeds (kv_cache_suspend.cpp).
  std::optional<Suspension> suspension_;
  mutable std::mutex mutex_;
  std::condition_variable background_done_;  // a slot stopped being busy
  std::unique_ptr<Mapper> mapper_;           // last: its thread uses everything above
};

}  // namespace vkv
