// KvCache: the zero-fill of the pages an owner leaves behind (free_reqid, swap_out),
// deferred to the next call that needs it.
//
// free_reqid() and swap_out() make no driver call for it: on a GPU a launch and an event
// cost 6-8 us on their own and several times that while the mapper thread makes driver
// calls. The fill is enqueued on the stream the leaving call named, behind the owner's
// last work, by the first of: the next step() or prepare_step() (every deferred fill),
// share_prefix() or fork() into the slot, and swap_in() of it. Reclamation does not:
// pages that leave the slot are not filled (to the device nothing needs zeros, and the
// pool's next taker zero-fills them as it does fresh pages); the fill shrinks to the pages
// the slot keeps, and the unmap waits for an event recorded on the fill's stream instead,
// behind the leaving owner's last work (fence_readers()). alloc_reqid() does not: the new owner
// touches its pages only from its first step() on (the contract every owner keeps), so
// that step() enqueues the fill and orders its own stream after it; alloc_reqid() stays a
// call with no device work at all. Until then the slot's pages hold the old tokens: the
// mapper leaves such a slot alone, and wait_free_event() asserts that nothing waits for
// its readers (no event follows them yet). Then free_event follows the fill, as it did
// when free_reqid() enqueued it itself.
#include <algorithm>
#include <chrono>

#include "kv_cache_impl.h"
#include "util/clock.h"
#include "util/internal_assert.h"

namespace vkv {

void KvCache::Impl::defer_fill(std::size_t slot_index, Stream stream) {
  Slot& slot = slots_[slot_index];
  if (slot.claimed == 0) return;  // beyond its claim a slot's pages hold zeros already
  VKV_ASSERT(slot.deferred_fill == 0);
  slot.deferred_fill = slot.claimed;
  slot.fill_stream = stream;
  slot.fill_readers_done = false;
  slot.fill_mark = ++fill_marks_;
  ++deferred_fills_;
}

void KvCache::Impl::enqueue_fill(std::size_t slot_index, std::optional<Stream> consumer) {
  Slot& slot = slots_[slot_index];
  if (slot.deferred_fill == 0) return;
  const Stream stream = slot.fill_stream;
  // After an earlier fill of these pages, which may run on another stream.
  order_after_free_event(slot, stream);
  // One launch for every region (CUDA: one kernel; a memset each costs ~3 us to enqueue).
  backend_->zero_strided(page_address(0, slot_index, 0), slot.deferred_fill * layout_.page_bytes(),
                         layout_.num_regions(), layout_.region_bytes(), stream);
  // A failure from here on leaves the fill deferred: enqueued again, it writes zeros twice.
  const Event event = backend_->record_event(stream);
  if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
  slot.free_event = event;
  slot.free_event_stream = stream;
  // A new owner's work on another stream must not overtake it (on the same stream it
  // cannot). Until that holds the fill stays deferred: enqueued again, it writes zeros twice.
  if (slot.allocated && consumer && *consumer != stream) backend_->stream_wait_event(*consumer, event);
  slot.deferred_fill = 0;
  slot.fill_readers_done = false;
  --deferred_fills_;
}

void KvCache::Impl::enqueue_deferred_fills(std::optional<Stream> consumer) {
  for (std::size_t s = 0; s < slots_.size() && deferred_fills_ > 0; ++s) enqueue_fill(s, consumer);
}

KvCache::Impl::ReaderFence KvCache::Impl::fence_readers(const std::vector<std::size_t>& slots, bool pending_events) {
  ReaderFence fence;
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
    if (pending_events && slot.free_event != 0 && !backend_->event_done(slot.free_event))
      behind(slot.free_event_stream);
  }
  try {
    for (const Stream stream : streams) fence.events.emplace_back(stream, backend_->record_event(stream));
  } catch (...) {
    for (const auto& entry : fence.events) backend_->destroy_event(entry.second);
    throw;
  }
  return fence;
}

void KvCache::Impl::mark_readers_done(const ReaderFence& fence) noexcept {
  for (const auto& [s, mark] : fence.fills) {
    Slot& slot = slots_[s];
    // Another deferral since (freed again, or filled and freed again): not what was waited for.
    if (slot.deferred_fill == 0 || slot.fill_mark != mark) continue;
    slot.fill_readers_done = true;
  }
}

void KvCache::Impl::wait_last_readers(std::size_t slot_index) {
  Slot& slot = slots_[slot_index];
  if (slot.deferred_fill != 0 && !slot.fill_readers_done) {
    const ReaderFence fence = fence_readers({slot_index});
    const auto start = std::chrono::steady_clock::now();
    wait_then_destroy(fence.events);
    event_wait_ns_ += detail::nanoseconds_since(start);
    mark_readers_done(fence);
  }
  wait_free_event(slot);
}

}  // namespace vkv
