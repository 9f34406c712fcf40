// KvCache: the part of a call that may go differently on different tensor-parallel
// ranks, done ahead of the call (see "agreement between tensor-parallel ranks" in
// kv_cache.h). vkv.distributed prepares on every rank, agrees, then makes the call on
// every rank or on none.
//
// Preparing may map, create and unmap pages, but only beyond the slots' claims: the
// state every later decision depends on (which slots are allocated, their seq_lens and
// claims, what they kept when freed, which pages they share, the budget) is untouched.
// A shortage is returned, not thrown, and a failed preparation leaves no trace but
// pages mapped ahead.
//
// step(), swap_in(), fork() and share_prefix() plan the same way as below; the checks
// repeat theirs with the same messages, so that a bad argument fails before agreement.
#include <algorithm>
#include <chrono>
#include <optional>
#include <unordered_map>

#include "kv_cache_impl.h"
#include "read_windows.h"
#include "undo_log.h"
#include "util/clock.h"
#include "vkv/error.h"

namespace vkv {
namespace {

using Asking = detail::ShortageLoop::Asking;
using Shortfall = detail::ShortageLoop::Shortfall;

// What a preparation says is missing: a shortage that stood, at least one page (an
// OutOfMemory may name none), or 0.
std::size_t pages_short(const Shortfall& missing) { return missing ? std::max<std::size_t>(*missing, 1) : 0; }

}  // namespace

KvCache::Preparation KvCache::Impl::prepare_step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  const auto start = std::chrono::steady_clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("prepare_step");
  step_planner_.expect_valid(seq_lens, count);
  readers_.enqueue_deferred_fills(stream);  // the step() that follows agreement then makes no backend call
  const std::size_t regions = cache_.layout.num_regions();
  if (cache_.config.zero_page) cache_.read_windows.close_current(stream);  // mapping may wait for in-flight reads
  const std::size_t horizon =
      cache_.config.zero_page ? cache_.layout.pages_for_tokens(*std::max_element(seq_lens, seq_lens + count)) : 0;
  detail::StepPlan step;
  auto map = [&] {
    for (;;) {
      step = step_planner_.plan(seq_lens, count, horizon);
      if (!step.waits_for_mapper) break;
      cache_.unit_done.wait(lock);
    }
    return map_unclaimed(step.claims, step.to_map, step.copies.size() * regions, stream, "step");
  };
  const Shortfall missing =
      detail::ShortageLoop(cache_.budget, lock, Asking::never).run(map, [&] { return wait_for_mapper(lock); });
  Preparation plan;
  plan.copied_pages = step.copies.size();
  plan.missing_pages = pages_short(missing);
  if (!missing) cache_.profile.count_prepared(step.to_map, start);
  return plan;
}

detail::ShortageLoop::Shortfall KvCache::Impl::map_unclaimed(const std::vector<std::size_t>& claims, std::size_t to_map,
                                                             std::size_t to_free, Stream stream, const char* call) {
  const std::size_t missing = to_map + to_free;
  if (missing == 0) return std::nullopt;
  const std::size_t obtainable = source_.obtainable_pages(claims);
  if (missing > obtainable) return missing - obtainable;
  // OutOfMemory here: the device ran out, or the budget's room went meanwhile.
  detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
  if (to_map > 0) growth_.map_missing(claims, {}, to_map, stream, undo, call);
  // The copies' pages wait in the pool: the call takes them without creating any.
  if (to_free > 0)
    for (const Page& page : source_.obtain(to_free, claims)) cache_.pool.give_back(page);
  undo.commit();
  return std::nullopt;
}

