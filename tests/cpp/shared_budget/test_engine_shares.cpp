// Engines that answer for their members (vLLM's scheduler for its worker's blocks): the share
// the budget wants of each (SharedBudget::speak_for, share_of) gives an ask's bytes lowest
// priority first, never below a floor, no more than asked, equal priorities keeping equal
// spare; an engine short only of its own cap asks nobody; free capacity is taken before
// anyone gives; a dead speaker's ask costs nobody a byte; a cap or resize is given from the
// spare; what is given back for a standing ask is the asker's to take; and a give settled
// before its pages are back stays promised.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "budget_testing.h"
#include "shared_budget/budget_ledger.h"
#include "shared_budget/engine_shares.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

constexpr std::size_t kPage = 1 << 20;
constexpr std::size_t pages(std::size_t count) { return count * kPage; }

class SharedBudgetEngineSharesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    name_ = "test-shares-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  void TearDown() override { SharedBudget::remove(name_); }

  // A budget of `capacity` pages; members join through the ledger (one row each, all in
  // this process: the speaker is this process too).
  SharedBudget create(std::size_t capacity) {
    SharedBudget budget = SharedBudget::create(name_, pages(capacity), Device{Device::Kind::host, 0});
    mapping_ = std::make_unique<detail::SharedMapping>(detail::open_budget_object(name_));
    ledger_ = std::make_unique<detail::BudgetLedger>(*static_cast<detail::BudgetSegment*>(mapping_->data()), name_);
    return budget;
  }
  // A member labelled `label` holding `held` pages.
  std::size_t member(const std::string& label, std::size_t held, detail::MemberLimits limits = {}) {
    const std::size_t row = ledger_->join(kPage, limits, label);
    EXPECT_TRUE(ledger_->acquire(row, pages(held)));
    return row;
  }
  detail::BudgetLedger& ledger() { return *ledger_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::unique_ptr<detail::SharedMapping> mapping_;
  std::unique_ptr<detail::BudgetLedger> ledger_;
};

SharedBudgetReport report(std::size_t spare_pages, std::size_t ask_pages = 0) {
  SharedBudgetReport values;
  values.spare_bytes = pages(spare_pages);
  values.ask_bytes = pages(ask_pages);
  return values;
}

// An engine that needs 65 pages gets them from the priority-0 engine; the priority-9 one
// keeps all it has (its prefix cache survives an ask it need not pay for).
TEST_F(SharedBudgetEngineSharesTest, AnAskIsGivenByTheLowestPriorityAndNoMoreThanAsked) {
  SharedBudget budget = create(1000);
  member("low", 300, {0, 0, 0});
  member("high", 300, {0, 0, 9});
  member("asker", 400, {0, 0, 5});
  budget.speak_for("low", report(290));
  budget.speak_for("high", report(290));
  const SharedBudgetShare asking = budget.speak_for("asker", report(0, 65));
  EXPECT_EQ(asking.asking_bytes, pages(65));
  EXPECT_EQ(asking.give_bytes, 0u);
  EXPECT_EQ(budget.share_of("low").give_bytes, pages(65));
  EXPECT_EQ(budget.share_of("high").give_bytes, 0u);
  EXPECT_EQ(budget.share_of("low").open_bytes, pages(65));
}

