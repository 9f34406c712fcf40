// BudgetClient: asking the other members for pages when the cache runs short, and giving
// pages back when they ask, when the cache is idle and when they are under pressure.
#include "budget_client.h"

#include <algorithm>

#include "util/fork_guard.h"
#include "util/format.h"
#include "util/internal_assert.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

std::unique_ptr<BudgetMembership> join(const CacheConfig& config, const Backend& backend, std::size_t page_bytes) {
  if (config.shared_budget.empty()) return nullptr;
  const MemberLimits limits{config.shared_budget_floor, config.shared_budget_cap,
                            static_cast<std::uint32_t>(config.shared_budget_priority)};
  return std::make_unique<BudgetMembership>(config.shared_budget, backend, page_bytes, limits,
                                            config.shared_budget_label);
}

}  // namespace

BudgetClient::BudgetClient(const CacheConfig& config, const Backend& backend, std::size_t page_bytes, std::mutex& mutex)
    : membership_(join(config, backend, page_bytes)),
      mutex_(mutex),
      page_bytes_(page_bytes),
      idle_period_(config.shared_budget_idle_ms),
      pressure_period_(config.shared_budget_pressure_ms),
      fork_generation_(fork_generation()) {}

BudgetClient::~BudgetClient() { stop(); }

void BudgetClient::start() {
  if (!membership_) return;
  VKV_ASSERT(cache_ != nullptr);  // lend() first: the watcher calls into the cache
  membership_->start_watching(
      {[this] { return cached_bytes(); }, [this](std::size_t bytes) { give_back(bytes); },
       idle_period_.count() > 0 ? std::function<void()>([this] { release_when_idle(); }) : nullptr,
       std::max(std::chrono::milliseconds(1), idle_period_ / 4),
       pressure_period_.count() > 0 ? std::function<bool()>([this] { return trim_under_pressure(); }) : nullptr,
       pressure_period_});
}

void BudgetClient::stop() noexcept {
  if (membership_) membership_->stop_watching();
}

void BudgetClient::abandon() noexcept { static_cast<void>(membership_.release()); }

bool BudgetClient::reap_dead() noexcept { return membership_ && membership_->reap_dead() > 0; }

void BudgetClient::ask(std::unique_lock<std::mutex>& lock, std::size_t pages, std::size_t headroom) {
  const auto start = Clock::now();
  lock.unlock();
  try {
    membership_->ask(pages + headroom, pages);
  } catch (...) {
    lock.lock();
    throw;
  }
  const auto relock = Clock::now();
  lock.lock();
  handoff_.ask_relock_ns += nanoseconds_since(relock);
  membership_->claim_reserved();
  asks_.calls += 1;
  asks_.nanoseconds += nanoseconds_since(start);
  try {
    asks_.units += cache_->add_free_pages(membership_->claimed_pages());
  } catch (const OutOfMemory&) {
    // The device itself is short (memory outside the budget): the call will say so.
  }
  membership_->release_claimed();  // what the pool could not take goes back
}

std::size_t BudgetClient::ask_headroom(std::size_t missing) const {
  // In a burst every admission's step() is short by about one prompt: asking for the next
  // prompt's pages too (eager allocation's estimate) halves the asks. At most `missing`
  // more, and only where the others cache plenty (twice what this would ask): when they
  // are busy too, taking more than needed would make them ask it back (and preempt).
  const std::size_t headroom = std::min(missing, cache_->next_prompt_pages());
  return membership_->others_cached_pages() >= 2 * (missing + headroom) ? headroom : 0;
}

std::string BudgetClient::room_text() const { return membership_ ? "; " + membership_->room_text() : std::string(); }

bool BudgetClient::counts_exactly(std::size_t created_pages) const {
  return !membership_ || membership_->held_bytes() == (created_pages + membership_->claimed_pages()) * page_bytes_;
}

void BudgetClient::publish_in_use() noexcept {
  if (membership_) membership_->publish_in_use(cache_->claimed_pages() * page_bytes_);
}

void BudgetClient::step_ended(Clock::time_point end) noexcept {
  last_step_at_ = end;
  idle_released_ = false;
}

std::size_t BudgetClient::cached_bytes() {
  // A call holding the lock (a step mapping hundreds of pages) must not hold up the pledge:
  // the published figure serves (give_back() gives what it can, no more).
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return membership_->published_cached_bytes();
  // Unclaimed pages are never shared: each counts once.
  return cache_->cached_pages(cache_->reclaimable_floors(), /*freed_only=*/false) * page_bytes_;
}

