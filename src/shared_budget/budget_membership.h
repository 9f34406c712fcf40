// A KvCache's membership in a shared budget (vkv/shared_budget.h): the account its page
// pool creates pages against, the asking when the cache runs short, and the watcher
// thread that gives pages back when another member asks.
//
//   creating pages    take()/take_up_to() draw from what the others reserved for this
//                     member (claimed by claim_reserved()), then from the free capacity
//   running short     ask() posts the shortfall and waits, with no cache lock held, until
//                     the others answered; claim_reserved() then takes what they gave
//   being asked       the watcher wakes on the budget's request counter, pledges what
//                     the cache can give (Callbacks::cached_bytes) and has the cache give
//                     it (Callbacks::give_back: free pages, then unclaimed mapped pages)
//
// Internal. Thread-safety: thread-safe. The cache calls take/give/claim/release with its
// mutex held; the watcher calls the callbacks, which take that mutex, with no lock held.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "budget_ledger.h"
#include "interprocess/shared_memory.h"
#include "page_account.h"
#include "vkv/backend.h"

namespace vkv::detail {

/// Tests only: how many of the `granted` pages a claim of `asked` keeps (the rest goes back
/// at once), so that a claim comes back shorter than available_pages() said, as it does
/// when another member takes the room first or a resize lowers it. Null (the default):
/// every page. Set it while no cache of this process creates pages.
using ShortClaimHook = std::size_t (*)(std::size_t asked, std::size_t granted);
void set_short_claim_hook_for_testing(ShortClaimHook hook) noexcept;

class BudgetMembership final : public PageAccount {
 public:
  /// What the watcher asks of the cache.
  struct Callbacks {
    std::function<std::size_t()> cached_bytes;   ///< what it could give back now
    std::function<void(std::size_t)> give_back;  ///< release up to that many bytes
    std::function<void()> idle;                  ///< called every `idle_period` with no request (may be null)
    std::chrono::milliseconds idle_period{0};
    /// Gives back one chunk unasked; returns whether more is left (may be null). Called for
    /// `pressure_period` after another member asked, between requests, every kTrimPoll
    /// while it has nothing to give; not while this member asked within `pressure_period`
    /// itself (it is short too: what it gave it would ask back).
    std::function<bool()> trim;
    std::chrono::milliseconds pressure_period{0};
  };
  /// How often a member under pressure looks for pages to give back unasked (its freed
  /// requests' pages become free once the device work reading them is done).
  static constexpr std::chrono::milliseconds kTrimPoll{2};
  /// How often an asker counts dead members out while it waits (each look reads /proc per
  /// member, under the budget's lock: not at every release it is woken for).
  static constexpr std::chrono::milliseconds kReapPeriod{10};
  /// How long an asker waits for the others' answers where the members it waits for are
  /// stopped (SIGSTOP, a debugger): such a member costs no more.
  static constexpr std::chrono::milliseconds kAskTimeout{200};
  /// How long it waits at most while one of them is alive and not stopped: on a loaded
  /// machine a watcher thread may not run for longer than kAskTimeout, and giving up then
  /// raised OutOfMemory that its answer would have spared.
  static constexpr std::chrono::milliseconds kAskTimeoutRunning{2000};

  /// How often a member above its cap (lowered at run time below what its requests claimed)
  /// looks for pages to give back down to it, as its requests finish.
  static constexpr std::chrono::milliseconds kCapPoll{10};

  /// Opens the budget `name` and joins it with `limits` and `label` (BudgetLedger::join).
  /// @throws InvalidArgument for an unknown budget, one over another device than
  /// `backend`'s, pages of another size than it can count, or limits join() refuses.
  BudgetMembership(const std::string& name, const Backend& backend, std::size_t page_bytes,
                   const MemberLimits& limits = {}, const std::string& label = "");
  /// Stops the watcher and leaves: what this member still holds is counted back.
  ~BudgetMembership() override;
  BudgetMembership(const BudgetMembership&) = delete;
  BudgetMembership& operator=(const BudgetMembership&) = delete;

