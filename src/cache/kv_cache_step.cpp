// KvCache: step(), and mapping every page a call needs that is not mapped yet.
#include <algorithm>
#include <chrono>
#include <optional>
#include <unordered_map>

#include "kv_cache_impl.h"
#include "undo_log.h"
#include "util/clock.h"
#include "util/format.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv {

using detail::Clock;

void KvCache::Impl::step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  const auto start = Clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex, std::try_to_lock);
  const bool contended = !lock.owns_lock();
  if (contended) {
    cache_.budget.step_waits();  // an idle give-back stops for it
    lock.lock();
    cache_.budget.step_waited();
  }
  suspension_.expect_not_suspended("step");
  const bool wake = step_locked(lock, seq_lens, count, stream, start);
  cache_.profile.step().lock_contended = contended;
  lock.unlock();
  if (wake) cache_.profile.time_wake([this] { mapper_->wake(); });
}

StepProfile KvCache::Impl::last_step_profile() const {
  std::lock_guard<std::mutex> lock(cache_.mutex);
  return cache_.profile.last_step();
}

bool KvCache::Impl::step_locked(std::unique_lock<std::mutex>& lock, const std::size_t* seq_lens, std::size_t count,
                                Stream stream, std::chrono::steady_clock::time_point start) {
  cache_.profile.begin_step(start, growth_.mapper_busy());
  step_planner_.expect_valid(seq_lens, count);
  cache_.profile.lap(&StepProfile::plan_ns);
  // Zero-fills left by free_reqid() and swap_out(): enqueued here at the latest, before
  // this step reclaims those pages and before the iteration's kernels.
  cache_.profile.step().fills = static_cast<std::uint32_t>(readers_.deferred_fills());
  readers_.enqueue_deferred_fills(stream);
  cache_.profile.lap(&StepProfile::fills_ns);
  // The work enqueued since the last step() ends its read window here (zero_page).
  if (cache_.config.zero_page) cache_.read_windows.begin_step(stream);
  cache_.profile.lap(&StepProfile::windows_ns);
  // What the iteration's kernels may read in every allocated slot: a padded batch's length.
  const std::size_t horizon =
      cache_.config.zero_page ? cache_.layout.pages_for_tokens(*std::max_element(seq_lens, seq_lens + count)) : 0;
  detail::StepPlan plan;
  detail::ShortageLoop shortage(cache_.budget, lock, detail::ShortageLoop::Asking::once_with_headroom);
  shortage.run_or_throw(
      [&] {
        for (;;) {
          plan = step_planner_.plan(seq_lens, count, horizon);
          cache_.profile.lap(&StepProfile::plan_ns);
          if (!plan.waits_for_mapper) break;
          cache_.unit_done.wait(lock);
          ++cache_.profile.step().mapper_waits;
          cache_.profile.lap(&StepProfile::mapper_wait_ns);
        }
        if (plan.missing == 0) return;
        detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
        growth_.map_missing(plan.claims, plan.copies, plan.missing, stream, undo, "step");
        undo.commit();
        cache_.profile.count_step_pages(plan.missing);
        cache_.profile.lap(&StepProfile::map_ns);
      },
      [&] {
        cache_.profile.lap(&StepProfile::map_ns);  // the mapping that ran short
        return wait_for_mapper(lock);
      },
      [&] { step_planner_.expect_valid(seq_lens, count); });  // other threads may have freed slots meanwhile
  bool prefilled = false;
  for (std::size_t s = 0; s < count; ++s) {
    const Slot& slot = cache_.slots[s];
    if (slot.claimed == 0 && seq_lens[s] > 0) {  // a prefill: what the next one may need
      cache_.prompts.record(seq_lens[s]);
      prefilled = true;
    }
    cache_.slots.set_tokens(s, seq_lens[s], plan.claims[s]);
    VKV_ASSERT(slot.claimed <= slot.mapped());
  }
  if (prefilled)
    cache_.slots.set_eager_pages(cache_.layout.pages_for_tokens(detail::eager_tokens(cache_.config, cache_.prompts)));
  if (cache_.config.zero_page) cache_.read_windows.end_step(horizon);
  cache_.budget.publish_in_use();
  // A wake-up costs a system call and may put the mapper on this core: only with work.
  const bool wake =
      mapper_ && !suspension_.suspended() &&
      planner_.next(/*settle_events=*/false, detail::eager_tokens(cache_.config, cache_.prompts), watermark_pages_)
              .kind != detail::BackgroundUnit::Kind::none;
  cache_.profile.step().woke_mapper = wake;
  const Clock::time_point end = Clock::now();
  cache_.profile.end_step(end);
  cache_.budget.step_ended(end);
  return wake;
}

// Pages the mapper is moving are not lost: a shortage is decided once it has put them down.
void KvCache::Impl::wait_for_pages(std::unique_lock<std::mutex>& lock, std::size_t missing, std::size_t slot,
                                   std::size_t claim) {
  cache_.unit_done.wait(lock, [&] {
    std::vector<std::size_t> claims = cache_.slots.claims();
    claims[slot] = std::max(claims[slot], claim);
    return !growth_.mapper_busy() || source_.obtainable_pages(claims) >= missing;
  });
}

bool KvCache::Impl::wait_for_mapper(std::unique_lock<std::mutex>& lock) {
  if (!growth_.mapper_busy()) return false;
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });
  return true;
}

}  // namespace vkv
