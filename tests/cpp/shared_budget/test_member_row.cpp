// One member's row on its own (member_row.h): request numbers across their wrap, what a
// member could give, asks for and may still take under its cap, what its floor keeps, when
// it owes an answer, and clearing a row.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "shared_budget/member_row.h"

namespace vkv {
namespace {

using detail::BudgetMemberRecord;

// A zero-filled row, as a new budget's are.
std::unique_ptr<BudgetMemberRecord> fresh_row() { return std::make_unique<BudgetMemberRecord>(); }

TEST(SharedBudgetRowTest, RequestNumbersCompareAcrossTheirWrap) {
  EXPECT_TRUE(detail::at_or_after(7, 7));
  EXPECT_TRUE(detail::at_or_after(8, 7));
  EXPECT_FALSE(detail::at_or_after(7, 8));
  EXPECT_TRUE(detail::at_or_after(2, 0xfffffffeu));  // four requests later, past the wrap
  EXPECT_FALSE(detail::at_or_after(0xfffffffeu, 2));
}

TEST(SharedBudgetRowTest, AnAnswerIsOwedUntilGivenAndWhileAPledgeIsOpen) {
  auto row = fresh_row();
  row->answered = 3;
  EXPECT_TRUE(detail::owes_answer(*row, 4));
  EXPECT_FALSE(detail::owes_answer(*row, 3));
  EXPECT_FALSE(detail::owes_answer(*row, 2));
  row->pledged = 1;
  EXPECT_TRUE(detail::owes_answer(*row, 3));
}

// A member gives what it holds beyond what its requests claim and its floor keeps, less
// what it promised already.
TEST(SharedBudgetRowTest, AMemberGivesWhatItsClaimAndFloorDoNotKeep) {
  auto row = fresh_row();
  row->held = 10;
  row->in_use = 4;
  EXPECT_EQ(detail::giveable(*row), 6u);
  row->floor = 7;
  EXPECT_EQ(detail::giveable(*row), 3u);
  row->pledged = 2;
  EXPECT_EQ(detail::can_give(*row), 1u);
  row->pledged = 5;
  EXPECT_EQ(detail::can_give(*row), 0u);
  row->floor = 12;
  EXPECT_EQ(detail::giveable(*row), 0u);
  EXPECT_EQ(detail::floor_gap(*row), 2u);
}

// A member an engine answers for gives what its speaker said it could, above its floor; what
// its requests claim is the speaker's to know.
TEST(SharedBudgetRowTest, ASpokenForMemberGivesItsSpeakersSpareAboveItsFloor) {
  auto row = fresh_row();
  row->held = 10;
  row->in_use = 9;
  row->speaker_pid = 1;
  row->spare = 8;
  EXPECT_EQ(detail::giveable(*row), 8u);
  row->floor = 4;
  EXPECT_EQ(detail::giveable(*row), 6u);
}

TEST(SharedBudgetRowTest, ACapBoundsTheRoomLeftAndCountsWhatIsAboveIt) {
  auto row = fresh_row();
  row->held = 7;
  EXPECT_EQ(detail::cap_room(*row, 100), 100u);  // no cap
  EXPECT_EQ(detail::over_cap(*row), 0u);
  row->cap = 10;
  EXPECT_EQ(detail::cap_room(*row, 100), 3u);
  EXPECT_EQ(detail::cap_room(*row, 2), 2u);
  row->held = 12;  // a cap lowered below what it holds
  EXPECT_EQ(detail::cap_room(*row, 100), 0u);
  EXPECT_EQ(detail::over_cap(*row), 2u);
}

// A standing ask is what the speaker's goal lacks beyond what the member holds, within its
// cap; a member asks the larger of it and its ask in flight.
TEST(SharedBudgetRowTest, AStandingAskIsTheGoalWithinTheCapLessWhatIsHeld) {
  auto row = fresh_row();
  row->held = 5;
  row->goal = 20;
  EXPECT_EQ(detail::standing_ask(*row), 0u);  // nobody speaks for it: the goal is stale
  row->speaker_pid = 1;
  EXPECT_EQ(detail::standing_ask(*row), 15u);
  row->cap = 10;
  EXPECT_EQ(detail::standing_ask(*row), 5u);
  EXPECT_EQ(detail::asking(*row), 5u);
  row->wanted = 8;
  EXPECT_EQ(detail::asking(*row), 8u);
  row->goal = 3;
  EXPECT_EQ(detail::standing_ask(*row), 0u);
}

TEST(SharedBudgetRowTest, ForgettingTheSpeakerKeepsTheMemberAndClearingForgetsBoth) {
  auto row = fresh_row();
  row->pid = 42;
  row->start_time = 7;
  row->held = 10;
  row->floor = 3;
  std::strcpy(row->label, "engine");
  row->speaker_pid = 43;
  row->speaker_start_time = 8;
  row->spare = 5;
  row->goal = 20;
  row->announced = 10;
  EXPECT_EQ(detail::identity_of(*row).pid, 42);
  EXPECT_EQ(detail::identity_of(*row).start_time, 7u);
  EXPECT_EQ(detail::speaker_of(*row).pid, 43);
  EXPECT_EQ(detail::speaker_of(*row).start_time, 8u);
  detail::forget_speaker(*row);
  EXPECT_EQ(row->speaker_pid.load(), 0);
  EXPECT_EQ(row->spare.load(), 0u);
  EXPECT_EQ(row->goal.load(), 0u);
  EXPECT_EQ(row->announced, 0u);
  EXPECT_EQ(row->pid.load(), 42);
  EXPECT_EQ(row->held.load(), 10u);
  detail::clear_row(*row);
  EXPECT_EQ(row->pid.load(), 0);
  EXPECT_EQ(row->held.load(), 0u);
  EXPECT_EQ(row->floor.load(), 0u);  // a dead member's floor goes with it
  EXPECT_EQ(row->label[0], '\0');
}

}  // namespace
}  // namespace vkv
