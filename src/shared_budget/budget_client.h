// BudgetClient: a cache's half of a shared budget's protocol (vkv/shared_budget.h), in one
// object. The books and the watcher thread are BudgetMembership's (budget_membership.h);
// what the cache does when it runs short and when another member asks is decided here:
//
//   running short     ask(): the lock released while the others answer, what they gave
//                     made free pages of the cache's pool
//   being asked       the watcher's give_back(): free pages and freed requests' pages
//                     first, then allocated requests' surplus, waiting for their last
//                     readers with the lock released; meanwhile a call holding the lock
//                     gives what it can (serve_give_back())
//   idle              once no step() came for shared_budget_idle_ms, freed requests'
//                     pages go back, once per idle spell
//   under pressure    another member asked within shared_budget_pressure_ms: freed
//                     requests' pages above twice the next prompt go back, chunk by chunk
//
// The cache lends it its pages through CachePages, a narrow interface the cache
// implements: the client never sees a slot. Without a shared budget every call does
// nothing.
//
// Internal. Thread-safety: the cache's calls hold the cache's mutex (the one given at
// construction), as do CachePages' calls; the watcher's callbacks take that mutex
// themselves. ask() releases and takes it again.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "budget_membership.h"
#include "util/clock.h"
#include "vkv/config.h"
#include "vkv/stats.h"

namespace vkv::detail {

class BudgetClient {
 public:
  /// Whose pages give-backs take after the free ones.
  enum class Victims { freed_only, freed_then_surplus };
  /// Where releases' time went: unmapping (victims' choice included), the backend's
  /// releases, counting them back to the budget.
  struct ReleaseTimes {
    std::uint64_t unmap_ns = 0, release_ns = 0, count_ns = 0;
  };

  /// What the client asks of the cache it serves; each call is made with the cache's mutex held.
  class CachePages {
   public:
    virtual ~CachePages() = default;
    /// Per slot, the first page a give-back may take without waiting for work in flight.
    virtual std::vector<std::size_t> reclaimable_floors() const = 0;
    /// Free pages, and mapped pages above `floors` of slots the mapper is not working on
    /// (`freed_only`: of freed slots only); no allocated slot claims them.
    virtual std::size_t cached_pages(const std::vector<std::size_t>& floors, bool freed_only) const = 0;
    /// Releases up to `wanted` pages to the device: free pages first, then pages above
    /// `floors` of `victims` whose last readers are done, then (`may_wait`) the others,
    /// waiting for their readers. Counted back to the budget in chunks as it goes; adds
    /// where the time went to `times`. Returns how many.
    virtual std::size_t release(std::size_t wanted, const std::vector<std::size_t>& floors, Victims victims,
                                bool may_wait, ReleaseTimes& times) = 0;
    /// Waits for the last readers of the pages above reclaimable_floors() with `lock`
    /// released, when any is still running; `relock` takes the lock again and says
    /// whether to go on. Returns false when `relock` said no (the readers then count as
    /// not done). @throws what waiting for an event throws (the lock not held).
    virtual bool wait_for_readers(std::unique_lock<std::mutex>& lock, const std::function<bool()>& relock) = 0;
    /// Nanoseconds the cache's calls waited for events so far.
    virtual std::uint64_t event_wait_ns() const = 0;
    /// Pages allocated slots claim, a page mapped at several slots once.
    virtual std::size_t claimed_pages() const = 0;
    /// Pages the next prompt maps (eager allocation's estimate).
    virtual std::size_t next_prompt_pages() const = 0;
    /// Creates up to `pages` free pages from what the others gave; returns how many.
    /// @throws OutOfMemory where the device has no memory for them.
    virtual std::size_t add_free_pages(std::size_t pages) = 0;
  };

  /// Joins config.shared_budget (none: every call does nothing). `mutex` must outlive
  /// the client. @throws as BudgetMembership's constructor.
  BudgetClient(const CacheConfig& config, const Backend& backend, std::size_t page_bytes, std::mutex& mutex);
  ~BudgetClient();
  BudgetClient(const BudgetClient&) = delete;
  BudgetClient& operator=(const BudgetClient&) = delete;

  bool joined() const noexcept { return membership_ != nullptr; }
  /// What the cache's pool creates pages against; null without a budget.
  PageAccount* account() noexcept { return membership_.get(); }
  /// The cache's pages, which the client asks of (it must outlive the client): once the
  /// cache can answer, before any call but joined() and account(). Apart from the
  /// constructor, so that the pool the cache lends can count against account().
  void lend(CachePages& cache) noexcept { cache_ = &cache; }
  /// Starts answering the others (the watcher); once, when the cache can answer.
  void start();
  /// Stops answering: the watcher calls into the cache. Before the cache goes.
  void stop() noexcept;
  /// In a forked child: the membership's row and watcher are the parent's; forgets them.
  void abandon() noexcept;