// An engine's given blocks are released (settled) before their pages come back (they wait
// for the forwards that read them): what is on its way back stays promised, so the ask does
// not open again and nobody gives twice; once the pages are back the promise is kept.
TEST_F(SharedBudgetEngineSharesTest, AGiveSettledBeforeItsPagesAreBackIsNotAskedAgain) {
  SharedBudget budget = create(1000);
  const std::size_t low = member("low", 300);
  const std::size_t asker = member("asker", 700);  // nothing free
  ledger().publish_in_use(low, pages(300));
  budget.speak_for("low", report(290));
  budget.speak_for("asker", report(0, 65));
  ASSERT_EQ(budget.share_of("low").give_bytes, pages(65));
  SharedBudgetReport gave = report(225);
  gave.given_bytes = pages(65);
  budget.speak_for("low", gave);
  ledger().publish_in_use(low, pages(235));  // released: 65 pages pending, still held
  EXPECT_EQ(budget.share_of("low").give_bytes, 0u);
  SharedBudgetReport settled = report(225);
  settled.settled = true;  // the next step sees every given block released
  budget.speak_for("low", settled);
  EXPECT_EQ(budget.share_of("low").give_bytes, 0u);
  EXPECT_EQ(budget.share_of("low").open_bytes, 0u);
  ledger().release(low, pages(65));  // the pages come back: the asker's to take
  EXPECT_EQ(budget.share_of("low").give_bytes, 0u);
  EXPECT_TRUE(ledger().acquire(asker, pages(65)));
  budget.speak_for("asker", report(0, 0));
  EXPECT_EQ(budget.share_of("low").give_bytes, 0u);
}

// The lower priority gives all it can spare; the next one gives only the rest.
TEST_F(SharedBudgetEngineSharesTest, TheNextPriorityGivesOnlyWhatTheLowerCouldNot) {
  SharedBudget budget = create(1000);
  member("low", 300, {0, 0, 0});
  member("high", 300, {0, 0, 9});
  member("asker", 400, {0, 0, 5});
  budget.speak_for("low", report(40));
  budget.speak_for("high", report(290));
  budget.speak_for("asker", report(0, 65));
  EXPECT_EQ(budget.share_of("low").give_bytes, pages(40));
  EXPECT_EQ(budget.share_of("high").give_bytes, pages(25));
}

// A floor of 300 pages: an engine holding 322 gives 22 at most, whatever is asked.
TEST_F(SharedBudgetEngineSharesTest, AFloorIsNeverGivenAway) {
  SharedBudget budget = create(1000);
  member("floored", 322, {pages(300), 0, 0});
  member("asker", 678);
  budget.speak_for("floored", report(320));
  budget.speak_for("asker", report(0, 200));
  EXPECT_EQ(budget.share_of("floored").give_bytes, pages(22));
}

// An engine short only because of its own cap asks nobody; free capacity covers an ask
// before anyone gives.
TEST_F(SharedBudgetEngineSharesTest, OnlyRealAsksCost) {
  SharedBudget budget = create(1000);
  member("idle", 300);
  member("capped", 100, {0, pages(100), 0});
  budget.speak_for("idle", report(290));
  EXPECT_EQ(budget.speak_for("capped", report(0, 65)).asking_bytes, 0u);
  EXPECT_EQ(budget.share_of("idle").give_bytes, 0u);
  member("free", 100);  // 500 pages still free
  const SharedBudgetShare asking = budget.speak_for("free", report(0, 65));
  EXPECT_EQ(asking.asking_bytes, pages(65));
  EXPECT_EQ(asking.open_bytes, 0u);
  EXPECT_EQ(budget.share_of("idle").give_bytes, 0u);
}

// Equal priorities give so that each keeps the same spare: 400 and 300 spare, 200 asked:
// 150 and 50, both keeping 250. Each computes its part alone, before or after the other
// gave: the parts stay the same.
TEST_F(SharedBudgetEngineSharesTest, EqualPrioritiesKeepEqualSpareWhoeverGivesFirst) {
  SharedBudget budget = create(1000);
  const std::size_t first = member("first", 410);
  member("second", 310);
  member("asker", 280);
  budget.speak_for("first", report(400));
  budget.speak_for("second", report(300));
  budget.speak_for("asker", report(0, 200));
  EXPECT_EQ(budget.share_of("first").give_bytes, pages(150));
  EXPECT_EQ(budget.share_of("second").give_bytes, pages(50));
  // The first gives its part (promised at its step, released by its worker after).
  SharedBudgetReport gave = report(250);
  gave.given_bytes = pages(150);
  EXPECT_EQ(budget.speak_for("first", gave).give_bytes, 0u);
  EXPECT_EQ(budget.share_of("second").give_bytes, pages(50));
  ledger().release(first, pages(150));
  EXPECT_EQ(budget.share_of("first").give_bytes, 0u);
  EXPECT_EQ(budget.share_of("second").give_bytes, pages(50));
  EXPECT_EQ(budget.stats().reserved_bytes, pages(150));  // the asker's
}

