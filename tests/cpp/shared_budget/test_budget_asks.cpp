// Asking and answering (budget_asks.h): an ask is posted within its cap, givers pledge what
// is asked and not promised, the asker stops at the reservation or every answer and takes
// what was given; a member short of pages gets the others' unclaimed ones (never a claimed
// page, never below a floor), the lowest priorities give first, and what is given back
// goes to the askers of higher priority first.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "budget_testing.h"
#include "shared_budget/budget_asks.h"
#include "shared_budget/member_holdings.h"
#include "shared_budget/member_registry.h"
#include "shared_budget/member_row.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

class SharedBudgetAsksCacheTest : public SharedBudgetCacheTest {};

TEST_P(SharedBudgetAsksCacheTest, AMemberShortOfPagesGetsTheOthersUnclaimedOnes) {
  auto a = member();
  auto b = member();
  const std::size_t first = a->alloc_reqid();
  const std::size_t second = a->alloc_reqid();
  a->step(lens({{first, tokens(3)}, {second, tokens(5)}}));
  write_tokens(*a, first, 0, tokens(3), testing::mark(7));
  a->free_reqid(second);  // 5 pages per region cached (deferred reclamation)
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(5)}}));  // a gives its cached pages back
  EXPECT_EQ(a->stats().pages_created, 3 * regions());
  EXPECT_EQ(b->stats().pages_in_use, 5 * regions());
  expect_tokens(*a, first, 0, tokens(3), testing::mark(7));  // a's request keeps its tokens
  expect_books_add_up({a.get(), b.get()});
}

TEST_P(SharedBudgetAsksCacheTest, ClaimedPagesAreNeverGivenAway) {
  auto a = member();
  auto b = member();
  const std::size_t held = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{held, tokens(5)}, {freed, tokens(2)}}));
  write_tokens(*a, held, 0, tokens(5), testing::mark(3));
  a->free_reqid(freed);
  const std::size_t slot = b->alloc_reqid();
  try {
    b->step(lens({{slot, tokens(4)}}));  // 1 page per region free, 2 cached in a: 1 short
    FAIL() << "a member got pages a request claims";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), regions());
  }
  EXPECT_EQ(b->stats().pages_in_use, 0u);
  EXPECT_EQ(a->stats().pages_in_use, 5 * regions());
  expect_tokens(*a, held, 0, tokens(5), testing::mark(3));
  b->step(lens({{slot, tokens(3)}}));  // what can be had is had
  expect_books_add_up({a.get(), b.get()});
}

// The asker asks for the next prompt's pages too (at most what it is short of) without
// waiting for them: what it does not use waits in its pool or in the free capacity, and
// the next admission of a burst asks nobody.
TEST_P(SharedBudgetAsksCacheTest, AnAskBringsTheNextPromptsPagesToo) {
  auto a = member();
  auto b = member();
  const std::size_t warm = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}}));  // b's prompts are 1 page long (eager allocation's estimate)
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{freed, tokens(7)}}));
  a->free_reqid(freed);  // the rest of the budget cached in a: plenty
  const std::size_t first = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}, {first, tokens(1)}}));
  EXPECT_EQ(b->stats().budget_asks.calls, 1u);
  EXPECT_EQ(a->stats().pages_created, 5 * regions());  // 1 short, 1 more for the next prompt
  // b waited for the one it needed; the other came to it or, after its wait, to the free capacity.
  EXPECT_GE(b->stats().budget_asks.units, 1 * regions());
  EXPECT_LE(b->stats().budget_asks.units, 2 * regions());
  const std::size_t second = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}, {first, tokens(1)}, {second, tokens(1)}}));
  EXPECT_EQ(b->stats().budget_asks.calls, 1u);  // no second ask
  EXPECT_EQ(b->stats().pages_in_use, 3 * regions());
  expect_books_add_up({a.get(), b.get()});
}

// Where the others cache little (they are busy too), the asker asks for what it is short
// of only: taking more would make them ask it back.
TEST_P(SharedBudgetAsksCacheTest, AnAskTakesNoHeadroomFromMembersThatCacheLittle) {
  auto a = member();
  auto b = member();
  const std::size_t warm = b->alloc_reqid();
  b->step(lens({{warm, tokens(2)}}));
  const std::size_t kept = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{kept, tokens(3)}, {freed, tokens(3)}}));
  a->free_reqid(freed);  // 3 cached: less than twice 2 short + 2 headroom
  const std::size_t first = b->alloc_reqid();
  b->step(lens({{warm, tokens(2)}, {first, tokens(2)}}));
  EXPECT_EQ(a->stats().pages_created, 4 * regions());  // gave the 2 missing, no more
  expect_books_add_up({a.get(), b.get()});
}

