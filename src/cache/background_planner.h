// What the background mapper does next, one unit at a time, most urgent first: map ahead
// what allocated slots will need (lookahead, expected lengths, the next prefill's pages),
// unmap freed slots' pages below the watermark, create free pages for step() to swap in,
// and back slots not yet handed out with zeros. Policy only: the plan is made under the
// cache's lock and carried out by the cache (kv_cache_background_units.cpp), its slow
// backend calls without the lock.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>

#include "cache_context.h"
#include "page_pool.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

/// One unit of the mapper's work.
struct BackgroundUnit {
  enum class Kind { none, grow, shrink, cover, create } kind = Kind::none;
  std::size_t slot = 0;
  // grow: target pages per region; shrink: pages per region to unmap; cover: back with
  // zeros up to; create: pages to create into the pool
  std::size_t pages = 0;
};

/// A unit's exit, however it leaves (done or thrown): the lock held again, its slot no
/// longer busy, waiters told. Constructed with the lock released.
class UnitExit {
 public:
  /// `slot`: slots.size() for a unit that works on no slot.
  UnitExit(SlotTable& slots, std::condition_variable& done, std::unique_lock<std::mutex>& lock, std::size_t slot)
      : slots_(slots), done_(done), lock_(lock), slot_(slot) {}
  ~UnitExit() {
    if (!lock_.owns_lock()) lock_.lock();
    if (slot_ < slots_.size()) slots_.mark_not_busy(slot_);
    done_.notify_all();
  }
  UnitExit(const UnitExit&) = delete;
  UnitExit& operator=(const UnitExit&) = delete;

 private:
  SlotTable& slots_;
  std::condition_variable& done_;
  std::unique_lock<std::mutex>& lock_;
  std::size_t slot_;
};

class BackgroundPlanner {
 public:
  /// Most pages one unit maps or unmaps: bounds how long step() can wait for the mapper
  /// on a slot (about 0.5 ms on an H100).
  static constexpr std::size_t kPagesPerUnit = 16;
  /// Most pages one unit backs with zeros (~37 us each on an H100): about 2.4 ms.
  static constexpr std::size_t kPagesPerCoverUnit = 64;

  /// Everything given must outlive it; `cache.config` is read as it is at each call.
  BackgroundPlanner(CacheContext& cache, const SlotMappings& mappings, const SlotReaders& readers)
      : backend_(cache.backend()),
        layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        pool_(cache.pool),
        mappings_(mappings),
        readers_(readers) {}

  /// The next unit of background work, most urgent first. With `settle_events`, a freed
  /// slot's completed event is retired (so its pages may go); without, the plan is a
  /// cheap, side-effect-free guess that step() uses to decide whether to wake the mapper
  /// at all: it counts on events being done (the mapper finds out). A slot whose zero-fill
  /// is still deferred is not touched: no event follows its last owner's work yet.
  /// `eager_tokens`: what eager allocation maps in the slot handed out next;
  /// `watermark_pages`: below that many obtainable pages, freed slots' pages are unmapped.
  BackgroundUnit next(bool settle_events, std::size_t eager_tokens, std::size_t watermark_pages);

 private:
  Backend& backend_;
  const KvLayout& layout_;
  const CacheConfig& config_;
  SlotTable& slots_;
  const PagePool& pool_;
  const SlotMappings& mappings_;
  const SlotReaders& readers_;
};

}  // namespace vkv::detail