// What is given back for a standing ask is the asker's: its worker's next acquire takes it
// (and the free hint counts it), and the ask closes as it holds more.
TEST_F(SharedBudgetEngineSharesTest, AStandingAsksReservationIsTheAskersToTake) {
  SharedBudget budget = create(1000);
  const std::size_t giver = member("giver", 500);
  const std::size_t asker = member("asker", 500);
  budget.speak_for("giver", report(400));
  budget.speak_for("asker", report(0, 100));
  SharedBudgetReport gave = report(300);
  gave.given_bytes = pages(100);
  budget.speak_for("giver", gave);
  ledger().release(giver, pages(100));
  EXPECT_EQ(ledger().free_hint(asker), pages(100));
  EXPECT_EQ(ledger().acquire_up_to(asker, pages(100), kPage), pages(100));
  EXPECT_EQ(budget.share_of("asker").asking_bytes, 0u);
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);
  EXPECT_EQ(budget.share_of("giver").give_bytes, 0u);
}

// An all-or-nothing acquire larger than the reservation takes the reservation and free
// capacity together (a block layer backing the whole ask in one map).
TEST_F(SharedBudgetEngineSharesTest, AnAcquireTakesTheReservationAndFreeCapacityTogether) {
  SharedBudget budget = create(1000);
  const std::size_t giver = member("giver", 900);
  const std::size_t asker = member("asker", 80);
  budget.speak_for("giver", report(800));
  budget.speak_for("asker", report(0, 100));  // 20 free, 80 more wanted
  SharedBudgetReport gave = report(720);
  gave.given_bytes = pages(80);
  budget.speak_for("giver", gave);
  ledger().release(giver, pages(80));
  EXPECT_EQ(budget.share_of("asker").room_bytes, pages(100));
  EXPECT_FALSE(ledger().acquire(asker, pages(101)));  // nothing taken
  EXPECT_EQ(budget.stats().reserved_bytes, pages(80));
  EXPECT_TRUE(ledger().acquire(asker, pages(100)));
  EXPECT_EQ(budget.stats().reserved_bytes, 0u);
  EXPECT_EQ(budget.stats().used_bytes, pages(1000));
  EXPECT_EQ(budget.share_of("asker").asking_bytes, 0u);
}

// A cap set below what an engine holds is given from its spare; a resize below what is
// used is given lowest priority first.
TEST_F(SharedBudgetEngineSharesTest, ACapAndAResizeAreGivenFromTheSpare) {
  SharedBudget budget = create(1000);
  const std::size_t capped = member("capped", 250);
  member("other", 300, {0, 0, 1});
  budget.speak_for("capped", report(240));
  budget.speak_for("other", report(290));
  // (set_limits() sets every member of a pid: these rows are all this process's)
  ledger().segment().members[capped].cap.store(pages(150));
  EXPECT_EQ(budget.share_of("capped").give_bytes, pages(100));
  EXPECT_EQ(budget.share_of("other").give_bytes, 0u);
  ledger().segment().members[capped].cap.store(0);
  ledger().resize(pages(450));                                  // 100 over
  EXPECT_EQ(budget.share_of("capped").give_bytes, pages(100));  // priority 0 first
  EXPECT_EQ(budget.share_of("other").give_bytes, 0u);
  ledger().release(capped, pages(100));
  EXPECT_EQ(budget.share_of("capped").give_bytes, 0u);
}

