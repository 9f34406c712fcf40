// SlotReaders: the zero-fill of the pages an owner leaves behind (free_reqid, swap_out),
// deferred to the next call that needs it; and waiting for a slot's last readers.
//
// free_reqid() and swap_out() make no driver call for it: on a GPU a launch and an event
// cost 6-8 us on their own and several times that while the mapper thread makes driver
// calls. The fill is enqueued on the stream the leaving call named, behind the owner's
// last work, by the first of: the next step() or prepare_step() (every deferred fill),
// share_prefix() or fork() into the slot, and swap_in() of it. Reclamation does not:
// pages that leave the slot are not filled (to the device nothing needs zeros, and the
// pool's next taker zero-fills them as it does fresh pages); the fill shrinks to the pages
// the slot keeps, and the unmap waits for an event recorded on the fill's stream instead,
// behind the leaving owner's last work (fence()). alloc_reqid() does not: the new owner
// touches its pages only from its first step() on (the contract every owner keeps), so
// that step() enqueues the fill and orders its own stream after it; alloc_reqid() stays a
// call with no device work at all. Until then the slot's pages hold the old tokens: the
// mapper leaves such a slot alone, and wait_free_event() asserts that nothing waits for
// its readers (no event follows them yet). Then free_event follows the fill, as it did
// when free_reqid() enqueued it itself.
#include <algorithm>
#include <chrono>

#include "slot_readers.h"

#include "util/clock.h"
#include "util/internal_assert.h"

