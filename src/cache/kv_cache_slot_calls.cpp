// KvCache: calls that name some slots only, for code that drives a few slots of a cache
// shared with others (a transformers generation, the vAttention-compatible module): a
// batch of adjacent slots at once, the seq_lens read back, a step for listed slots.
#include <chrono>

#include "kv_cache_impl.h"
#include "undo_log.h"
#include "util/fork_guard.h"
#include "vkv/error.h"

namespace vkv {

std::vector<std::size_t> KvCache::Impl::alloc_reqids(std::size_t count, bool contiguous, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("alloc_reqids");
  VKV_EXPECTS(count > 0, "alloc_reqids: count = 0; ask for at least one slot");
  std::size_t free_slots = 0;
  for (const Slot& slot : cache_.slots) free_slots += slot.allocated ? 0 : 1;
  VKV_EXPECTS(count <= free_slots, "alloc_reqids: count = ", count, " but only ", free_slots,
              " of max_batch_size = ", cache_.slots.size(), " slots are free");
  std::vector<std::size_t> allocated;
  detail::UndoLog undo;  // all or nothing: a slot that fails to allocate frees the ones before it
  auto allocate = [&](std::size_t slot) {
    const std::size_t kept_at_free = cache_.slots[slot].kept_at_free, eager_slot = cache_.slots.eager_slot();
    allocated.push_back(allocate_slot(lock, slot, stream));
    undo.push(
        [this, slot, kept_at_free, eager_slot] { cache_.slots.unmark_allocated(slot, kept_at_free, eager_slot); });
  };
  if (!contiguous) {
    for (std::size_t i = 0; i < count; ++i) allocate(cache_.slots.next_to_allocate());
  } else {
    // The run of `count` free slots whose previous owners left the most pages, lowest first.
    std::size_t best = cache_.slots.size(), best_kept = 0, run = 0, kept = 0;
    for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
      if (cache_.slots[s].allocated) {
        run = kept = 0;
        continue;
      }
      run += 1;
      kept += cache_.slots[s].kept_at_free;
      if (run > count) kept -= cache_.slots[s - count].kept_at_free;
      if (run >= count && (best == cache_.slots.size() || kept > best_kept)) {
        best = s + 1 - count;
        best_kept = kept;
      }
    }
    VKV_EXPECTS(best < cache_.slots.size(), "alloc_reqids: no ", count, " adjacent slots are free (", free_slots,
                " free of max_batch_size = ", cache_.slots.size(), "); free some, or ask without contiguous");
    for (std::size_t s = best; s < best + count; ++s) allocate(s);
  }
  undo.commit();
  return allocated;  // the next step() wakes the mapper for the next slot's pages (alloc_reqid())
}

std::vector<std::size_t> KvCache::Impl::seq_lens() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  std::vector<std::size_t> lengths(cache_.slots.size());
  for (std::size_t s = 0; s < cache_.slots.size(); ++s)
    lengths[s] = cache_.slots[s].seq_len;  // 0 when free or swapped out
  return lengths;
}

void KvCache::Impl::step_slots(const std::size_t* slots, const std::size_t* seq_lens, std::size_t count,
                               Stream stream) {
  const auto start = std::chrono::steady_clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("step_slots");
  VKV_EXPECTS((slots != nullptr && seq_lens != nullptr) || count == 0, "step_slots: slots or seq_lens is null");
  std::vector<std::size_t> lengths(cache_.slots.size());
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) lengths[s] = cache_.slots[s].seq_len;
  std::vector<bool> listed(cache_.slots.size(), false);
  for (std::size_t i = 0; i < count; ++i) {
    cache_.slots.expect_in_range(slots[i]);
    VKV_EXPECTS(!listed[slots[i]], "step_slots: slot ", slots[i], " is listed twice");
    listed[slots[i]] = true;
    lengths[slots[i]] = seq_lens[i];
  }
  if (step_locked(lock, lengths.data(), lengths.size(), stream, start)) {
    lock.unlock();
    cache_.profile.time_wake([this] { mapper_->wake(); });
  }
}

void KvCache::Impl::set_deferred_reclamation(bool on) {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  cache_.config.deferred_reclamation = on;  // read by free_reqid() only, under the same lock
}

// Only the hint changes: the mapper reads it (background_planner.cpp); nothing that
// decides slots, claims or shortages does, so ranks that differ in it stay in agreement.
void KvCache::Impl::expect_tokens(std::size_t slot_index, std::size_t tokens) {
  rethrow_background_error();
  {
    std::unique_lock<std::mutex> lock(cache_.mutex);
    cache_.slots.expect_in_range(slot_index);
    const Slot& slot = cache_.slots[slot_index];
    VKV_EXPECTS(slot.allocated, "expect_tokens: slot ", slot_index, " is not allocated (alloc_reqid it first)");
    VKV_EXPECTS(!slot.swapped, "expect_tokens: slot ", slot_index, " is swapped out (swap_in it first)");
    VKV_EXPECTS(tokens <= cache_.config.max_context_len, "expect_tokens: tokens = ", tokens,
                " exceeds max_context_len = ", cache_.config.max_context_len);
    cache_.slots.set_expected_tokens(slot_index, tokens);
  }
  if (mapper_) mapper_->wake();  // without the lock: the mapper takes it first thing
}

}  // namespace vkv
