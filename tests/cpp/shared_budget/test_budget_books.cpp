// The books' totals and the moves of bytes between them (budget_books.h): a member's free
// capacity leaves out the others' floors' gaps, bytes that come back go to the askers'
// reservation first, the reservation serves higher priorities first, an unwanted one is
// free capacity, `used` is recounted from the rows rather than wrapped, and a short
// capacity or a member above its cap calls for give-backs.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include "budget_testing.h"
#include "shared_budget/budget_books.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

// Books of 100 bytes with rows written by hand: the books look at a row's pid only to
// tell a live row from a free one.
class SharedBudgetBooksTest : public ::testing::Test {
 protected:
  detail::BudgetMemberRecord& member(std::size_t index, std::uint64_t held, std::uint64_t floor = 0,
                                     std::uint32_t priority = 0) {
    detail::BudgetMemberRecord& row = local_.row(index);
    row.pid = 1;
    row.held = held;
    row.floor = floor;
    row.priority = priority;
    local_.get().used += held;
    return row;
  }
  detail::BudgetSegment& segment() { return local_.get(); }

  LocalSegment local_{100};
  detail::BudgetBooks books_{local_.get()};
};

TEST_F(SharedBudgetBooksTest, AMembersFreeCapacityLeavesOutTheOthersFloorsGaps) {
  member(0, 20);
  member(1, 10, /*floor=*/25);  // 15 of its floor not held
  EXPECT_EQ(books_.floor_gaps(detail::BudgetSegment::kMaxMembers), 15u);
  EXPECT_EQ(books_.floors_total(detail::BudgetSegment::kMaxMembers), 25u);
  EXPECT_EQ(books_.free_for(0), 100u - 30 - 15);
  EXPECT_EQ(books_.free_for(1), 100u - 30);  // its own gap is its to take
  segment().used = 95;
  EXPECT_EQ(books_.free_for(0), 0u);  // never below zero
}

TEST_F(SharedBudgetBooksTest, BytesThatComeBackGoToTheAskersReservationFirst) {
  detail::BudgetMemberRecord& giver = member(0, 60);
  detail::BudgetMemberRecord& asker = member(1, 0);
  asker.wanted = 20;
  EXPECT_EQ(books_.wanted_total(), 20u);
  giver.held -= 30;
  books_.return_bytes(30);
  EXPECT_EQ(segment().reserved.load(), 20u);  // what the asker wants; the rest is free
  EXPECT_EQ(segment().used.load(), 30u + 20);
  asker.wanted = 0;  // the ask ended without taking it
  books_.fit_reservation();
  EXPECT_EQ(segment().reserved.load(), 0u);
  EXPECT_EQ(segment().used.load(), 30u);
}

// Bytes that come back are not reserved where they would take a floor's gap of a member
// not asking: that member may take them without asking.
TEST_F(SharedBudgetBooksTest, TheReservationLeavesTheFloorsOfMembersNotAskingFree) {
  detail::BudgetMemberRecord& giver = member(0, 90);
  member(1, 0, /*floor=*/20);
  detail::BudgetMemberRecord& asker = member(2, 0);
  asker.wanted = 30;
  giver.held -= 30;
  books_.return_bytes(30);
  EXPECT_EQ(segment().reserved.load(), 20u);  // 100 less 60 held less the floor's 20
  EXPECT_EQ(segment().used.load(), 80u);
  EXPECT_EQ(books_.free_for(1), 20u);  // the other 10 came back free: its floor's
  EXPECT_EQ(books_.free_for(2), 0u);
}

TEST_F(SharedBudgetBooksTest, TheReservationServesHigherPrioritiesFirst) {
  member(0, 50);
  detail::BudgetMemberRecord& low = member(1, 0, 0, /*priority=*/1);
  detail::BudgetMemberRecord& high = member(2, 0, 0, /*priority=*/2);
  low.wanted = 15;
  high.wanted = 10;
  segment().reserved = 20;
  segment().used += 20;
  EXPECT_EQ(books_.wanted_above(1), 10u);
  EXPECT_EQ(books_.wanted_above(2), 0u);
  EXPECT_EQ(books_.reserved_for(1), 10u);
  EXPECT_EQ(books_.reserved_for(2), 20u);
  high.wanted = 25;
  EXPECT_EQ(books_.reserved_for(1), 0u);
}

// `used` off (a process killed mid-change, a stray write) is added up from the rows: by
// recount(), and by a return that would wrap it.
TEST_F(SharedBudgetBooksTest, UsedIsRecountedFromTheRowsRatherThanWrapped) {
  member(0, 10);
  member(1, 20);
  segment().reserved = 5;
  segment().used = 1234;
  books_.recount();
  EXPECT_EQ(segment().used.load(), 35u);
  detail::BudgetMemberRecord& row = local_.row(0);
  row.held -= 8;
  segment().used = 3;  // less than the 8 coming back
  books_.return_bytes(8);
  EXPECT_EQ(segment().used.load(), 2u + 20 + 5);
}

TEST_F(SharedBudgetBooksTest, AShortCapacityOrAMemberAboveItsCapCallsForGiveBacks) {
  detail::BudgetMemberRecord& row = member(0, 90);
  const std::uint32_t requests = segment().requests;
  EXPECT_FALSE(books_.request_if_short());
  EXPECT_EQ(segment().requests.load(), requests);
  detail::BudgetMemberRecord& floored = member(1, 0, /*floor=*/20);  // 10 short of its floor
  EXPECT_EQ(books_.shortfall_beyond_wanted(), 10u);
  EXPECT_TRUE(books_.request_if_short());
  EXPECT_EQ(segment().requests.load(), requests + 1);
  floored.wanted = 10;  // a floor's gap of a member that asks is its ask, not a shortfall
  EXPECT_EQ(books_.shortfall_beyond_wanted(), 0u);
  floored.wanted = 0;
  floored.floor = 0;
  row.cap = 80;
  EXPECT_TRUE(books_.request_if_short());
  EXPECT_EQ(segment().requests.load(), requests + 2);
}

}  // namespace
}  // namespace vkv
