// KvCache: the zero-fill of the pages an owner leaves behind (free_reqid, swap_out),
// deferred to the next call that needs it.
//
// free_reqid() and swap_out() make no driver call for it: on a GPU a launch and an event
// cost 6-8 us on their own and several times that while the mapper thread makes driver
// calls. The fill is enqueued on the stream the leaving call named, behind the owner's
// last work, by the first of: the next step() or prepare_step() (every deferred fill),
// share_prefix() or fork() into the slot, swap_in() of it, and reclamation
// (reclaim_coldest(), whoever calls it; trim()). alloc_reqid() does not: the new owner
// touches its pages only from its first step() on (the contract every owner keeps), so
// that step() enqueues the fill and orders its own stream after it; alloc_reqid() stays a
// call with no device work at all. Until then the slot's pages hold the old tokens: the
// mapper leaves such a slot alone, and wait_free_event() asserts that nothing waits for
// its readers (no event follows them yet). Then free_event follows the fill, as it did
// when free_reqid() enqueued it itself.
#include "kv_cache_impl.h"
#include "util/internal_assert.h"

namespace vkv {

void KvCache::Impl::defer_fill(std::size_t slot_index, Stream stream) {
  Slot& slot = slots_[slot_index];
  if (slot.claimed == 0) return;  // beyond its claim a slot's pages hold zeros already
  VKV_ASSERT(slot.deferred_fill == 0);
  slot.deferred_fill = slot.claimed;
  slot.fill_stream = stream;
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
  --deferred_fills_;
}

void KvCache::Impl::enqueue_deferred_fills(std::optional<Stream> consumer) {
  for (std::size_t s = 0; s < slots_.size() && deferred_fills_ > 0; ++s) enqueue_fill(s, consumer);
}

}  // namespace vkv
