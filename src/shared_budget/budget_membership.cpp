// BudgetMembership: a cache's row in a shared budget, its page account and its watcher.
#include "budget_membership.h"

#include <algorithm>
#include <cstring>

#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

// The budget's object, with errors in the words of the config field that named it.
SharedMapping open_for_member(const std::string& name) {
  try {
    return open_budget_object(name);
  } catch (const InvalidArgument& error) {
    throw InvalidArgument(concat("shared_budget = '", name, "': ", error.what(),
                                 " (vkv.SharedBudget.create, or python -m vkv.budget create)"));
  }
}

std::atomic<ShortClaimHook> short_claim_hook{nullptr};

// What a claim keeps of `granted` pages (tests may shorten it).
std::size_t kept_of(std::size_t asked, std::size_t granted) noexcept {
  const ShortClaimHook hook = short_claim_hook.load(std::memory_order_relaxed);
  return hook == nullptr ? granted : std::min(granted, hook(asked, granted));
}

}  // namespace

void set_short_claim_hook_for_testing(ShortClaimHook hook) noexcept { short_claim_hook.store(hook); }

BudgetMembership::BudgetMembership(const std::string& name, const Backend& backend, std::size_t page_bytes,
                                   const MemberLimits& limits, const std::string& label)
    : name_(name),
      mapping_(open_for_member(name)),
      ledger_(*static_cast<BudgetSegment*>(mapping_.data()), name),
      page_bytes_(page_bytes) {
  const BudgetSegment& segment = ledger_.segment();
  const std::string identity = backend.memory_identity();
  const std::string budget_identity(segment.identity, strnlen(segment.identity, sizeof(segment.identity)));
  VKV_EXPECTS(identity == budget_identity, "shared_budget = '", name, "' is over ", segment.device, " (",
              budget_identity, ") but this cache is on ", backend.name(), " (", identity,
              "): a budget counts one device's memory");
  member_ = ledger_.join(page_bytes, limits, label);
}

BudgetMembership::~BudgetMembership() {
  stop_watching();
  ledger_.leave(member_);
}

void BudgetMembership::start_watching(Callbacks callbacks) {
  callbacks_ = std::move(callbacks);
  // Every request after joining is this member's to answer, also one made before the
  // thread runs its first line.
  const std::uint32_t answered = ledger_.last_answered(member_);
  watcher_ = std::thread([this, answered] { watch(answered); });
}

void BudgetMembership::stop_watching() noexcept {
  if (!watcher_.joinable()) return;
  stopping_.store(true);
  futex_wake_all(ledger_.segment().requests);  // the others see no new request and sleep on
  watcher_.join();
}

std::size_t BudgetMembership::available_pages() const noexcept {
  return claimed_pages_.load(std::memory_order_relaxed) + ledger_.free_hint(member_) / page_bytes_;
}

// What the others gave for this member comes first: nobody else may use it.
std::size_t BudgetMembership::take_claimed(std::size_t pages) noexcept {
  std::size_t claimed = claimed_pages_.load();
  while (!claimed_pages_.compare_exchange_weak(claimed, claimed - std::min(claimed, pages))) {}
  return std::min(claimed, pages);
}

bool BudgetMembership::take(std::size_t pages) {
  if (kept_of(pages, pages) < pages) return false;
  const std::size_t claimed = take_claimed(pages);
  try {
    if (claimed == pages || ledger_.acquire(member_, (pages - claimed) * page_bytes_)) return true;
  } catch (...) {
    claimed_pages_.fetch_add(claimed);
    throw;
  }
  claimed_pages_.fetch_add(claimed);
  return false;
}

std::size_t BudgetMembership::take_up_to(std::size_t pages) {
  const std::size_t claimed = take_claimed(pages);
  std::size_t granted = claimed;
  try {
    granted += ledger_.acquire_up_to(member_, (pages - claimed) * page_bytes_, page_bytes_) / page_bytes_;
  } catch (...) {
    claimed_pages_.fetch_add(claimed);
    throw;
  }
  const std::size_t kept = kept_of(pages, granted);
  give(granted - kept);
  return kept;
}

void BudgetMembership::give(std::size_t pages) noexcept { ledger_.release(member_, pages * page_bytes_); }

std::size_t BudgetMembership::reap_dead() noexcept {
  try {
    return ledger_.reap();
  } catch (const std::exception& error) {
    log_debug(concat("shared budget '", name_, "': counting dead members out failed: ", error.what()));
    return 0;
  }
}

void BudgetMembership::ask(std::size_t pages, std::size_t needed) {
  last_ask_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint32_t request = ledger_.ask(member_, pages * page_bytes_, needed * page_bytes_);
  BudgetSegment& segment = ledger_.segment();
  const auto begin = std::chrono::steady_clock::now();
  auto deadline = begin + kAskTimeout;
  bool extended = false;  // past kAskTimeout: only while an answer may still come
  // The answers come in chunks, each a wake-up: dead members (an answerer that died
  // mid-answer never answers) are counted out at the first look and then every kReapPeriod.
  auto reaped_at = begin;
  bool reap = true;
  for (;;) {
    const std::uint32_t releases = segment.releases.load();
    if (ledger_.ask_settled(member_, request, needed * page_bytes_, reap)) break;
    const auto now = std::chrono::steady_clock::now();
    if (reap) reaped_at = now;
    if (now >= deadline && !extended && ledger_.answer_may_come(request, member_)) {
      deadline = begin + kAskTimeoutRunning;
      extended = true;
    }
    if (now >= deadline) {
      log_debug(concat("shared budget '", name_, "': members did not answer within ",
                       (extended ? kAskTimeoutRunning : kAskTimeout).count(), " ms"));
      break;
    }
    futex_wait(segment.releases, releases, std::min<std::chrono::nanoseconds>(deadline - now, kReapPeriod));
    reap = std::chrono::steady_clock::now() - reaped_at >= kReapPeriod;
  }
}

