// expect_tokens(): a slot's coming length (a long prompt prefilled in chunks) is mapped
// ahead by the mapper, unclaimed; step() then finds its pages mapped. A hint only: step(),
// OutOfMemory and the slots alloc_reqid() hands out are what they would be without it.
// Host backends (synchronous and deferred) in both layouts; CUDA skips without a device.
#include <gtest/gtest.h>

#include "testing.h"
#include "vkv/error.h"

namespace vkv {
namespace {

using testing::mark;

class ExpectedTokensTest : public testing::CacheTest {
 protected:
  void SetUp() override {
    CacheTest::SetUp();
    if (IsSkipped()) return;
    config_.eager_tokens = 0;  // only the expected pages are mapped ahead
    config_.lookahead_tokens = 0;
  }
  // Pages the step()s after map_ahead_now() mapped themselves.
  static std::uint64_t pages_step_mapped(const KvCache& cache) { return cache.stats().step.units; }
};

TEST_P(ExpectedTokensTest, TheMapperMapsTheExpectedPagesAndEveryChunkFindsThemMapped) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  const std::size_t prompt = tokens(6) - 3;  // ends inside the sixth page
  cache->expect_tokens(slot, prompt);
  EXPECT_EQ(cache->stats().pages_expected, 6 * regions());
  EXPECT_GT(cache->map_ahead_now(), 0u);
  CacheStats stats = cache->stats();
  EXPECT_EQ(cache->mapped_pages(slot), 6u);
  EXPECT_EQ(stats.pages_expected, 0u);
  EXPECT_EQ(stats.pages_in_use, 0u) << "pages mapped ahead are not claimed";
  EXPECT_EQ(stats.mapped_ahead.units, 6 * regions());
  EXPECT_GT(stats.mapped_ahead.calls, 0u);
  const auto maps = stats.backend.map.calls;
  // Chunks that end on a page boundary, inside a page, and at the prompt's end.
  const std::size_t chunk_ends[] = {tokens(2), tokens(3) + 1, tokens(5), prompt};
  std::size_t written = 0;
  for (const std::size_t end : chunk_ends) {
    cache->step(lens({{slot, end}}));
    EXPECT_EQ(cache->mapped_pages(slot), 6u);
    write_tokens(*cache, slot, written, end, mark(3));
    expect_tokens(*cache, slot, 0, end, mark(3));  // every earlier chunk still reads back
    written = end;
    cache->check_invariants();
  }
  EXPECT_EQ(cache->stats().backend.map.calls, maps) << "step() mapped nothing";
  EXPECT_EQ(pages_step_mapped(*cache), 0u);
  EXPECT_EQ(cache->stats().pages_in_use, 6 * regions());
}

TEST_P(ExpectedTokensTest, TheMapperThreadMapsThemWithoutBeingAsked) {
  config_.background_mapping = true;
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->expect_tokens(slot, tokens(5));
  testing::wait_until([&] { return cache->stats().pages_expected == 0; });
  ASSERT_EQ(cache->stats().pages_expected, 0u);
  const auto maps = cache->stats().backend.map.calls;
  cache->step(lens({{slot, tokens(5)}}));
  EXPECT_EQ(cache->stats().backend.map.calls, maps);
  cache->check_invariants();
}

TEST_P(ExpectedTokensTest, AShortageMapsWhatIsFreeAndStepFailsAsWithoutTheHint) {
  auto hinted = make_cache(/*budget_pages_per_region=*/4);
  auto plain = make_cache(/*budget_pages_per_region=*/4);
  const std::size_t slot = hinted->alloc_reqid();
  ASSERT_EQ(plain->alloc_reqid(), slot);
  hinted->expect_tokens(slot, tokens(7));
  hinted->map_ahead_now();
  EXPECT_EQ(hinted->mapped_pages(slot), 4u) << "as far as free memory goes";
  EXPECT_EQ(hinted->stats().pages_expected, 3 * regions());
  std::size_t missing_hinted = 0, missing_plain = 0;
  try {
    hinted->step(lens({{slot, tokens(7)}}));
  } catch (const OutOfMemory& error) {
    missing_hinted = error.missing_pages();
  }
  try {
    plain->step(lens({{slot, tokens(7)}}));
  } catch (const OutOfMemory& error) {
    missing_plain = error.missing_pages();
  }
  EXPECT_EQ(missing_hinted, 3 * regions());
  EXPECT_EQ(missing_hinted, missing_plain);
  EXPECT_EQ(hinted->seq_lens()[slot], 0u) << "the failed step changed nothing";
  EXPECT_EQ(hinted->stats().pages_in_use, 0u);
  hinted->step(lens({{slot, tokens(4)}}));  // what fits maps nothing more
  EXPECT_EQ(pages_step_mapped(*hinted), 0u);
  hinted->check_invariants();
}

TEST_P(ExpectedTokensTest, PagesMappedAheadAreReclaimedForAnotherSlotsStep) {
  auto cache = make_cache(/*budget_pages_per_region=*/6);
  const std::size_t waiting = cache->alloc_reqid();
  const std::size_t running = cache->alloc_reqid();
  cache->expect_tokens(waiting, tokens(6));
  cache->map_ahead_now();
  ASSERT_EQ(cache->mapped_pages(waiting), 6u);
  cache->step(lens({{running, tokens(3)}}));  // takes unclaimed pages, as from a lookahead
  EXPECT_EQ(cache->mapped_pages(running), 3u);
  EXPECT_EQ(cache->mapped_pages(waiting), 3u);
  EXPECT_EQ(cache->stats().pages_expected, 3 * regions());
  cache->check_invariants();
  cache->free_reqid(running);
  cache->step(lens({{waiting, tokens(6)}}));  // the freed slot's pages come back
  EXPECT_EQ(cache->mapped_pages(waiting), 6u);
  cache->check_invariants();
}

TEST_P(ExpectedTokensTest, FreeingDropsTheHintAndTheSlotKeepsWhatWasMapped) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->expect_tokens(slot, tokens(4));
  cache->map_ahead_now();
  cache->step(lens({{slot, tokens(1)}}));
  write_tokens(*cache, slot, 0, tokens(1), mark(9));
  cache->free_reqid(slot);
  EXPECT_EQ(cache->stats().pages_expected, 0u);
  const std::size_t next = cache->alloc_reqid();
  ASSERT_EQ(next, slot) << "the slot that kept a page goes out first";
  EXPECT_EQ(cache->stats().pages_expected, 0u) << "a new owner starts without the old hint";
  cache->step(lens({{next, tokens(4)}}));
  expect_tokens(*cache, next, 0, tokens(4), [](std::size_t) { return 0; });  // zeros, mapped ahead or kept
  cache->check_invariants();
}