void BudgetClient::give_back(std::size_t bytes) {
  if (fork_generation() != fork_generation_) return;
  const auto start = Clock::now();
  const std::size_t page = page_bytes_;
  std::size_t released = 0;
  std::uint64_t lock_wait_ns = 0;
  std::uint64_t event_wait_ns = 0;
  // Takes the lock. When a call of the owner holds it, maybe for a while (a step mapping
  // hundreds of pages), that call gives what it can from freed slots meanwhile
  // (serve_give_back()); the watcher gives the rest once the call is over.
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  auto lock_or_post = [&] {
    if (lock.try_lock()) return;
    const auto waiting = Clock::now();
    give_back_wanted_.store(bytes - std::min(bytes, released * page));
    lock.lock();
    const std::size_t left = give_back_wanted_.exchange(0);
    bytes = released * page + left;  // what the owner's calls gave is theirs to count
    lock_wait_ns += nanoseconds_since(waiting);
  };
  lock_or_post();
  std::uint64_t event_wait_before = cache_->event_wait_ns();
  const ReleaseTimes times_before = release_times_;  // what the owner's calls give meanwhile serves this answer too
  // Pages the mapper is moving are in no slot's books nor in the pool: they are left alone,
  // and so is a slot it works on. No wait for it.
  auto wanted = [&] { return (bytes + page - 1) / page; };
  released = release(wanted(), cache_->reclaimable_floors(), Victims::freed_then_surplus, /*may_wait=*/false);
  if (released < wanted()) {
    // The rest is in slots whose last readers may still run (the owner's queue may hold a
    // whole iteration): wait for them with the lock released, so that the owner's calls go
    // on meanwhile, then take what is ready.
    event_wait_ns += cache_->event_wait_ns() - event_wait_before;  // the owner's calls' waits are not the watcher's
    const auto waiting = Clock::now();
    cache_->wait_for_readers(lock, [&] {
      event_wait_ns += nanoseconds_since(waiting);
      lock_or_post();
      return true;
    });
    event_wait_before = cache_->event_wait_ns();
    released += release(wanted() - std::min(wanted(), released), cache_->reclaimable_floors(),
                        Victims::freed_then_surplus, /*may_wait=*/true);
  }
  publish_in_use();
  handoff_.answer_unmap_ns += release_times_.unmap_ns - times_before.unmap_ns;
  handoff_.answer_release_ns += release_times_.release_ns - times_before.release_ns;
  handoff_.answer_count_ns += release_times_.count_ns - times_before.count_ns;
  handoff_.answers += 1;
  handoff_.answer_pages += released;
  handoff_.answer_lock_wait_ns += lock_wait_ns;
  handoff_.answer_event_wait_ns += event_wait_ns + (cache_->event_wait_ns() - event_wait_before);
  handoff_.answer_ns += nanoseconds_since(start);
}

void BudgetClient::serve_give_back(const std::vector<std::size_t>& floors) {
  if (give_back_wanted_.load(std::memory_order_relaxed) == 0) return;
  const std::size_t bytes = give_back_wanted_.exchange(0);
  if (bytes == 0) return;  // the watcher got the lock first
  const std::size_t page = page_bytes_;
  const std::size_t wanted = (bytes + page - 1) / page;
  std::size_t released = 0;
  try {
    // Freed slots only (an allocated slot's pages above its claim may be what this call
    // is about to claim: its claims are not in the books yet), and only pages no device
    // work reads any more: this call does not wait for its own queue.
    released = release(wanted, floors, Victims::freed_only, /*may_wait=*/false);
  } catch (const std::exception& error) {
    // The owner's call goes on; the watcher tries again once it is over.
    log_debug(concat("shared budget: giving pages back during a call failed: ", error.what()));
  } catch (...) {
    log_debug("shared budget: giving pages back during a call failed");
  }
  handoff_.answer_pages += released;
  handoff_.answer_pages_in_calls += released;
  if (released < wanted) give_back_wanted_.fetch_add((wanted - released) * page);
}

void BudgetClient::release_when_idle() {
  if (fork_generation() != fork_generation_) return;
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || idle_released_) return;  // a call holds it: not idle
  if (Clock::now() - last_step_at_ < idle_period_) return;
  idle_released_ = true;
  // Allocated slots keep what they map ahead: a paused request's next step needs it. In
  // chunks (~2 ms of driver calls on a GPU), stopping as soon as a step() waits for the lock:
  // its idle spell is over.
  constexpr std::size_t kChunk = 64;
  std::size_t released = 0;
  auto release_ready = [&] {
    for (;;) {
      const std::size_t given = release(kChunk, cache_->reclaimable_floors(), Victims::freed_only, /*may_wait=*/false);
      released += given;
      if (given < kChunk || steps_waiting_.load() > 0) return given >= kChunk;
    }
  };
  if (release_ready()) {  // a step() waits: it goes first
    handoff_.idle_pages += released;
    publish_in_use();
    return;
  }
  const bool go_on = cache_->wait_for_readers(lock, [&] {
    lock.lock();
    return idle_released_;  // a step() meanwhile ended the idle spell: its pages stay
  });
  if (!go_on) return;
  // What the fills just enqueued (done at once on some backends) or the wait made ready.
  release_ready();
  handoff_.idle_pages += released;
  publish_in_use();
}

bool BudgetClient::trim_under_pressure() {
  if (fork_generation() != fork_generation_) return false;
  const auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;  // a call holds it: the next poll tries again
  const std::size_t headroom = trim_headroom();
  std::vector<std::size_t> floors = cache_->reclaimable_floors();
  const std::size_t cached = cache_->cached_pages(floors, /*freed_only=*/true);
  if (cached <= headroom) return false;
  // Freed slots only (a running request's pages mapped ahead are its next steps'), and only
  // pages whose readers are done: no wait here, where the watcher would answer an ask late.
  // The owner's next step() enqueues the others' zero-fills; a later poll finds them ready.
  const std::size_t released =
      release(std::min(kReleaseChunkPages, cached - headroom), floors, Victims::freed_only, /*may_wait=*/false);
  handoff_.pressure_pages += released;
  handoff_.pressure_ns += nanoseconds_since(start);
  if (released == 0) return false;
  publish_in_use();
  floors = cache_->reclaimable_floors();
  return cache_->cached_pages(floors, /*freed_only=*/true) > headroom && steps_waiting_.load() == 0;
}

}  // namespace vkv::detail