  const std::string& name() const noexcept { return name_; }
  /// Starts the watcher; once, when the cache can answer.
  void start_watching(Callbacks callbacks);
  void stop_watching() noexcept;

  // ---- PageAccount -----------------------------------------------------------------
  std::size_t available_pages() const noexcept override;
  bool take(std::size_t pages) override;
  std::size_t take_up_to(std::size_t pages) override;
  void give(std::size_t pages) noexcept override;

  // ---- running short -----------------------------------------------------------------
  /// Whether asking could bring anything: the others hold pages their requests do not claim.
  bool others_may_give() const noexcept { return ledger_.others_cached(member_) > 0; }
  /// What the others hold and their requests do not claim, in pages (a hint).
  std::size_t others_cached_pages() const noexcept { return ledger_.others_cached(member_) / page_bytes_; }
  /// Counts back the bytes of members whose process is gone (SIGKILLed, crashed), so that a
  /// shortage sees them free at once; returns how many it found (0 also when the books
  /// cannot be read: the shortage is then decided without them). Reads /proc per member.
  std::size_t reap_dead() noexcept;
  /// Asks the others for `pages` and waits (kAskTimeout, or kAskTimeoutRunning while a
  /// member it waits for can still run) until what they gave
  /// covers `needed` of them or they all answered; the caller holds no lock the watcher or
  /// the mapper takes. Then claim_reserved() takes what was given by then; what comes
  /// after is free capacity. @throws Error (a broken budget).
  void ask(std::size_t pages, std::size_t needed);
  /// Ends the ask: what the others gave becomes this member's to create pages from.
  void claim_reserved() noexcept;
  /// Returns what was claimed and not used (end of the call that asked).
  void release_claimed() noexcept;

  /// Why the budget gives this member no more now, for an OutOfMemory's message.
  std::string room_text() const { return ledger_.room_text(member_); }
  /// Bytes this member's allocated slots claim, for the budget's stats.
  void publish_in_use(std::size_t bytes) noexcept { ledger_.publish_in_use(member_, bytes); }
  /// Bytes this member holds in the books (pages it created and claimed reservation).
  std::size_t held_bytes() { return ledger_.held(member_); }
  /// Bytes this member holds and its requests do not claim, as of its last published call
  /// (what the others see of it): the watcher's estimate while a call holds the cache's lock.
  std::size_t published_cached_bytes() {
    const std::size_t held = ledger_.held(member_);
    const std::size_t in_use = ledger_.segment().members[member_].in_use.load(std::memory_order_relaxed);
    return held > in_use ? held - in_use : 0;
  }
  /// Pages claimed from the others and not created yet.
  std::size_t claimed_pages() const noexcept { return claimed_pages_.load(std::memory_order_relaxed); }

 private:
  std::size_t take_claimed(std::size_t pages) noexcept;
  void watch(std::uint32_t seen) noexcept;
  // Returns whether another member (or a resize) wanted pages.
  bool answer(std::uint32_t request) noexcept;
  // Pledges once no member of lower priority that could give owes an answer; sets `asked`
  // when another member (or a resize) wanted pages.
  std::size_t pledge_after_lower_priorities(bool& asked);
  // Gives back unclaimed pages down to its cap (a cap lowered below what it holds).
  void give_over_cap() noexcept;
  // Callbacks::trim, its errors logged; returns whether more is left.
  bool trim_once() noexcept;

  std::string name_;
  SharedMapping mapping_;
  BudgetLedger ledger_;
  std::size_t page_bytes_;
  std::size_t member_ = 0;
  std::atomic<std::size_t> claimed_pages_{0};  // held in the books, not yet pages
  std::atomic<std::int64_t> last_ask_ns_{0};   // steady_clock of this member's last ask (0: none)
  Callbacks callbacks_;
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

}  // namespace vkv::detail
