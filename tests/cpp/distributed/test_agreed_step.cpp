// agreed_step(): ranks on one host (threads here) prepare, agree in one round and step
// together; a rank short of pages or a rank that is gone leaves every cache as it was.
#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "testing.h"
#include "vkv/agreed_step.h"
#include "vkv/host_backend.h"

namespace vkv {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::string unique_name(const char* what) {
  return std::string("vkv-test-agreed-step-") + what + "-" + std::to_string(getpid());
}

struct Rank {
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<HostAllReduce> host;
  std::size_t slot = 0;
};

// Two ranks of the same shape; rank 1's cache may hold only `rank1_budget_pages` pages a region.
std::vector<Rank> two_ranks(const char* what, std::size_t rank1_budget_pages = 0) {
  std::vector<Rank> ranks(2);
  const std::string name = unique_name(what);
  ranks[0].host = std::make_unique<HostAllReduce>(HostAllReduce::create(name, 2, 8));
  ranks[1].host = std::make_unique<HostAllReduce>(HostAllReduce::join(name, 1));
  for (std::size_t rank = 0; rank < 2; ++rank) {
    CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
    config.eager_tokens = 0;
    if (rank == 1 && rank1_budget_pages > 0) config.memory_budget = rank1_budget_pages * testing::kHostTestPageBytes;
    ranks[rank].cache = std::make_unique<KvCache>(config, std::make_shared<HostBackend>(testing::kHostTestPageBytes));
    ranks[rank].slot = ranks[rank].cache->alloc_reqid();
  }
  return ranks;
}

// Every rank's agreed_step() for `tokens` tokens of its slot, each on its own thread.
std::vector<AgreedStep> step_together(std::vector<Rank>& ranks, std::size_t tokens) {
  std::vector<AgreedStep> results(ranks.size());
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < ranks.size(); ++rank) {
    threads.emplace_back([&, rank] {
      std::vector<std::size_t> seq_lens(ranks[rank].cache->config().max_batch_size, 0);
      seq_lens[ranks[rank].slot] = tokens;
      results[rank] = agreed_step(*ranks[rank].cache, *ranks[rank].host, seq_lens, 0, seconds(30));
    });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

TEST(AgreedStep, RanksThatAreAllReadyStepTogether) {
  std::vector<Rank> ranks = two_ranks("ready");
  for (const AgreedStep& result : step_together(ranks, 100)) {
    EXPECT_EQ(result.outcome, AgreedStep::Outcome::stepped) << result.why;
    EXPECT_EQ(result.missing_pages, 0u);
  }
  for (Rank& rank : ranks) EXPECT_EQ(rank.cache->seq_lens()[rank.slot], 100u);
}

TEST(AgreedStep, ARankShortOfPagesLeavesEveryRankUnstepped) {
  const std::size_t token_bytes =
      KvLayout(testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes), testing::kHostTestPageBytes)
          .token_bytes();
  const std::size_t tokens = 4 * testing::kHostTestPageBytes / token_bytes;  // four pages' worth
  std::vector<Rank> ranks = two_ranks("short", /*rank1_budget_pages=*/2);
  const std::vector<AgreedStep> results = step_together(ranks, tokens);
  for (const AgreedStep& result : results) {
    EXPECT_EQ(result.outcome, AgreedStep::Outcome::unsettled);
    EXPECT_GT(result.reduced[AgreedStep::kMissingPages], 0) << "the short rank's pages, on every rank";
  }
  EXPECT_EQ(results[0].missing_pages, 0u);
  EXPECT_GT(results[1].missing_pages, 0u);
  for (Rank& rank : ranks) EXPECT_EQ(rank.cache->seq_lens()[rank.slot], 0u) << "no rank stepped alone";
}

TEST(AgreedStep, ARankThatNeverComesFailsTheRoundAndNothingSteps) {
  std::vector<Rank> ranks = two_ranks("absent");
  std::vector<std::size_t> seq_lens(ranks[0].cache->config().max_batch_size, 0);
  seq_lens[ranks[0].slot] = 10;
  const AgreedStep result = agreed_step(*ranks[0].cache, *ranks[0].host, seq_lens, 0, milliseconds(50));
  EXPECT_EQ(result.outcome, AgreedStep::Outcome::round_failed);
  EXPECT_NE(result.why.find("rank"), std::string::npos) << result.why;
  EXPECT_EQ(ranks[0].cache->seq_lens()[ranks[0].slot], 0u);
}

TEST(AgreedStep, AFailedPreparationThrowsBeforeTheRound) {
  std::vector<Rank> ranks = two_ranks("invalid");
  std::vector<std::size_t> seq_lens(ranks[0].cache->config().max_batch_size, 0);
  seq_lens[ranks[0].slot] = ranks[0].cache->config().max_context_len + 1;
  EXPECT_THROW(agreed_step(*ranks[0].cache, *ranks[0].host, seq_lens, 0, seconds(30)), InvalidArgument);
}

}  // namespace
}  // namespace vkv