// A higher-priority asker takes a lower member's unclaimed pages down to its floor, never
// below: the asker gets the rest of what it wants nowhere, and raises OutOfMemory.
TEST(SharedBudgetAsksTest, AnAskFromAHigherPriorityStopsAtTheOthersFloor) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess low([&] { hold(guaranteed_config(name, /*floor=*/12), 4, 20); });
  ASSERT_TRUE(low.started());
  KvCache high(guaranteed_config(name, 0, 0, /*priority=*/1));
  const std::size_t slot = high.alloc_reqid();
  try {
    step_to(high, slot, 28);  // 8 free, 12 of low's 20 cached above its floor
    FAIL() << "an ask took a member below its floor";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 8u);
  }
  EXPECT_EQ(member_of(budget.stats(), low.pid()).held_bytes, pages(12));
  step_to(high, slot, 20);
  EXPECT_EQ(member_of(budget.stats(), low.pid()).held_bytes, pages(12));
  high.check_invariants();
}

// Members of lower priority give back first: a member of higher priority gives only what
// the lower ones could not.
TEST(SharedBudgetAsksTest, LowerPrioritiesGiveBackFirst) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess low([&] { hold(guaranteed_config(name, 0, 0, /*priority=*/0), 2, 10); });
  MemberProcess middle([&] { hold(guaranteed_config(name, 0, 0, /*priority=*/1), 2, 10); });
  ASSERT_TRUE(low.started() && middle.started());
  KvCache asker(guaranteed_config(name, 0, 0, /*priority=*/2));
  const std::size_t slot = asker.alloc_reqid();
  step_to(asker, slot, 16);  // 8 free, 8 asked for: low's
  SharedBudgetStats stats = budget.stats();
  EXPECT_EQ(member_of(stats, low.pid()).held_bytes, pages(4));
  EXPECT_EQ(member_of(stats, middle.pid()).held_bytes, pages(12));
  step_to(asker, slot, 24);  // 8 more: low's last 2, then 6 of middle's
  stats = budget.stats();
  EXPECT_EQ(member_of(stats, low.pid()).held_bytes, pages(2));
  EXPECT_EQ(member_of(stats, middle.pid()).held_bytes, pages(6));
  // The counters people watch (python -m vkv.budget top); an answer is counted once the
  // answerer is done, which may be after the asker went on.
  EXPECT_TRUE(testing::wait_until([&] {
    stats = budget.stats();
    return member_of(stats, low.pid()).give_backs == 2 && member_of(stats, middle.pid()).give_backs == 1;
  }));
  EXPECT_EQ(member_of(stats, middle.pid()).given_bytes, pages(6));
  EXPECT_EQ(member_of(stats, getpid()).asks, 2u);
  EXPECT_GE(member_of(stats, middle.pid()).since_answer_ns, 0);
  EXPECT_EQ(member_of(stats, getpid()).since_answer_ns, -1);  // nobody else asked
  asker.check_invariants();
}

// What members give back goes to the askers of higher priority first.
TEST(SharedBudgetAsksTest, GivenBackBytesGoToTheHigherPriorityAskerFirst) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 10 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t giver = ledger.join(1 << 20);
  const std::size_t low = ledger.join(1 << 20, {0, 0, 1});
  const std::size_t high = ledger.join(1 << 20, {0, 0, 2});
  ASSERT_TRUE(ledger.acquire(giver, 10 << 20));
  ledger.ask(low, 4 << 20);
  ledger.ask(high, 4 << 20);
  ledger.release(giver, 4 << 20);
  EXPECT_EQ(ledger.claim_reserved(low), 0u);  // the high asker's
  EXPECT_EQ(ledger.claim_reserved(high), std::size_t{4} << 20);
  for (const std::size_t member : {giver, low, high}) ledger.leave(member);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetAsksCacheTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

// ---- asks alone, on a segment in this process's memory -----------------------------------

// Members of this process, in one budget of 10 pages: every one alive and running.
class SharedBudgetAsksDirectTest : public ::testing::Test {
 protected:
  std::size_t member(std::size_t held_pages, const detail::MemberLimits& limits = {}) {
    const std::size_t row = registry_.join(kPage, limits);
    EXPECT_TRUE(holdings_.acquire(row, pages(held_pages)));
    return row;
  }

  LocalSegment local_{pages(10)};
  detail::MemberRegistry registry_{local_.get()};
  detail::MemberHoldings holdings_{local_.get()};
  detail::BudgetAsks asks_{local_.get()};
};

TEST_F(SharedBudgetAsksDirectTest, AnAskIsPostedAndCountedUnlessItsCapRefusesIt) {
  const std::size_t giver = member(4);
  const std::size_t asker = member(2);
  const std::size_t capped = member(3, {0, pages(5), 0});  // 1 page free
  EXPECT_EQ(asks_.others_cached(asker), pages(4 + 3));     // nothing claimed: everything could go
  holdings_.publish_in_use(giver, pages(3));
  EXPECT_EQ(asks_.others_cached(asker), pages(1 + 3));
  EXPECT_EQ(asks_.ask(asker, pages(4)), 1u);
  EXPECT_EQ(local_.row(asker).wanted, pages(4));
  EXPECT_EQ(local_.row(asker).asks.load(), 1u);
  // Its cap leaves it 2 pages, 1 of them free: asking could bring 1, not the 2 it needs.
  EXPECT_EQ(asks_.ask(capped, pages(2), pages(2)), 1u);
  EXPECT_EQ(local_.row(capped).wanted, 0u);
  EXPECT_EQ(asks_.ask(capped, pages(2)), 2u);
  EXPECT_EQ(local_.row(capped).wanted, pages(1));
}

