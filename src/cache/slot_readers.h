// Who may still read a slot's pages, and waiting for them before a mapping changes (the
// driver's unmap does not wait for kernels still reading):
//   - the zero-fill an owner leaving a slot is owed (free_reqid(), swap_out()), deferred
//     to the next call that needs it, and the leaving owner's last work behind it;
//   - free_event, behind a slot's last zero-fill;
//   - with zero backing, the padded reads of the steps in flight (read_windows.h).
// Pages that leave the cache need no fill, only their last readers done: a fence records
// one event per stream behind them (fence()), waited for maybe with the lock released.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cache_context.h"
#include "call_profile.h"
#include "read_windows.h"
#include "slot_mappings.h"
#include "slot_table.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

class SlotReaders {
 public:
  /// Everything given must outlive it; `cache.config.zero_page` is read as it is then.
  SlotReaders(CacheContext& cache, const SlotMappings& mappings)
      : backend_(cache.backend()),
        layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        mappings_(mappings),
        windows_(cache.read_windows),
        profile_(cache.profile) {}
  SlotReaders(const SlotReaders&) = delete;
  SlotReaders& operator=(const SlotReaders&) = delete;

  // ---- zero-fills deferred from free_reqid() and swap_out() --------------------------
  /// The owner leaving `slot` may have written its claimed pages: their zero-fill on
  /// `stream` is due before anyone else reads or maps over them (pages reclaimed meanwhile
  /// leave unfilled, after the owner's last work: fence()). No backend call.
  void defer_fill(std::size_t slot, Stream stream);
  /// Enqueues `slot`'s deferred zero-fill, if any, and records free_event behind it; on
  /// failure it stays deferred. For an allocated slot (its new owner's first call that
  /// touches its pages), `consumer`'s later work is ordered after the fill.
  void enqueue_fill(std::size_t slot, std::optional<Stream> consumer = std::nullopt);
  /// enqueue_fill() for every slot: at the start of step() and prepare_step() (`consumer`:
  /// their stream).
  void enqueue_deferred_fills(std::optional<Stream> consumer = std::nullopt);
  /// Slots whose zero-fill is deferred.
  std::size_t deferred_fills() const noexcept { return deferred_fills_; }
  /// Pages from `keep` on of `slot` left it unfilled: its deferred fill shrinks to what stays.
  void shrink_fill(std::size_t slot, std::size_t keep) noexcept;

  // ---- the last readers of pages that leave ------------------------------------------
  /// Events behind the last readers of some slots' pages, one per stream: a deferred
  /// fill's stream (the leaving owner's last work, which no event follows yet), and with
  /// `pending_events` a pending free_event's stream too (an event recorded now follows
  /// more work than free_event: only worth it for a wait with the lock released, where it
  /// replaces a wait for free_event with the lock held).
  struct Fence {
    std::vector<std::pair<Stream, Event>> events;              // to wait for, then destroy
    std::vector<std::pair<std::size_t, std::uint64_t>> fills;  // deferred fills seen: slot, fill_mark
  };
  /// Records the events of `slots`' last readers (none enqueues a fill). All or nothing.
  Fence fence(const std::vector<std::size_t>& slots, bool pending_events = false);
  /// Once `fence`'s events completed (waited for, maybe with the lock released meanwhile):
  /// the deferred fills it saw that are still the same deferral have their readers done (a
  /// free_event of theirs is still waited for, or queried, as any other).
  void mark_done(const Fence& fence) noexcept;
  /// Waits for each of `events`, then destroys them all (also when a wait throws).
  void wait_then_destroy(const std::vector<std::pair<Stream, Event>>& events);
  /// fence(slots), wait_then_destroy() and mark_done(), with the lock held; `timed`: the
  /// wait counts as the host's event wait (CallProfile).
  void wait_for(const std::vector<std::size_t>& slots, bool timed = false);

  // ---- before a mapping changes -------------------------------------------------------
  /// Before pages of `slot` are unmapped: waits for its last readers (an event on its fill
  /// stream if its fill is deferred and nobody waited yet, then its free_event).
  void wait_last_readers(std::size_t slot);
  /// Waits for the free_event of `slot` and forgets it (its fill is not deferred, or its
  /// readers are done).
  void wait_free_event(std::size_t slot);
  /// Work enqueued on `stream` from now on runs after free_event (no call on its own stream).
  void order_after_free_event(const Slot& slot, Stream stream);
  /// Before an engine call changes the mappings of `slot` from page `first` on: waits for
  /// the work in flight that may read them (after ReadWindows::close_current()).
  void order_after_readers(std::size_t slot, std::size_t first);
  /// The first page of `slot` that a call which cannot wait for in-flight readers (trim,
  /// set_budget, the mapper) may take: its claim, or the read horizon where that is higher.
  std::size_t first_reclaimable_without_waiting(std::size_t slot) const;
  /// first_reclaimable_without_waiting() of every slot.
  std::vector<std::size_t> reclaimable_floors() const;

 private:
  Backend& backend_;
  const KvLayout& layout_;
  const CacheConfig& config_;
  SlotTable& slots_;
  const SlotMappings& mappings_;
  ReadWindows& windows_;
  CallProfile& profile_;
  std::size_t deferred_fills_ = 0;  // slots whose deferred_fill is not 0
  std::uint64_t fill_marks_ = 0;    // defer_fill() calls so far: each deferral's fill_mark
};

}  // namespace vkv::detail