TEST_P(ExpectedTokensTest, BadArgumentsChangeNothing) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  EXPECT_THROW(cache->expect_tokens(slot + 1, tokens(2)), InvalidArgument);  // free
  EXPECT_THROW(cache->expect_tokens(config_.max_batch_size, tokens(2)), InvalidArgument);
  EXPECT_THROW(cache->expect_tokens(slot, config_.max_context_len + 1), InvalidArgument);
  EXPECT_EQ(cache->map_ahead_now(), 0u);
  cache->step(lens({{slot, tokens(1)}}));
  cache->swap_out(slot);
  EXPECT_THROW(cache->expect_tokens(slot, tokens(2)), InvalidArgument);
  cache->swap_in(slot);
  cache->expect_tokens(slot, tokens(3));
  cache->expect_tokens(slot, 0);  // dropped
  cache->map_ahead_now();
  EXPECT_EQ(cache->mapped_pages(slot), 1u);
  cache->check_invariants();
}

// Tensor-parallel ranks: budgets differ, so their mappers get different distances ahead
// (and one may not be told at all); the slots they hand out and the shortages they
// report stay the same.
TEST_P(ExpectedTokensTest, RanksWithDifferentBudgetsHandOutTheSameSlots) {
  auto roomy = make_cache(/*budget_pages_per_region=*/64);
  auto tight = make_cache(/*budget_pages_per_region=*/16);  // two requests of 8 pages: no more
  auto unhinted = make_cache(/*budget_pages_per_region=*/16);
  KvCache* ranks[] = {roomy.get(), tight.get(), unhinted.get()};
  const std::size_t prompts[] = {tokens(5) + 1, tokens(2), tokens(7), tokens(1) + 2, tokens(4), tokens(8), tokens(3)};
  std::vector<std::size_t> running;  // slots, oldest first
  for (const std::size_t prompt : prompts) {
    if (running.size() == 2) {  // the oldest leaves before the next arrives
      for (KvCache* rank : ranks) rank->free_reqid(running.front());
      running.erase(running.begin());
    }
    std::vector<std::size_t> slots;
    for (KvCache* rank : ranks) slots.push_back(rank->alloc_reqid());
    ASSERT_EQ(slots[0], slots[1]);
    ASSERT_EQ(slots[0], slots[2]);
    const std::size_t slot = slots[0];
    roomy->expect_tokens(slot, prompt);
    tight->expect_tokens(slot, prompt);
    roomy->map_ahead_now();
    tight->map_ahead_now();
    std::vector<std::size_t> seq_lens = roomy->seq_lens();
    for (std::size_t end = std::min(prompt, tokens(2));; end = std::min(prompt, end + tokens(2))) {
      seq_lens[slot] = end;
      for (KvCache* rank : ranks) rank->step(seq_lens);
      if (end == prompt) break;
    }
    running.push_back(slot);
    for (KvCache* rank : ranks) rank->check_invariants();
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ExpectedTokensTest, testing::every_backend_with_both_layouts(),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// With large pages, the expected spans get one large page per region, mapped with one call.
class ExpectedTokensLargePagesTest : public ExpectedTokensTest {
 protected:
  void SetUp() override {
    ExpectedTokensTest::SetUp();
    if (IsSkipped()) return;
    config_.large_page_size = 2 * backend_->page_bytes();
  }
};

TEST_P(ExpectedTokensLargePagesTest, WholeExpectedSpansGetLargePages) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->expect_tokens(slot, tokens(5));  // two spans and one page
  cache->map_ahead_now();
  const CacheStats stats = cache->stats();
  EXPECT_EQ(cache->mapped_pages(slot), 5u);
  EXPECT_EQ(stats.large_pages, 2 * regions());
  EXPECT_EQ(stats.backend.map.calls, 3 * regions()) << "one call per large page, one for the single page";
  cache->step(lens({{slot, tokens(5)}}));
  EXPECT_EQ(cache->stats().backend.map.calls, stats.backend.map.calls);
  write_tokens(*cache, slot, 0, tokens(5), mark(5));
  expect_tokens(*cache, slot, 0, tokens(5), mark(5));
  cache->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ExpectedTokensLargePagesTest,
                         testing::every_backend_with_both_layouts(), [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace vkv
