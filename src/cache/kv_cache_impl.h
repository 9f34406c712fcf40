// KvCache::Impl: the parts of a cache and how its calls compose them.
//
//   CacheContext  cache_context.h   what the parts share (config, backend, layout, lock,
//                                   budget client, pool, slot table, ...): built first,
//                                   each part built from it
//   SlotTable     slot_table.h      who is allocated, what each claims and maps, alloc order
//   BudgetClient  budget_client.h   the cache's half of a shared budget's protocol
//   LentPages     lent_pages.h      the pages the cache lends it (BudgetClient::CachePages)
//   PageSharing   page_sharing.h    pages mapped at several slots (fork, share_prefix)
//   PrefixSharing prefix_sharing.h  putting a slot's prefix at another slot
//   SlotMappings  slot_mappings.h   which pages back which range of a slot's addresses
//   StepPlanner   step_planner.h    what step(seq_lens) must map and copy
//   SlotGrowth    slot_growth.h     fresh pages mapped at the end of slots: step()'s and the mapper's way
//   PagePool      page_pool.h       physical pages: free, created, the budget
//   ReadWindows   read_windows.h    what device work in flight may still read
//   SlotReaders   slot_readers.h    waiting for a slot's last readers; the zero-fills owed
//   choose_victim reclaim_policy.h  which pages go back first
//   PageSource    page_source.h     where a call's pages come from: the pool, then reclamation
//   Mapper        mapper.h          the background thread
//   BackgroundPlanner background_planner.h  what the mapper does next
//   CallProfile   call_profile.h    what the calls cost (stats' counters, last_step_profile())
//   HostFrees     host_frees.h      host memory freed once its copy completed
//   AccessChecks  access_checks.h   what an address is and why it may not be touched (checked mode)
//   Suspension    suspension.h      suspend() and resume(): the whole cache to host memory and back
//   Backend       backend.h         the device (behind the statistics adaptor if asked)
//
// Each public call checks its arguments, waits for the mapper where it must, and then
// changes the parts under one mutex; a call that fails undoes what it did (undo_log.h),
// in stream order. The methods live in the files named after what they do:
// kv_cache.cpp (construction, alloc, free, the public forwarders), kv_cache_step.cpp,
// kv_cache_background_units.cpp (the mapper's work),
// kv_cache_sharing.cpp, kv_cache_swap.cpp, kv_cache_elastic.cpp, kv_cache_prepare.cpp,
// kv_cache_slot_calls.cpp, kv_cache_inspect.cpp (stats, invariants).
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

#include "access_checks.h"
#include "background_planner.h"
#include "cache_context.h"
#include "call_profile.h"
#include "host_frees.h"
#include "lent_pages.h"
#include "mapper.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "page_source.h"
#include "prefix_sharing.h"
#include "prompt_history.h"
#include "read_windows.h"
#include "reclaim_policy.h"
#include "shared_budget/budget_client.h"
#include "shared_budget/shortage_loop.h"
#include "slot_growth.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "step_planner.h"
#include "suspension.h"
#include "vkv/kv_cache.h"
#include "vkv/statistics_backend.h"

namespace vkv {
namespace detail {
class UndoLog;
}

class KvCache::Impl final {
 public:
  Impl(const CacheConfig& config, std::shared_ptr<Backend> backend);
  ~Impl();

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
  std::string explain(Address address) const;
  /// After a call that changed slots: their state for the checked-mode fault handler.
  void publish_access_state() {
    if (cache_.config.checked) copy_access_state();
  }

  const CacheConfig& config() const noexcept { return cache_.config; }
  const KvLayout& layout() const noexcept { return cache_.layout; }
  Address base() const noexcept { return base_; }
  Backend& backend() const noexcept { return cache_.backend(); }

 private:
  using Slot = detail::Slot;
  using PageRef = detail::PageRef;

