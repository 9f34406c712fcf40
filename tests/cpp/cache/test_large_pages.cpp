// Large pages (config.large_page_size): a prompt's whole spans get one physical
// allocation each, mapped with one call; they are reclaimed, shared and copied whole.
// Both layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <string>

#include "testing.h"

namespace vkv {
namespace {

using testing::mark;

constexpr std::size_t kSpan = 2;  // pages per large page: small_config's slots hold 8

class LargePagesTest : public testing::CacheTest {
 protected:
  void SetUp() override {
    CacheTest::SetUp();
    if (IsSkipped()) return;
    config_.large_page_size = kSpan * backend_->page_bytes();
  }
  std::size_t span_tokens() const { return tokens(kSpan); }
};

TEST_P(LargePagesTest, APromptsWholeSpansGetLargePagesAndTheRestSinglePages) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  const std::size_t prompt = 2 * span_tokens() + 1;  // two spans and one token of a page
  cache->step(lens({{slot, prompt}}));
  write_tokens(*cache, slot, 0, prompt, mark(1));
  expect_tokens(*cache, slot, 0, prompt, mark(1));
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.large_pages, 2 * regions());
  EXPECT_EQ(stats.pages_in_use, (2 * kSpan + 1) * regions());
  EXPECT_EQ(stats.backend.map.units, (2 * kSpan + 1) * regions());
  EXPECT_EQ(stats.backend.map.calls, 3 * regions()) << "one call per large page, one for the single page";
  cache->check_invariants();

  // Decode growth takes single pages.
  cache->step(lens({{slot, tokens(2 * kSpan + 2)}}));
  EXPECT_EQ(cache->stats().large_pages, 2 * regions());
  cache->check_invariants();
}

TEST_P(LargePagesTest, ANewOwnerOfAFreedSlotsLargePagesReadsZeros) {
  auto cache = make_cache();
  const std::size_t first = cache->alloc_reqid();
  cache->step(lens({{first, span_tokens()}}));
  write_tokens(*cache, first, 0, span_tokens(), mark(7));
  cache->free_reqid(first);
  const std::size_t second = cache->alloc_reqid();
  EXPECT_EQ(second, first) << "the slot that kept its pages goes out first";
  cache->step(lens({{second, span_tokens()}}));
  expect_tokens(*cache, second, 0, span_tokens(), [](std::size_t) { return 0; });
  EXPECT_EQ(cache->stats().large_pages, regions()) << "the large pages were kept, not created again";
  cache->check_invariants();
}

// A budget of one slot's worth: the second request takes the first's pages, large ones
// whole, and gets single pages made from the room they leave.
TEST_P(LargePagesTest, ReclamationTakesLargePagesWholeAndMakesSinglePagesFromThem) {
  auto cache = make_cache(/*budget_pages_per_region=*/2 * kSpan);
  const std::size_t first = cache->alloc_reqid();
  cache->step(lens({{first, 2 * span_tokens()}}));
  EXPECT_EQ(cache->stats().large_pages, 2 * regions());
  const std::size_t second = cache->alloc_reqid();
  EXPECT_THROW(cache->step(lens({{first, 2 * span_tokens()}, {second, 1}})), OutOfMemory);
  cache->free_reqid(first);
  cache->check_invariants();
  cache->step(lens({{second, tokens(kSpan + 1)}}));  // a large page and a single one
  write_tokens(*cache, second, 0, tokens(kSpan + 1), mark(3));
  expect_tokens(*cache, second, 0, tokens(kSpan + 1), mark(3));
  const CacheStats stats = cache->stats();
  EXPECT_LE(stats.pages_created, 2 * kSpan * regions());
  EXPECT_EQ(stats.pages_in_use, (kSpan + 1) * regions());
  cache->check_invariants();
}

// A cache that frees at once gives large pages back to the device whole, as single ones.
TEST_P(LargePagesTest, WithoutDeferredReclamationFreedLargePagesGoBackToTheDevice) {
  config_.deferred_reclamation = false;
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, 2 * span_tokens() + 1}}));  // two large pages and a single one per region
  ASSERT_EQ(cache->stats().large_pages, 2 * regions());
  cache->free_reqid(slot);
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_created, 0u);
  EXPECT_EQ(stats.pages_free, 0u);
  EXPECT_EQ(stats.large_pages, 0u);
  EXPECT_EQ(stats.backend.release.units, (2 * kSpan + 1) * regions());
  cache->check_invariants();
}

// A claim that ends inside a large page keeps all of it: trim() gives back the rest.
TEST_P(LargePagesTest, TrimKeepsTheLargePageAClaimEndsIn) {
  auto cache = make_cache();
  const std::size_t first = cache->alloc_reqid();
  cache->step(lens({{first, 2 * span_tokens()}}));
  cache->free_reqid(first);
  const std::size_t second = cache->alloc_reqid();
  cache->step(lens({{second, 1}}));  // claims one page of the first large page
  cache->trim();
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_mapped, kSpan * regions());
  EXPECT_EQ(stats.pages_created, kSpan * regions());
  EXPECT_EQ(stats.large_pages, regions());
  cache->check_invariants();
}