KvCache::Preparation KvCache::Impl::prepare_swap_in(std::size_t slot_index, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("prepare_swap_in");
  cache_.slots.expect_in_range(slot_index);
  const std::size_t regions = cache_.layout.num_regions();
  if (cache_.config.zero_page) cache_.read_windows.close_current(stream);  // mapping may wait for in-flight reads
  auto map = [&] {
    for (;;) {
      const Slot& slot = cache_.slots[slot_index];
      VKV_EXPECTS(slot.allocated && slot.swapped, "swap_in: slot ", slot_index, " is not swapped out");
      if (!slot.busy()) break;
      wait_not_busy(lock, slot_index);
    }
    const Slot& slot = cache_.slots[slot_index];
    std::vector<std::size_t> claims = cache_.slots.claims();
    claims[slot_index] = cache_.layout.pages_for_tokens(detail::swapped_tokens(slot, cache_.layout));
    const std::size_t to_map = claims[slot_index] > slot.mapped() ? (claims[slot_index] - slot.mapped()) * regions : 0;
    return map_unclaimed(claims, to_map, 0, stream, "swap_in");
  };
  const Shortfall missing =
      detail::ShortageLoop(cache_.budget, lock, Asking::never).run(map, [&] { return wait_for_mapper(lock); });
  Preparation plan;
  plan.missing_pages = pages_short(missing);
  return plan;
}

KvCache::Preparation KvCache::Impl::prepare_fork(std::size_t src) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("prepare_fork");
  cache_.slots.expect_in_range(src);
  for (;;) {
    prefixes_.expect_valid_fork(src);
    Preparation plan;
    plan.slot = cache_.slots.next_to_allocate();
    VKV_EXPECTS(plan.slot < cache_.slots.size(), "no free slot: all max_batch_size = ", cache_.slots.size(),
                " slots are allocated (free_reqid one first)");
    if (cache_.slots[plan.slot].busy()) {
      wait_not_busy(lock, plan.slot);
      continue;
    }
    plan.missing_pages = obtain_share_pages(lock, src, plan.slot, cache_.slots[src].seq_len);
    return plan;
  }
}

KvCache::Preparation KvCache::Impl::prepare_share_prefix(std::size_t src, std::size_t dst, std::size_t tokens) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("prepare_share_prefix");
  cache_.slots.expect_in_range(src);
  cache_.slots.expect_in_range(dst);
  for (;;) {
    prefixes_.expect_valid_share(src, dst, tokens);
    if (cache_.slots[dst].busy()) {
      wait_not_busy(lock, dst);
      continue;
    }
    Preparation plan;
    plan.missing_pages = obtain_share_pages(lock, src, dst, tokens);
    return plan;
  }
}

KvCache::Preparation KvCache::Impl::prepare_set_budget(std::size_t bytes) {
  rethrow_background_error();
  const std::size_t page = cache_.layout.page_bytes();
  VKV_EXPECTS(bytes >= page, "set_budget: bytes = ", bytes, " is less than one page (", page, " bytes)");
  std::lock_guard<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("prepare_set_budget");
  const std::size_t in_use = source_.pages_held_now();
  Preparation plan;
  plan.missing_pages = in_use > bytes / page ? in_use - bytes / page : 0;
  return plan;
}

// Sharing `tokens` tokens into dst copies a partly filled page into a page of dst's own
// (one it keeps mapped there, or a fresh one per region), and the pages of a large page
// of src's that `tokens` ends inside of (prefixes_.shape()). Makes the fresh ones free in the
// pool (created, or unmapped from where no slot claims them); returns the shortfall.
std::size_t KvCache::Impl::obtain_share_pages(std::unique_lock<std::mutex>& lock, std::size_t src, std::size_t dst,
                                              std::size_t tokens) {
  auto obtain = [&]() -> Shortfall {
    const detail::PrefixSharing::Shape shape = prefixes_.shape(src, dst, tokens);
    const std::size_t needed = shape.fresh * cache_.layout.num_regions();
    if (needed == 0) return std::nullopt;
    // No stream to wait on here: pages work in flight may read stay where they are.
    std::vector<std::size_t> claims = readers_.reclaimable_floors();
    if (shape.keeps_tail) claims[dst] = cache_.slots[dst].mapped();
    const std::size_t obtainable = source_.obtainable_pages(claims);
    if (obtainable < needed) return needed - obtainable;
    for (const Page& fresh : source_.obtain(needed, claims)) cache_.pool.give_back(fresh);
    return std::nullopt;
  };
  return pages_short(
      detail::ShortageLoop(cache_.budget, lock, Asking::never).run(obtain, [&] { return wait_for_mapper(lock); }));
}

}  // namespace vkv