  void rethrow_background_error();
  void copy_access_state();  // publish_access_state()'s work, under the lock
  void wait_not_busy(std::unique_lock<std::mutex>& lock, std::size_t slot);
  // The opening of fork, share_prefix, swap_out and swap_in: check, wait until `slot` is
  // not busy and (pages > 0) that many pages can be had with it claiming `claim`, check
  // again (the waits let other threads in).
  // With a shared budget, it asks the other members for what the cache cannot find.
  void settle(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages, std::size_t claim,
              const std::function<void()>& expect_valid);
  std::size_t allocate_slot(std::unique_lock<std::mutex>& lock, std::size_t slot, Stream stream);
  void drop_all_pages(std::size_t slot, Stream stream, bool return_to_device);

  // ---- step and mapping what is missing (kv_cache_step.cpp) ------------------------
  // step() with the cache's mutex held (step_slots() builds its seq_lens under the same lock).
  // Returns whether the mapper has work: the caller wakes it once it released the lock,
  // so that the mapper does not wake up only to block on it (and the unlock wake it again).
  bool step_locked(std::unique_lock<std::mutex>& lock, const std::size_t* seq_lens, std::size_t count, Stream stream,
                   std::chrono::steady_clock::time_point start);
  void wait_for_pages(std::unique_lock<std::mutex>& lock, std::size_t missing, std::size_t slot, std::size_t claim);
  // Pages the mapper is moving are not lost: a shortage is decided once it has put them
  // down. Waits until it has; whether it had any (the caller plans again). A shortage
  // loop's own room (shared_budget/shortage_loop.h).
  bool wait_for_mapper(std::unique_lock<std::mutex>& lock);

  // ---- sharing, swapping, elastic memory, preparation ------------------------------
  std::size_t obtain_share_pages(std::unique_lock<std::mutex>& lock, std::size_t src, std::size_t dst,
                                 std::size_t tokens);
  // Maps `to_map` pages a call will claim (`claims`) without claiming them, and makes
  // `to_free` more free in the pool (a copy-on-write's pages): std::nullopt, or the pages
  // missing (a preparation's attempt in a ShortageLoop). @throws OutOfMemory where the
  // pages that seemed obtainable were not.
  detail::ShortageLoop::Shortfall map_unclaimed(const std::vector<std::size_t>& claims, std::size_t to_map,
                                                std::size_t to_free, Stream stream, const char* call);

  // ---- the mapper's work, planned by planner_ (kv_cache_background_units.cpp) ---------
  bool background_work();
  bool shrink_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages);
  bool cover_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t until);
  bool create_in_background(std::unique_lock<std::mutex>& lock, std::size_t pages);

  detail::CacheContext cache_;         // what the parts share; each part below is built from it
  detail::SlotMappings mappings_;      // which pages back which range of a slot
  detail::SlotReaders readers_;        // who may still read a slot's pages; the zero-fills owed
  detail::BackgroundPlanner planner_;  // what the mapper does next
  detail::PageSource source_;          // where a call's pages come from: the pool, then reclamation
  detail::StepPlanner step_planner_;   // what step(seq_lens) must map and copy
  detail::PrefixSharing prefixes_;     // a slot's prefix at another slot (fork, share_prefix)
  detail::SlotGrowth growth_;          // fresh pages mapped at the end of slots (step() and the mapper)
  detail::LentPages lent_;             // what the budget client may take back
  detail::Suspension suspension_;      // suspend() and resume(), and what suspend() kept meanwhile
  detail::AccessChecks checks_;        // registered from the reservation's start until the destructor's
  Address base_ = 0;
  std::size_t watermark_pages_ = 0;
  Stream background_stream_ = 0;
  std::uint64_t fork_generation_ = 0;  // detail::fork_generation() at construction
  // Started once every part is built, and stopped in the destructor's body (or, when the
  // constructor fails after it, at once) before any part goes: its thread uses them all.
  std::unique_ptr<Mapper> mapper_;
};

}  // namespace vkv