void BudgetMembership::claim_reserved() noexcept {
  claimed_pages_.fetch_add(ledger_.claim_reserved(member_) / page_bytes_);
}

void BudgetMembership::release_claimed() noexcept {
  const std::size_t pages = claimed_pages_.exchange(0);
  if (pages > 0) give(pages);
}

void BudgetMembership::watch(std::uint32_t seen) noexcept {
  using Clock = std::chrono::steady_clock;
  const BudgetSegment& segment = ledger_.segment();
  const bool trims = callbacks_.trim && callbacks_.pressure_period.count() > 0;
  Clock::time_point pressure_until{};  // another member asked before this, give back unasked until then
  bool more = false;                   // the last trim left more to give
  while (!stopping_.load()) {
    const std::uint32_t request = segment.requests.load();
    if (request == seen) {
      const Clock::time_point now = Clock::now();
      const Clock::time_point asked_at{Clock::duration(last_ask_ns_.load())};
      const bool short_itself = last_ask_ns_.load() != 0 && now - asked_at < callbacks_.pressure_period;
      const bool pressed = trims && now < pressure_until && !short_itself;
      if (pressed && more) {  // the next chunk at once; a request in between goes first
        more = trim_once();
        continue;
      }
      const bool idle = callbacks_.idle && callbacks_.idle_period.count() > 0;
      const bool over_cap = ledger_.over_cap(member_) > 0;
      std::chrono::milliseconds wait = idle ? callbacks_.idle_period : std::chrono::milliseconds(1000);
      if (pressed) wait = std::min(wait, kTrimPoll);
      if (over_cap) wait = std::min(wait, kCapPoll);
      futex_wait(segment.requests, seen, wait);
      if (stopping_.load() || segment.requests.load() != seen) continue;
      if (over_cap) {
        give_over_cap();
      } else if (pressed) {
        more = trim_once();
      } else if (idle) {
        try {
          callbacks_.idle();
        } catch (const std::exception& error) {
          log_debug(concat("shared budget '", name_, "': giving pages back when idle failed: ", error.what()));
        }
      }
      continue;
    }
    seen = request;
    if (answer(request) && trims) {
      pressure_until = Clock::now() + callbacks_.pressure_period;
      more = true;
    }
  }
}

bool BudgetMembership::trim_once() noexcept {
  try {
    return callbacks_.trim();
  } catch (const std::exception& error) {
    log_debug(concat("shared budget '", name_, "': giving pages back under pressure failed: ", error.what()));
    return false;
  }
}

bool BudgetMembership::answer(std::uint32_t request) noexcept {
  bool asked = false;
  std::size_t given = 0;
  try {
    const std::size_t given_before = ledger_.given_bytes(member_);
    const std::size_t pledged = pledge_after_lower_priorities(asked);
    if (pledged > 0) callbacks_.give_back(pledged);
    given = ledger_.given_bytes(member_) - given_before;
  } catch (const std::exception& error) {
    log_debug(concat("shared budget '", name_, "': giving pages back failed: ", error.what()));
  }
  ledger_.answered(member_, request, given, asked);
  return asked;
}

std::size_t BudgetMembership::pledge_after_lower_priorities(bool& asked) {
  // Lower priorities give first: while one that could give has not answered the latest
  // request, wait (bounded as an ask is: a member that cannot run is not waited for, nor
  // one slower than kAskTimeoutRunning), then pledge what they left.
  const BudgetSegment& segment = ledger_.segment();
  const auto deadline = std::chrono::steady_clock::now() + kAskTimeoutRunning;
  for (;;) {
    const std::uint32_t releases = segment.releases.load();
    const auto now = std::chrono::steady_clock::now();
    const bool may_wait = now < deadline && !stopping_.load();
    bool deferred = false;
    std::uint64_t wanted = 0;
    const std::size_t pledged =
        ledger_.pledge(member_, callbacks_.cached_bytes(), &wanted, may_wait ? &deferred : nullptr);
    if (!deferred) {
      asked = wanted > 0;
      return pledged;
    }
    futex_wait(segment.releases, releases, std::min<std::chrono::nanoseconds>(deadline - now, kReapPeriod));
  }
}

void BudgetMembership::give_over_cap() noexcept {
  // Only what is above the cap: an ask of the others is answered in its turn. While its
  // requests claim all of it, each poll costs a look at the cache, not the budget's lock.
  std::size_t pledged = 0;
  try {
    const std::size_t can_give = std::min(callbacks_.cached_bytes(), ledger_.over_cap(member_));
    if (can_give == 0) return;
    pledged = ledger_.pledge(member_, can_give);
    if (pledged > 0) callbacks_.give_back(pledged);
  } catch (const std::exception& error) {
    log_debug(concat("shared budget '", name_, "': giving pages back above the cap failed: ", error.what()));
  }
  ledger_.end_pledge(member_);
}

}  // namespace vkv::detail
