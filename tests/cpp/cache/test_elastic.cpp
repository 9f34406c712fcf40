// set_budget / trim: the pool grows and shrinks while slots hold tokens, and what no slot
// claims goes back to the device; for both layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include "testing.h"

namespace vkv {
namespace {

class ElasticTest : public testing::CacheTest {};

TEST_P(ElasticTest, TrimReleasesEveryUnclaimedPage) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, 3 * tokens_per_page()}, {b, 2 * tokens_per_page()}}));
  cache->step(lens({{a, tokens_per_page()}, {b, 2 * tokens_per_page()}}));  // a keeps its claim
  cache->free_reqid(b);
  const std::size_t created = cache->stats().pages_created;
  const std::size_t released = cache->trim();
  EXPECT_EQ(released, 2 * layout_->num_regions() * layout_->page_bytes());
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_created, created - 2 * layout_->num_regions());
  EXPECT_EQ(stats.pages_created, stats.pages_in_use);
  EXPECT_EQ(stats.backend.release.units, 2 * layout_->num_regions());
  cache->check_invariants();
}

TEST_P(ElasticTest, SetBudgetShrinksToWhatIsClaimedAndGrowsAgain) {
  auto cache = make_cache(/*budget_pages_per_region=*/6);
  const std::size_t regions = layout_->num_regions();
  const std::size_t page = layout_->page_bytes();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, 2 * tokens_per_page()}, {b, 3 * tokens_per_page()}}));
  cache->free_reqid(b);  // 3 cached pages per region

  try {
    cache->set_budget(page * regions);  // less than a's two pages per region
    FAIL() << "set_budget went below what allocated slots claim";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), regions);
  }
  EXPECT_EQ(cache->stats().budget_pages, 6 * regions);
  EXPECT_THROW(cache->set_budget(page - 1), InvalidArgument);

  cache->set_budget(3 * regions * page);
  CacheStats stats = cache->stats();
  EXPECT_EQ(stats.budget_pages, 3 * regions);
  EXPECT_LE(stats.pages_created, 3 * regions);
  EXPECT_THROW(cache->step(lens({{a, 4 * tokens_per_page()}})), OutOfMemory);
  cache->step(lens({{a, 3 * tokens_per_page()}}));
  cache->check_invariants();

  cache->set_budget(8 * regions * page);
  cache->step(lens({{a, 8 * tokens_per_page()}}));
  EXPECT_EQ(cache->stats().pages_in_use, 8 * regions);
  cache->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ElasticTest, testing::host_and_cuda_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