namespace vkv::detail {

void SlotReaders::defer_fill(std::size_t slot_index, Stream stream) {
  const Slot& slot = slots_[slot_index];
  if (slot.claimed == 0) return;  // beyond its claim a slot's pages hold zeros already
  VKV_ASSERT(slot.deferred_fill == 0);
  slots_.defer_fill(slot_index, stream, ++fill_marks_);
  ++deferred_fills_;
}

void SlotReaders::enqueue_fill(std::size_t slot_index, std::optional<Stream> consumer) {
  const Slot& slot = slots_[slot_index];
  if (slot.deferred_fill == 0) return;
  const Stream stream = slot.fill_stream;
  // After an earlier fill of these pages, which may run on another stream.
  order_after_free_event(slot, stream);
  // One launch for every region (CUDA: one kernel; a memset each costs ~3 us to enqueue).
  backend_.zero_strided(mappings_.address(0, slot_index, 0), slot.deferred_fill * layout_.page_bytes(),
                        layout_.num_regions(), layout_.region_bytes(), stream);
  // A failure from here on leaves the fill deferred: enqueued again, it writes zeros twice.
  const Event event = backend_.record_event(stream);
  if (slot.free_event != 0) backend_.destroy_event(slot.free_event);
  slots_.set_free_event(slot_index, event, stream);
  // A new owner's work on another stream must not overtake it (on the same stream it
  // cannot). Until that holds the fill stays deferred: enqueued again, it writes zeros twice.
  if (slot.allocated && consumer && *consumer != stream) backend_.stream_wait_event(*consumer, event);
  slots_.shrink_fill(slot_index, 0);
  --deferred_fills_;
}

void SlotReaders::enqueue_deferred_fills(std::optional<Stream> consumer) {
  for (std::size_t s = 0; s < slots_.size() && deferred_fills_ > 0; ++s) enqueue_fill(s, consumer);
}

SlotReaders::Fence SlotReaders::fence(const std::vector<std::size_t>& slots, bool pending_events) {
  Fence fence;
  std::vector<Stream> streams;
  auto behind = [&](Stream stream) {
    if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
  };
  for (const std::size_t s : slots) {
    const Slot& slot = slots_[s];
    const bool fill_pending = slot.deferred_fill != 0 && !slot.fill_readers_done;
    if (fill_pending) {
      behind(slot.fill_stream);
      fence.fills.emplace_back(s, slot.fill_mark);
    }
    if (pending_events && slot.free_event != 0 && !backend_.event_done(slot.free_event)) behind(slot.free_event_stream);
  }
  try {
    for (const Stream stream : streams) fence.events.emplace_back(stream, backend_.record_event(stream));
  } catch (...) {
    for (const auto& entry : fence.events) backend_.destroy_event(entry.second);
    throw;
  }
  return fence;
}

void SlotReaders::mark_done(const Fence& fence) noexcept {
  for (const auto& [s, mark] : fence.fills) {
    const Slot& slot = slots_[s];
    // Another deferral since (freed again, or filled and freed again): not what was waited for.
    if (slot.deferred_fill == 0 || slot.fill_mark != mark) continue;
    slots_.mark_fill_readers_done(s);
  }
}

void SlotReaders::wait_last_readers(std::size_t slot_index) {
  const Slot& slot = slots_[slot_index];
  if (slot.deferred_fill != 0 && !slot.fill_readers_done) {
    wait_for({slot_index}, /*timed=*/true);
  }
  wait_free_event(slot_index);
}

void SlotReaders::shrink_fill(std::size_t slot_index, std::size_t keep) noexcept {
  if (slots_[slot_index].deferred_fill <= keep) return;
  slots_.shrink_fill(slot_index, keep);  // what stays is still filled before anyone reads it
  if (keep == 0) --deferred_fills_;
}

void SlotReaders::wait_then_destroy(const std::vector<std::pair<Stream, Event>>& events) {
  try {
    for (const auto& [stream, event] : events) backend_.wait_event(event);
  } catch (...) {
    for (const auto& [stream, event] : events) backend_.destroy_event(event);
    throw;
  }
  for (const auto& [stream, event] : events) backend_.destroy_event(event);
}

void SlotReaders::wait_for(const std::vector<std::size_t>& slots, bool timed) {
  const Fence behind = fence(slots);
  const Clock::time_point start = Clock::now();
  wait_then_destroy(behind.events);
  if (timed) profile_.add_event_wait(start);
  mark_done(behind);
}

void SlotReaders::order_after_readers(std::size_t slot_index, std::size_t first) {
  if (!config_.zero_page) return;  // without zero backing nothing reads beyond a slot's tokens
  const Slot& slot = slots_[slot_index];
  if (first >= std::max(slot.mapped(), slot.backed_end)) return;  // unmapped from there on: unreadable
  wait_last_readers(slot_index);                                  // the previous owner's padded reads
  if (slot.allocated && first < windows_.horizon(slot.allocated_at, /*include_current=*/false)) {
    const Clock::time_point start = Clock::now();
    windows_.wait();
    profile_.add_event_wait(start);
  }
}

std::vector<std::size_t> SlotReaders::reclaimable_floors() const {
  std::vector<std::size_t> floors(slots_.size());
  for (std::size_t s = 0; s < slots_.size(); ++s) floors[s] = first_reclaimable_without_waiting(s);
  return floors;
}

std::size_t SlotReaders::first_reclaimable_without_waiting(std::size_t slot_index) const {
  const Slot& slot = slots_[slot_index];
  if (!config_.zero_page || !slot.allocated) return slot.claimed;
  return std::max(slot.claimed, windows_.horizon(slot.allocated_at, /*include_current=*/true));
}

void SlotReaders::order_after_free_event(const Slot& slot, Stream stream) {
  if (slot.free_event != 0 && slot.free_event_stream != stream) backend_.stream_wait_event(stream, slot.free_event);
}

void SlotReaders::wait_free_event(std::size_t slot_index) {
  const Slot& slot = slots_[slot_index];
  VKV_ASSERT(slot.deferred_fill == 0 || slot.fill_readers_done);  // else no event follows the last owner's work yet
  if (slot.free_event == 0) return;
  const Clock::time_point start = Clock::now();
  backend_.wait_event(slot.free_event);
  profile_.add_event_wait(start);
  backend_.destroy_event(slot.free_event);
  slots_.clear_free_event(slot_index);
}

}  // namespace vkv::detail