  // ---- running short (the cache's mutex held) ----------------------------------------
  /// Counts out members whose process is gone, so that their bytes are free at once.
  /// True when it found any (plan again).
  bool reap_dead() noexcept;
  /// Whether asking could bring anything: the others cache pages their requests do not claim.
  bool may_ask() const noexcept { return membership_ && membership_->others_may_give(); }
  /// Asks the others for `pages` (and `headroom` more, not waited for) with `lock`
  /// released, and makes what they gave free pages of the cache's pool. The caller plans
  /// again (the wait let other threads in). @throws Error (a broken budget).
  void ask(std::unique_lock<std::mutex>& lock, std::size_t pages, std::size_t headroom = 0);
  /// Pages step() asks for beyond a shortage of `missing`: the next prompt's, at most
  /// `missing`, and only where the others cache plenty.
  std::size_t ask_headroom(std::size_t missing) const;
  /// "; " and why the budget gives no more now, for an OutOfMemory's message ("" without).
  std::string room_text() const;

  // ---- the cache's calls tell it (the cache's mutex held) ----------------------------
  /// Tells the budget what allocated slots claim now (after calls that change claims).
  void publish_in_use() noexcept;
  /// A step() ended at `end`: an idle spell starts again from it.
  void step_ended(Clock::time_point end) noexcept;
  /// A request was freed: the idle spell's release gives its pages back too.
  void request_freed() noexcept { idle_released_ = false; }
  /// A step() waits for the lock (without it): an idle give-back stops for it.
  void step_waits() noexcept { steps_waiting_.fetch_add(1); }
  void step_waited() noexcept { steps_waiting_.fetch_sub(1); }
  /// In a call that maps many pages: gives back what a watcher waiting for the lock wants,
  /// from free pages and freed slots above `floors` (the call's claims), so that the asker
  /// does not wait for the whole call. What it cannot give stays posted for the watcher.
  void serve_give_back(const std::vector<std::size_t>& floors);

  // ---- what it did ---------------------------------------------------------------------
  const CallStats& asks() const noexcept { return asks_; }
  const CacheStats::BudgetHandoff& handoff() const noexcept { return handoff_; }
  /// Whether the budget counts exactly the `created_pages` the pool created (invariants).
  bool counts_exactly(std::size_t created_pages) const;

  /// Pages each give-back releases first (~1 ms of driver calls on an H100); each next
  /// chunk is twice the one before.
  static constexpr std::size_t kReleaseChunkPages = 32;

 private:
  // The watcher's: what the cache could give back now, in bytes (while a call holds the
  // lock: the figure last published, without waiting).
  std::size_t cached_bytes();
  // The watcher's: releases up to `bytes` to the device (free pages, freed slots' pages,
  // then allocated slots' surplus). When a call holds the lock, posts the bytes in
  // give_back_wanted_ for serve_give_back() first, and waits for the lock.
  void give_back(std::size_t bytes);
  // The watcher's, every shared_budget_idle_ms / 4 without a request.
  void release_when_idle();
  // The watcher's, under pressure: releases one chunk above trim_headroom(); returns
  // whether more is left.
  bool trim_under_pressure();
  // Pages a member under pressure keeps free or in freed slots: twice its next prompt's.
  std::size_t trim_headroom() const { return 2 * cache_->next_prompt_pages(); }
  // The cache's release(), timed into release_times_.
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>& floors, Victims victims, bool may_wait) {
    return cache_->release(wanted, floors, victims, may_wait, release_times_);
  }

  std::unique_ptr<BudgetMembership> membership_;
  CachePages* cache_ = nullptr;  // lend()'s
  std::mutex& mutex_;
  std::size_t page_bytes_;
  std::chrono::milliseconds idle_period_;
  std::chrono::milliseconds pressure_period_;
  std::uint64_t fork_generation_;
  // Guarded by the cache's mutex:
  CallStats asks_;
  CacheStats::BudgetHandoff handoff_;
  ReleaseTimes release_times_;
  Clock::time_point last_step_at_ = Clock::now();
  bool idle_released_ = false;  // release_when_idle() ran since the last step()
  // Without it:
  std::atomic<int> steps_waiting_{0};             // step() calls waiting for the lock
  std::atomic<std::size_t> give_back_wanted_{0};  // bytes a watcher waiting for the lock wants given back
};

}  // namespace vkv::detail
