// prepare_step / prepare_swap_in / prepare_fork / prepare_share_prefix / prepare_set_budget:
// what tensor-parallel agreement rests on. A preparation reports the call's shortage
// without raising it, changes no claim (so no later slot choice), and leaves the call
// itself nothing to create. For both layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include "testing.h"

namespace vkv {
namespace {

class PrepareTest : public testing::CacheTest {};

TEST_P(PrepareTest, APreparedStepMapsWithoutClaimingAndTheStepMakesNoBackendCall) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  const auto seq_lens = lens({{a, tokens(2) + 1}, {b, tokens(1)}});
  const KvCache::Preparation plan = cache->prepare_step(seq_lens.data(), seq_lens.size());
  EXPECT_EQ(plan.missing_pages, 0u);
  EXPECT_EQ(plan.copied_pages, 0u);
  EXPECT_EQ(cache->mapped_pages(a), 3u);
  EXPECT_EQ(cache->stats().pages_in_use, 0u) << "mapped ahead, not claimed";
  cache->check_invariants();

  const BackendStats before = cache->stats().backend;
  cache->step(seq_lens);
  const BackendStats after = cache->stats().backend;
  EXPECT_EQ(after.map.calls, before.map.calls);
  EXPECT_EQ(after.create.calls, before.create.calls);
  EXPECT_EQ(after.zero.calls, before.zero.calls);
  EXPECT_EQ(after.unmap.calls, before.unmap.calls);
  EXPECT_EQ(cache->stats().pages_in_use, 4 * regions());
  cache->check_invariants();
}

TEST_P(PrepareTest, APreparedStepLeavesTheStepNoDeferredZeroFill) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}, {b, tokens(1)}}));
  cache->free_reqid(a);  // its zero-fill waits for the next call that needs it
  const auto seq_lens = lens({{b, tokens(1)}});
  EXPECT_EQ(cache->prepare_step(seq_lens.data(), seq_lens.size()).missing_pages, 0u);
  const BackendStats before = cache->stats().backend;
  cache->step(seq_lens);  // after agreement: must not fail, so makes no backend call
  const BackendStats after = cache->stats().backend;
  EXPECT_EQ(after.zero.calls, before.zero.calls);
  EXPECT_EQ(after.event.calls, before.event.calls);
  cache->check_invariants();
}

TEST_P(PrepareTest, AShortageIsReturnedWithTheCountStepWouldThrowAndNothingChanges) {
  auto cache = make_cache(4);
  const std::size_t a = cache->alloc_reqid();
  const auto seq_lens = lens({{a, tokens(6)}});
  const KvCache::Preparation plan = cache->prepare_step(seq_lens.data(), seq_lens.size());
  EXPECT_EQ(plan.missing_pages, 2 * regions());
  EXPECT_EQ(cache->mapped_pages(a), 0u);
  try {
    cache->step(seq_lens);
    FAIL() << "step() should run short";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), plan.missing_pages);
  }
  const auto bad = lens({{a + 1, 1}});
  EXPECT_THROW(cache->prepare_step(bad.data(), bad.size()), InvalidArgument);
  cache->check_invariants();
}

// The property tensor-parallel ranks rely on: a rank that prepared a step the others
// could not take hands out the same slots afterwards.
TEST_P(PrepareTest, PreparingChangesNoLaterSlotChoice) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(1)}, {b, tokens(1)}}));
  const auto grown = lens({{a, tokens(1)}, {b, tokens(5)}});
  EXPECT_EQ(cache->prepare_step(grown.data(), grown.size()).missing_pages, 0u);  // never stepped
  cache->free_reqid(b);
  cache->free_reqid(a);
  EXPECT_EQ(cache->alloc_reqid(), a) << "b kept 1 claimed page like a, not 5";
  cache->check_invariants();
}

TEST_P(PrepareTest, ACopyOnWriteStepFindsItsPagesInThePool) {
  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens(3)}}));
  const std::size_t dst = cache->fork(src);
  cache->step(lens({{src, tokens(1) + 2}, {dst, tokens(3)}}));  // src rolls back into page 1
  const auto rewrite = lens({{src, tokens(1) + 3}, {dst, tokens(3)}});
  const KvCache::Preparation plan = cache->prepare_step(rewrite.data(), rewrite.size());
  EXPECT_EQ(plan.missing_pages, 0u);
  EXPECT_EQ(plan.copied_pages, 1u);
  EXPECT_GE(cache->stats().pages_free, regions());
  const std::size_t created = cache->stats().backend.create.calls;
  cache->step(rewrite);
  EXPECT_EQ(cache->stats().backend.create.calls, created);
  EXPECT_EQ(cache->stats().pages_shared, 2 * regions());
  cache->check_invariants();
}

TEST_P(PrepareTest, PrepareForkNamesTheSlotAndReadiesThePartialPage) {
  auto full = make_cache(3);
  const std::size_t a = full->alloc_reqid();
  full->step(lens({{a, tokens(2) + 1}}));  // all 3 pages claimed, the last one partly
  EXPECT_EQ(full->prepare_fork(a).missing_pages, regions());
  EXPECT_THROW(full->prepare_fork(a + 1), InvalidArgument);

  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens(2) + 1}}));
  const KvCache::Preparation plan = cache->prepare_fork(src);
  EXPECT_EQ(plan.missing_pages, 0u);
  const std::size_t created = cache->stats().backend.create.calls;
  EXPECT_EQ(cache->fork(src), plan.slot);
  EXPECT_EQ(cache->stats().backend.create.calls, created);
  cache->check_invariants();
}

TEST_P(PrepareTest, PrepareSharePrefixSwapInAndSetBudgetReportTheirShortages) {
  auto cache = make_cache(4);
  const std::size_t src = cache->alloc_reqid(), dst = cache->alloc_reqid();
  cache->step(lens({{src, tokens(3) + 1}}));  // all 4 pages claimed
  EXPECT_EQ(cache->prepare_share_prefix(src, dst, tokens(3) + 1).missing_pages, regions());
  EXPECT_EQ(cache->prepare_share_prefix(src, dst, tokens(3)).missing_pages, 0u) << "full pages are shared";
  EXPECT_THROW(cache->prepare_share_prefix(src, src, 1), InvalidArgument);
  EXPECT_EQ(cache->prepare_set_budget(3 * regions() * layout_->page_bytes()).missing_pages, regions());
  EXPECT_EQ(cache->stats().budget_pages, 4 * regions());

  cache->swap_out(src);
  const std::size_t other = cache->alloc_reqid();
  cache->step(lens({{other, tokens(4)}}));  // takes the pages src left
  EXPECT_EQ(cache->prepare_swap_in(src).missing_pages, 4 * regions());
  cache->free_reqid(other);
  EXPECT_EQ(cache->prepare_swap_in(src).missing_pages, 0u);
  EXPECT_EQ(cache->mapped_pages(src), 4u);
  EXPECT_TRUE(cache->is_swapped(src));
  const std::size_t maps = cache->stats().backend.map.calls;
  cache->swap_in(src);
  EXPECT_EQ(cache->stats().backend.map.calls, maps);
  EXPECT_EQ(cache->stats().tokens_in_use, tokens(3) + 1);
  cache->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, PrepareTest, testing::host_and_cuda_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
