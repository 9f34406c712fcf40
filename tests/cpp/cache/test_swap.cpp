// swap_out / swap_in: a slot's tokens to host memory and back, its pages free meanwhile,
// for both layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include "testing.h"

namespace vkv {
namespace {

using testing::mark;

class SwapTest : public testing::CacheTest {};

TEST_P(SwapTest, SwapOutAndInRestoresTheTokensAndFreesThePagesMeanwhile) {
  auto cache = make_cache(/*budget_pages_per_region=*/4);
  const std::size_t tokens = 3 * tokens_per_page() + 5;
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens}}));
  write_tokens(*cache, a, 0, tokens, mark(11));

  cache->swap_out(a);
  EXPECT_TRUE(cache->is_swapped(a));
  EXPECT_TRUE(cache->is_allocated(a));
  CacheStats stats = cache->stats();
  EXPECT_EQ(stats.swapped_slots, 1u);
  EXPECT_EQ(stats.swapped_bytes, tokens * layout_->token_bytes() * layout_->num_regions());
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_THROW(cache->step(lens({{a, tokens}})), InvalidArgument);
  EXPECT_THROW(cache->swap_out(a), InvalidArgument);

  // Another request uses the whole budget meanwhile: swap_in must wait for room.
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{b, 4 * tokens_per_page()}}));
  write_tokens(*cache, b, 0, 4 * tokens_per_page(), mark(20));
  try {
    cache->swap_in(a);
    FAIL() << "swap_in overcommitted";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 4 * layout_->num_regions());
  }
  EXPECT_TRUE(cache->is_swapped(a));
  cache->free_reqid(b);
  cache->swap_in(a);
  EXPECT_FALSE(cache->is_swapped(a));
  expect_tokens(*cache, a, 0, tokens, mark(11));
  stats = cache->stats();
  EXPECT_EQ(stats.swapped_bytes, 0u);
  EXPECT_EQ(stats.tokens_in_use, tokens);
  EXPECT_THROW(cache->swap_in(a), InvalidArgument);
  cache->step(lens({{a, tokens + 1}}));  // and it goes on decoding
  cache->check_invariants();
}

TEST_P(SwapTest, SwappingOutASharingSlotLeavesTheOtherIntact) {
  auto cache = make_cache();
  const std::size_t tokens = 2 * tokens_per_page() + 1;
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens}}));
  write_tokens(*cache, src, 0, tokens, mark(5));
  const std::size_t dst = cache->fork(src);
  cache->swap_out(src);
  EXPECT_EQ(cache->stats().pages_shared, 0u);
  expect_tokens(*cache, dst, 0, tokens, mark(5));
  cache->swap_in(src);
  expect_tokens(*cache, src, 0, tokens, mark(5));
  cache->free_reqid(src);  // a swapped-in, then freed slot
  const std::size_t swapped = cache->alloc_reqid();
  cache->step(lens({{swapped, 1}, {dst, tokens}}));
  cache->swap_out(swapped);
  cache->free_reqid(swapped);  // freeing a swapped-out slot discards its copy
  EXPECT_EQ(cache->stats().swapped_bytes, 0u);
  cache->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SwapTest, testing::host_and_cuda_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
