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
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  const bool contended = !lock.owns_lock();
  if (contended) {
    budget_.step_waits();  // an idle give-back stops for it
    lock.lock();
    budget_.step_waited();
  }
  detail::expect_not_suspended(suspension_, "step");
  const bool wake = step_locked(lock, seq_lens, count, stream, start);
  profile_.step().lock_contended = contended;
  lock.unlock();
  if (wake) profile_.time_wake([this] { mapper_->wake(); });
}

StepProfile KvCache::Impl::last_step_profile() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return profile_.last_step();
}

bool KvCache::Impl::step_locked(std::unique_lock<std::mutex>& lock, const std::size_t* seq_lens, std::size_t count,
                                Stream stream, std::chrono::steady_clock::time_point start) {
  profile_.begin_step(start, growth_.mapper_busy());
  step_planner_.expect_valid(seq_lens, count);
  profile_.lap(&StepProfile::plan_ns);
  // Zero-fills left by free_reqid() and swap_out(): enqueued here at the latest, before
  // this step reclaims those pages and before the iteration's kernels.
  profile_.step().fills = static_cast<std::uint32_t>(readers_.deferred_fills());
  readers_.enqueue_deferred_fills(stream);
  profile_.lap(&StepProfile::fills_ns);
  // The work enqueued since the last step() ends its read window here (zero_page).
  if (config_.zero_page) read_windows_.begin_step(stream);
  profile_.lap(&StepProfile::windows_ns);
  // What the iteration's kernels may read in every allocated slot: a padded batch's length.
  const std::size_t horizon =
      config_.zero_page ? layout_.pages_for_tokens(*std::max_element(seq_lens, seq_lens + count)) : 0;
  detail::StepPlan plan;
  detail::ShortageLoop shortage(budget_, lock, detail::ShortageLoop::Asking::once_with_headroom);
  shortage.run_or_throw(
      [&] {
        for (;;) {
          plan = step_planner_.plan(seq_lens, count, horizon);
          profile_.lap(&StepProfile::plan_ns);
          if (!plan.waits_for_mapper) break;
          background_done_.wait(lock);
          ++profile_.step().mapper_waits;
          profile_.lap(&StepProfile::mapper_wait_ns);
        }
        if (plan.missing == 0) return;
        detail::UndoLog undo(detail::waits_for_stream(*backend_, stream));
        growth_.map_missing(plan.claims, plan.copies, plan.missing, stream, undo, "step");
        undo.commit();
        profile_.count_step_pages(plan.missing);
        profile_.lap(&StepProfile::map_ns);
      },
      [&] {
        profile_.lap(&StepProfile::map_ns);  // the mapping that ran short
        return wait_for_mapper(lock);
      },
      [&] { step_planner_.expect_valid(seq_lens, count); });  // other threads may have freed slots meanwhile
  bool prefilled = false;
  for (std::size_t s = 0; s < count; ++s) {
    Slot& slot = slots_[s];
    if (slot.claimed == 0 && seq_lens[s] > 0) {  // a prefill: what the next one may need
      prompts_.record(seq_lens[s]);
      prefilled = true;
    }
    slot.seq_len = seq_lens[s];
    slot.claimed = plan.claims[s];
    VKV_ASSERT(slot.claimed <= slot.mapped());
  }
  if (prefilled) slots_.set_eager_pages(layout_.pages_for_tokens(detail::eager_tokens(config_, prompts_)));
  if (config_.zero_page) read_windows_.end_step(horizon);
  budget_.publish_in_use();
  // A wake-up costs a system call and may put the mapper on this core: only with work.
  const bool wake =
      mapper_ && !suspension_ &&
      planner_.next(/*settle_events=*/false, detail::eager_tokens(config_, prompts_), watermark_pages_).kind !=
          detail::BackgroundUnit::Kind::none;
  profile_.step().woke_mapper = wake;
  const Clock::time_point end = Clock::now();
  profile_.end_step(end);
  budget_.step_ended(end);
  return wake;
}

// Pages the mapper is moving are not lost: a shortage is decided once it has put them down.
void KvCache::Impl::wait_for_pages(std::unique_lock<std::mutex>& lock, std::size_t missing, std::size_t slot,
                                   std::size_t claim) {
  background_done_.wait(lock, [&] {
    std::vector<std::size_t> claims = slots_.claims();
    claims[slot] = std::max(claims[slot], claim);
    return !growth_.mapper_busy() || source_.obtainable_pages(claims) >= missing;
  });
}

bool KvCache::Impl::wait_for_mapper(std::unique_lock<std::mutex>& lock) {
  if (!growth_.mapper_busy()) return false;
  background_done_.wait(lock, [&] { return !growth_.mapper_busy(); });
  return true;
}

}  // namespace vkv
