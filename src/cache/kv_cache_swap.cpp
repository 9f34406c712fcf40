// KvCache: moving a slot's tokens to host memory and back (preemption without
// recomputation). The slot keeps its id and its addresses; only its pages go.
//
// Host memory has a per-region layout of its own: region r's seq_len * token_bytes
// bytes, one region after another. Copies run on the caller's stream; the host memory
// of a copy back is freed by a later call once the copy's event has completed.
#include "kv_cache_impl.h"
#include "read_windows.h"
#include "undo_log.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {

bool KvCache::Impl::is_swapped(std::size_t slot) const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  cache_.slots.expect_in_range(slot);
  return cache_.slots[slot].swapped;
}

void KvCache::Impl::swap_out(std::size_t slot_index, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("swap_out");
  cache_.slots.expect_in_range(slot_index);
  auto expect_valid = [&] {
    VKV_EXPECTS(cache_.slots[slot_index].allocated, "swap_out: slot ", slot_index, " is not allocated");
    VKV_EXPECTS(!cache_.slots[slot_index].swapped, "swap_out: slot ", slot_index, " is swapped out already");
  };
  settle(lock, slot_index, 0, 0, expect_valid);
  cache_.host_frees.free_finished(/*wait=*/false);

  const Slot& slot = cache_.slots[slot_index];
  const std::size_t region_bytes = slot.seq_len * cache_.layout.token_bytes();
  detail::HostCopy copy;
  copy.bytes = region_bytes * cache_.layout.num_regions();
  detail::UndoLog undo;
  if (copy.bytes > 0) {
    copy.host = cache_.backend().allocate_host(copy.bytes);
    undo.push([this, copy, stream] {
      try {
        cache_.backend().synchronize(stream);  // copies already enqueued write into the host memory
      } catch (...) {
        // A dead context runs no copy any more.
      }
      cache_.backend().free_host(copy.host, copy.bytes);
    });
    for (std::size_t r = 0; r < cache_.layout.num_regions(); ++r)
      cache_.backend().copy(copy.host + r * region_bytes, mappings_.address(r, slot_index, 0), region_bytes, stream);
    copy.ready = cache_.backend().record_event(stream);
    undo.push([this, ready = copy.ready] { cache_.backend().destroy_event(ready); });
  }
  // From here on only the pages change hands; the tokens are safe in `copy`. Nothing
  // that could still fail clears them: the zero-fill comes after the last fallible call.
  const bool shares = cache_.sharing.holds_shared(slot);
  if (shares) drop_all_pages(slot_index, stream, /*return_to_device=*/false);
  undo.commit();
  if (!shares) readers_.defer_fill(slot_index, stream);  // behind the copy on the stream (slot_readers.cpp)
  cache_.slots.mark_swapped_out(slot_index, copy);
  cache_.budget.publish_in_use();
  if (mapper_) mapper_->wake();
}

void KvCache::Impl::swap_in(std::size_t slot_index, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("swap_in");
  cache_.slots.expect_in_range(slot_index);
  auto expect_valid = [&] {
    VKV_EXPECTS(cache_.slots[slot_index].allocated && cache_.slots[slot_index].swapped, "swap_in: slot ", slot_index,
                " is not swapped out");
  };
  expect_valid();
  const std::size_t claim =
      cache_.layout.pages_for_tokens(detail::swapped_tokens(cache_.slots[slot_index], cache_.layout));
  settle(lock, slot_index, claim * cache_.layout.num_regions(), claim, expect_valid);
  cache_.host_frees.free_finished(/*wait=*/false);
  readers_.enqueue_fill(slot_index);                                       // before the copy back
  if (cache_.config.zero_page) cache_.read_windows.close_current(stream);  // undo and reclamation may wait for it

  const Slot& slot = cache_.slots[slot_index];
  const std::size_t tokens = detail::swapped_tokens(slot, cache_.layout);
  std::vector<std::size_t> claims = cache_.slots.claims();
  claims[slot_index] = cache_.layout.pages_for_tokens(tokens);
  const std::size_t missing =
      claims[slot_index] > slot.mapped() ? (claims[slot_index] - slot.mapped()) * cache_.layout.num_regions() : 0;
  detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
  growth_.map_missing(claims, {}, missing, stream, undo, "swap_in");
  if (slot.swap.bytes > 0) {
    // After the zero-fill of the slot's kept pages, and after the copy out.
    readers_.order_after_free_event(slot, stream);
    cache_.backend().stream_wait_event(stream, slot.swap.ready);
    const std::size_t region_bytes = tokens * cache_.layout.token_bytes();
    for (std::size_t r = 0; r < cache_.layout.num_regions(); ++r) {
      const Address address = mappings_.address(r, slot_index, 0);
      undo.enqueued_device_work();
      cache_.backend().copy(address, slot.swap.host + r * region_bytes, region_bytes, stream);
      // Pages this slot keeps must read as zeros again if the call fails.
      undo.push_enqueue(
          [this, address, region_bytes, stream] { cache_.backend().zero(address, region_bytes, stream); });
    }
    const Event done = cache_.backend().record_event(stream);
    undo.commit();
    cache_.backend().destroy_event(slot.swap.ready);
    cache_.host_frees.add({slot.swap.host, slot.swap.bytes, done});
  } else {
    undo.commit();
  }
  cache_.slots.mark_swapped_in(slot_index, tokens, claims[slot_index]);
  cache_.budget.publish_in_use();
  if (mapper_) mapper_->wake();
}

}  // namespace vkv