// A giver pledges what is asked and not promised yet, never below its floor, and what it
// holds above its cap whoever asks; its answer ends the pledge and records the request.
TEST_F(SharedBudgetAsksDirectTest, APledgeCoversWhatIsAskedAndNotPromisedAboveTheFloor) {
  const std::size_t floored = member(4, {pages(3), 0, 0});
  const std::size_t other = member(4);
  const std::size_t asker = member(2);
  const std::uint32_t request = asks_.ask(asker, pages(3));
  std::uint64_t asked = 0;
  EXPECT_EQ(asks_.pledge(floored, pages(4), &asked), pages(1));  // its floor keeps 3
  EXPECT_EQ(asked, pages(3));
  EXPECT_EQ(asks_.pledge(other, pages(4)), pages(2));  // 1 promised already
  EXPECT_EQ(asks_.pledge(other, pages(4)), 0u);
  EXPECT_TRUE(detail::owes_answer(local_.row(other), request));
  asks_.answered(other, request, pages(2), /*asked=*/true);
  EXPECT_EQ(local_.row(other).pledged, 0u);
  EXPECT_EQ(asks_.last_answered(other), request);
  EXPECT_EQ(local_.row(other).give_backs.load(), 1u);
  EXPECT_NE(local_.row(other).last_answer_ns.load(), 0);
  local_.row(asker).wanted = 0;  // the ask ended
  local_.row(other).cap = pages(2);
  EXPECT_EQ(asks_.pledge(other, pages(4), &asked), pages(2));  // above its cap: its own to give, unasked
  EXPECT_EQ(asked, 0u);
  asks_.end_pledge(other);
  EXPECT_EQ(local_.row(other).pledged, 0u);
}

// The asker stops waiting once what was given back for it covers enough, or everyone
// answered; it then takes what was given, up to what it wanted.
TEST_F(SharedBudgetAsksDirectTest, AnAskIsSettledByTheReservationOrByEveryAnswer) {
  const std::size_t giver = member(8);
  const std::size_t asker = member(2);
  const std::uint32_t request = asks_.ask(asker, pages(3));
  EXPECT_FALSE(asks_.ask_settled(asker, request, pages(2)));
  EXPECT_FALSE(asks_.all_answered(request, asker));
  EXPECT_TRUE(asks_.answer_may_come(request, asker));  // the giver can still run
  EXPECT_EQ(asks_.pledge(giver, pages(8)), pages(3));
  holdings_.release(giver, pages(2));
  EXPECT_TRUE(asks_.ask_settled(asker, request, pages(2)));
  EXPECT_FALSE(asks_.ask_settled(asker, request, pages(3)));
  asks_.answered(giver, request, pages(2), true);
  EXPECT_TRUE(asks_.all_answered(request, asker));
  EXPECT_TRUE(asks_.ask_settled(asker, request, pages(3)));
  EXPECT_FALSE(asks_.answer_may_come(request, asker));
  EXPECT_EQ(asks_.claim_reserved(asker), pages(2));
  EXPECT_EQ(holdings_.held(asker), pages(4));
  EXPECT_EQ(local_.row(asker).wanted, 0u);
  EXPECT_EQ(local_.get().reserved.load(), 0u);
  EXPECT_EQ(local_.get().used.load(), pages(10));
}

// A member answers only once the members of lower priority that could give have answered.
TEST_F(SharedBudgetAsksDirectTest, AHigherPriorityWaitsForTheLowerOnesToAnswer) {
  const std::size_t low = member(3, {0, 0, 1});
  const std::size_t high = member(3, {0, 0, 2});
  const std::size_t asker = member(2, {0, 0, 3});
  const std::uint32_t request = asks_.ask(asker, pages(4));
  bool deferred = false;
  EXPECT_EQ(asks_.pledge(high, pages(3), nullptr, &deferred), 0u);
  EXPECT_TRUE(deferred);
  EXPECT_EQ(asks_.pledge(low, pages(3), nullptr, &deferred), pages(3));
  EXPECT_FALSE(deferred);
  holdings_.release(low, pages(3));
  asks_.answered(low, request, pages(3), true);
  EXPECT_EQ(asks_.pledge(high, pages(3), nullptr, &deferred), pages(1));
  EXPECT_FALSE(deferred);
  EXPECT_EQ(asks_.given_bytes(low), pages(3));
}

}  // namespace
}  // namespace vkv
