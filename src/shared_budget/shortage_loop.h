// ShortageLoop: the one way a call that runs short of pages goes on. The attempt runs;
// while it is short, the caller's own room comes first (pages the mapper is moving, pages
// waiting for their readers), then members of a shared budget whose process is gone are
// counted out (their bytes are free at once), then the other members are asked, once per
// call; after each, the attempt runs again and plans again (a wait or an ask released the
// lock). What is still missing after that is the caller's: a shortfall it answers with
// (preparation, block backing) or the attempt's OutOfMemory (step(), resume()).
//
// Internal. Thread-safety: as BudgetClient's calls for running short: the caller holds
// the cache's mutex in `lock`, which waits and asks release and take again.
#pragma once

#include <cstddef>
#include <exception>
#include <mutex>
#include <optional>

#include "budget_client.h"
#include "vkv/error.h"

namespace vkv::detail {

class ShortageLoop {
 public:
  /// Whether a call asks the other members for what it is short of.
  enum class Asking {
    never,               // the shortfall is the call's answer (preparation): dead members are counted out only
    once,                // once per call, for what the attempt is short of
    once_with_headroom,  // once per call, and BudgetClient::ask_headroom() more (step())
  };
  /// What an attempt comes to: std::nullopt when it is done, else the pages it is short of.
  using Shortfall = std::optional<std::size_t>;
  /// A count of pages short as a Shortfall (0: done).
  static Shortfall short_by(std::size_t pages) noexcept { return pages > 0 ? Shortfall(pages) : std::nullopt; }

  /// The defaults of run(): no room of the caller's own, nothing to do after an ask.
  struct NoRoom {
    bool operator()() const noexcept { return false; }
  };
  struct Nothing {
    void operator()() const noexcept {}
  };

  /// `budget` and `lock` must outlive the loop; one loop per call (it asks once).
  ShortageLoop(BudgetClient& budget, std::unique_lock<std::mutex>& lock, Asking asking) noexcept
      : budget_(budget), lock_(lock), asking_(asking) {}

  /// Runs `attempt()` (returning a Shortfall; an OutOfMemory it throws is a shortage of
  /// its missing_pages()) until it is done or its shortage stands. `make_room()`: the
  /// caller's own way to room, tried first on every shortage; true when it made some.
  /// `after_ask()`: runs once the others were asked, before the attempt runs again.
  /// Returns std::nullopt, or the pages short when the shortage stands.
  /// @throws what the attempt, make_room() and BudgetClient::ask() throw, but OutOfMemory.
  template <typename Attempt, typename MakeRoom = NoRoom, typename AfterAsk = Nothing>
  Shortfall run(Attempt attempt, MakeRoom make_room = {}, AfterAsk after_ask = {}) {
    std::exception_ptr thrown;
    return drive(attempt, make_room, after_ask, thrown);
  }
  /// As run(), for an attempt that returns nothing and says a shortage by throwing
  /// OutOfMemory: when the shortage stands, that exception goes on to the caller.
  template <typename Attempt, typename MakeRoom = NoRoom, typename AfterAsk = Nothing>
  void run_or_throw(Attempt attempt, MakeRoom make_room = {}, AfterAsk after_ask = {}) {
    auto shortfall_of = [&attempt]() -> Shortfall {
      attempt();
      return std::nullopt;
    };
    std::exception_ptr thrown;
    if (drive(shortfall_of, make_room, after_ask, thrown)) std::rethrow_exception(thrown);
  }

 private:
  enum class Answer { reaped, asked, stands };
  // The budget's part of a shortage of `missing` pages: dead members counted out, else
  // (as `asking_` allows) the others asked, with the lock released meanwhile.
  Answer answer(std::size_t missing);

  template <typename Attempt, typename MakeRoom, typename AfterAsk>
  Shortfall drive(Attempt& attempt, MakeRoom& make_room, AfterAsk& after_ask, std::exception_ptr& thrown) {
    for (;;) {
      Shortfall missing;
      thrown = nullptr;
      try {
        missing = attempt();
      } catch (const OutOfMemory& shortage) {
        missing = shortage.missing_pages();
        thrown = std::current_exception();
      }
      if (!missing) return std::nullopt;
      if (make_room()) continue;
      switch (answer(*missing)) {
        case Answer::reaped:
          continue;
        case Answer::asked:
          after_ask();
          continue;
        case Answer::stands:
          return missing;
      }
    }
  }

  BudgetClient& budget_;
  std::unique_lock<std::mutex>& lock_;
  Asking asking_;
  bool asked_ = false;
};

}  // namespace vkv::detail