// An engine whose scheduler was SIGKILLed asks nobody any more, at once.
TEST_F(SharedBudgetEngineSharesTest, ADeadSpeakersAskIsDropped) {
  SharedBudget budget = create(1000);
  member("giver", 500);
  member("asker", 500);
  budget.speak_for("giver", report(400));
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    SharedBudget::open(name()).speak_for("asker", report(0, 100));
    const char byte = 1;
    static_cast<void>(write(ready[1], &byte, 1));
    pause();
    _exit(0);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  EXPECT_EQ(budget.share_of("giver").give_bytes, pages(100));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(budget.share_of("giver").give_bytes, 0u);
  EXPECT_EQ(budget.stats().members[1].wanted_bytes, 0u);
}

// A member killed with SIGKILL and not yet counted out holds bytes: an engine with no room
// counts it out when it asks for its share, and finds its bytes free.
TEST_F(SharedBudgetEngineSharesTest, ADeadMembersBytesAreRoomAtTheNextShare) {
  SharedBudget budget = create(1000);
  member("engine", 500);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    detail::SharedMapping mapping = detail::open_budget_object(name());
    detail::BudgetLedger ledger(*static_cast<detail::BudgetSegment*>(mapping.data()), name());
    const std::size_t row = ledger.join(kPage, {}, "dead");
    static_cast<void>(ledger.acquire(row, pages(500)));
    const char byte = 1;
    static_cast<void>(write(ready[1], &byte, 1));
    pause();
    _exit(0);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  EXPECT_EQ(budget.share_of("engine").room_bytes, 0u);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  // (Another handle: a handle looks for the dead at most every 20 ms.)
  EXPECT_EQ(SharedBudget::open(name()).speak_for("engine", report(0)).room_bytes, pages(500));
}

// A speaker's thread sleeps in wait_for_request() until an ask opens: no polling.
TEST_F(SharedBudgetEngineSharesTest, AnOpenAskWakesAWaitingSpeaker) {
  SharedBudget budget = create(1000);
  member("giver", 500);
  member("asker", 500);
  budget.speak_for("giver", report(400));
  const std::uint32_t seen = budget.requests();
  std::atomic<std::uint32_t> woken{seen};
  std::thread waiter([&] { woken = budget.wait_for_request(seen, std::chrono::seconds(10)); });
  budget.speak_for("asker", report(0, 100));
  waiter.join();
  EXPECT_NE(woken.load(), seen);
  EXPECT_EQ(budget.wait_for_request(budget.requests(), std::chrono::milliseconds(1)), budget.requests());
}

// The share arithmetic alone (engine_shares.h), on a segment in this process's memory: what
// the asks lack beyond the free capacity is open; the lowest priority covers it as far as
// its floor lets it, the next one gives the rest; an asker gives nothing and its room is
// the free capacity.
TEST(SharedBudgetShareArithmeticTest, TheLowestPriorityCoversWhatTheAsksLackBeyondTheFreeCapacity) {
  const shared_budget_testing::LocalSegment local(pages(10), kPage);
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  const std::size_t low = registry.join(kPage, {0, 0, 0});
  const std::size_t high = registry.join(kPage, {0, 0, 5});
  const std::size_t asker = registry.join(kPage);
  ASSERT_TRUE(holdings.acquire(low, pages(3)));
  ASSERT_TRUE(holdings.acquire(high, pages(5)));
  local.row(asker).wanted = pages(4);
  const detail::BudgetBooks books(local.get());
  EXPECT_EQ(detail::open_asks(books), pages(2));  // 2 of the 4 are free
  EXPECT_EQ(detail::share_wanted(books, low), pages(2));
  EXPECT_EQ(detail::share_wanted(books, high), 0u);
  EXPECT_EQ(detail::share_wanted(books, asker), 0u);
  EXPECT_EQ(detail::room_of(books, asker), pages(2));
  local.row(low).floor = pages(2);  // it can give 1 now
  EXPECT_EQ(detail::share_wanted(books, low), pages(1));
  EXPECT_EQ(detail::share_wanted(books, high), pages(1));
  local.row(high).pledged = pages(1);  // a promise covers its part: 1 is left open
  EXPECT_EQ(detail::open_asks(books), pages(1));
}

}  // namespace
}  // namespace vkv
