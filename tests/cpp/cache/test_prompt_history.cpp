// PromptHistory: the eager-allocation estimate is a high quantile of recent prompts.
#include <gtest/gtest.h>

#include "cache/prompt_history.h"

namespace vkv::detail {
namespace {

TEST(PromptHistory, NothingRecordedEstimatesZeroAndZeroLengthsAreIgnored) {
  PromptHistory history;
  EXPECT_EQ(history.estimate(), 0u);
  history.record(0);
  EXPECT_EQ(history.estimate(), 0u);
}

TEST(PromptHistory, EstimateIsAHighQuantileNotTheMean) {
  PromptHistory history(/*window=*/20, /*quantile=*/0.95);
  for (std::size_t i = 1; i <= 20; ++i) history.record(i * 100);  // 100 .. 2000, mean 1050
  EXPECT_EQ(history.estimate(), 1900u);                           // the 19th of 20
  PromptHistory few(20, 0.95);
  few.record(300);
  few.record(4000);
  EXPECT_EQ(few.estimate(), 4000u) << "with few samples, the longest";
}

TEST(PromptHistory, OnlyTheLastWindowCounts) {
  PromptHistory history(/*window=*/4, /*quantile=*/1.0);
  history.record(9000);
  for (int i = 0; i < 4; ++i) history.record(500);
  EXPECT_EQ(history.estimate(), 500u) << "the long prompt left the window";
  history.record(700);
  EXPECT_EQ(history.estimate(), 700u);
}

}  // namespace
}  // namespace vkv::detail