TEST_P(LargePagesTest, ForkSharesWholeLargePagesAndCopiesTheRest) {
  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  const std::size_t prompt = span_tokens() + tokens_per_page() / 2;  // a large page and half a page
  cache->step(lens({{src, prompt}}));
  write_tokens(*cache, src, 0, prompt, mark(1));
  const std::size_t dst = cache->fork(src);
  expect_tokens(*cache, dst, 0, prompt, mark(1));
  EXPECT_EQ(cache->stats().pages_shared, kSpan * regions());
  cache->check_invariants();

  // A prefix that ends inside a large page: its pages there are dst's own copies.
  const std::size_t other = cache->alloc_reqid();
  cache->share_prefix(src, other, tokens_per_page() + 1);
  expect_tokens(*cache, other, 0, tokens_per_page() + 1, mark(1));
  expect_tokens(*cache, other, tokens_per_page() + 1, tokens(kSpan), [](std::size_t) { return 0; });
  EXPECT_EQ(cache->stats().pages_shared, kSpan * regions()) << "only the fork shares";
  cache->check_invariants();
  write_tokens(*cache, other, 0, 1, [](std::size_t) { return 99; });
  expect_tokens(*cache, src, 0, 1, mark(1));
}

// Tensor-parallel ranks agree on slots because choices follow the calls alone. Whether a
// prompt got large pages follows the pool (a budget sized by each GPU's free memory, a
// mapper that got further on one rank), and with it whether a prefix is shared or
// copied: the slot handed out next must not follow that.
TEST_P(LargePagesTest, TheSlotHandedOutNextDoesNotDependOnWhetherThePoolHadLargePages) {
  std::size_t next[2];
  for (const bool room_for_large : {true, false}) {
    CacheConfig config = config_;
    config.eager_tokens = 0;  // the pages slots kept decide
    if (!room_for_large) {    // every page of the budget created up front, single
      config.memory_budget = 5 * regions() * backend_->page_bytes();
      config.precreate_pages = 5 * regions();
    }
    std::string unused;
    KvCache cache(config, testing::make_test_backend(std::get<0>(GetParam()), &unused));
    const std::size_t src = cache.alloc_reqid(), other = cache.alloc_reqid();
    cache.step(lens({{src, span_tokens()}, {other, 1}}));
    EXPECT_EQ(cache.stats().large_pages, room_for_large ? regions() : 0u);
    const std::size_t dst = cache.alloc_reqid();
    cache.share_prefix(src, dst, tokens_per_page() + 3);  // a whole page: shared, or copied out of a large page
    EXPECT_EQ(cache.stats().pages_shared, room_for_large ? 0u : regions());
    cache.free_reqid(other);  // kept a page
    cache.free_reqid(dst);    // kept two, or none where it shared them
    next[room_for_large ? 0 : 1] = cache.alloc_reqid();
    EXPECT_EQ(next[room_for_large ? 0 : 1], other) << "a slot that shared a page is not preferred";
    cache.check_invariants();
  }
  EXPECT_EQ(next[0], next[1]);
}

// Rolled back into a shared large page and grown again: the writer gets a private copy
// of all of it, in single pages, and the other slot keeps its tokens.
TEST_P(LargePagesTest, WritingIntoASharedLargePageCopiesItWhole) {
  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  const std::size_t prompt = span_tokens() + 1;
  cache->step(lens({{src, prompt}}));
  write_tokens(*cache, src, 0, prompt, mark(1));
  const std::size_t dst = cache->fork(src);
  cache->step(lens({{src, prompt}, {dst, 1}}));  // dst rolls back into the shared large page
  cache->step(lens({{src, prompt}, {dst, prompt}}));
  write_tokens(*cache, dst, 1, prompt, mark(50));
  expect_tokens(*cache, src, 0, prompt, mark(1));
  expect_tokens(*cache, dst, 1, prompt, mark(50));
  expect_tokens(*cache, dst, 0, 1, mark(1));
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_shared, 0u);
  EXPECT_EQ(stats.large_pages, regions()) << "src keeps its large page; dst's copy is in single pages";
  cache->check_invariants();
  cache->free_reqid(src);
  cache->free_reqid(dst);
  cache->check_invariants();
}

TEST_P(LargePagesTest, TheMapperMapsAheadWithLargePages) {
  CacheConfig config = config_;
  config.background_mapping = true;
  config.eager_tokens = 2 * span_tokens();
  KvCache cache(config, backend_);
  cache.stop_background();  // driven by hand below
  while (cache.map_ahead_now() > 0) {}
  const std::size_t slot = cache.alloc_reqid();
  EXPECT_EQ(cache.mapped_pages(slot), 2 * kSpan);
  const CacheStats stats = cache.stats();
  EXPECT_GE(stats.large_pages, 2 * regions());
  EXPECT_EQ(stats.backend.map.calls, 2 * regions()) << "one call per large page";
  cache.step(lens({{slot, 2 * span_tokens()}}));
  EXPECT_EQ(cache.stats().step.units, 0u) << "the prompt found its pages mapped";
  write_tokens(cache, slot, 0, 2 * span_tokens(), mark(4));
  expect_tokens(cache, slot, 0, 2 * span_tokens(), mark(4));
  cache.check_invariants();
}

TEST_P(LargePagesTest, ASizeThatIsNotWholePagesIsRejectedNamingIt) {
  CacheConfig config = config_;
  config.large_page_size = backend_->page_bytes() + 1;
  try {
    KvCache cache(config, backend_);
    FAIL() << "accepted large_page_size = page_size + 1";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("large_page_size = " + std::to_string(config.large_page_size)),
              std::string::npos)
        << error.what();
  }
  config.large_page_size = backend_->page_bytes();
  EXPECT_THROW(KvCache(config, backend_), InvalidArgument) << "one page is no large page";
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, LargePagesTest, testing::host_and_cuda_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
