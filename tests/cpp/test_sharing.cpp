// fork / share_prefix / copy-on-write, swap_out / swap_in, set_budget / trim: for both
// layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class SharingTest : public ::testing::TestWithParam<std::tuple<BackendKind, LayoutKind>> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(std::get<0>(GetParam()), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(std::get<1>(GetParam()), backend_->page_bytes());
    layout_ = std::make_unique<KvLayout>(config_, backend_->page_bytes());
  }

  std::unique_ptr<KvCache> make_cache(std::size_t budget_pages_per_region = 0) {
    CacheConfig config = config_;
    config.memory_budget = budget_pages_per_region * layout_->num_regions() * backend_->page_bytes();
    return std::make_unique<KvCache>(config, backend_);
  }

  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }

  Address token_address(KvCache& cache, std::size_t region, std::size_t slot, std::size_t token) const {
    return cache.base() + layout_->page_offset(region, slot, 0) + token * layout_->token_bytes();
  }

  // Token t of `slot` in every region holds the byte value(t), one copy per region.
  template <typename Value>
  void write_tokens(KvCache& cache, std::size_t slot, std::size_t first, std::size_t last, Value value) {
    const std::size_t token_bytes = layout_->token_bytes();
    std::vector<std::uint8_t> bytes((last - first) * token_bytes);
    for (std::size_t t = first; t < last; ++t)
      std::fill_n(bytes.begin() + static_cast<std::ptrdiff_t>((t - first) * token_bytes), token_bytes, value(t));
    for (std::size_t r = 0; r < layout_->num_regions(); ++r)
      testing::write_bytes(cache.backend(), token_address(cache, r, slot, first), bytes);
  }
  template <typename Value>
  void expect_tokens(KvCache& cache, std::size_t slot, std::size_t first, std::size_t last, Value value) {
    const std::size_t token_bytes = layout_->token_bytes();
    for (std::size_t r = 0; r < layout_->num_regions(); ++r) {
      const auto bytes =
          testing::read_bytes(cache.backend(), token_address(cache, r, slot, first), (last - first) * token_bytes);
      for (std::size_t t = first; t < last; ++t)
        for (std::size_t i = 0; i < token_bytes; i += token_bytes / 4)  // a few bytes per token
          ASSERT_EQ(bytes[(t - first) * token_bytes + i], value(t)) << "slot " << slot << " region " << r
                                                                     << " token " << t;
    }
  }

  std::size_t tokens_per_page() const { return layout_->tokens_in_pages(1); }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
  std::unique_ptr<KvLayout> layout_;
};

auto mark(std::uint8_t base) {
  return [base](std::size_t token) { return static_cast<std::uint8_t>(base + token % 50); };
}

TEST_P(SharingTest, ForkSharesFullPagesAndCopiesThePartialOne) {
  auto cache = make_cache();
  const std::size_t regions = layout_->num_regions();
  const std::size_t tokens = 2 * tokens_per_page() + tokens_per_page() / 2;  // two full pages and a half
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens}}));
  write_tokens(*cache, src, 0, tokens, mark(1));
  const std::size_t created = cache->stats().pages_created;

  const std::size_t dst = cache->fork(src);
  EXPECT_NE(dst, src);
  EXPECT_TRUE(cache->is_allocated(dst));
  expect_tokens(*cache, dst, 0, tokens, mark(1));
  CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_shared, 2 * regions);
  EXPECT_EQ(stats.pages_created, created + regions) << "only the partial page is new";
  EXPECT_EQ(stats.page_mappings, 6 * regions);
  EXPECT_EQ(stats.pages_mapped, 4 * regions);
  EXPECT_EQ(stats.bytes_saved_by_sharing(), 2 * regions * layout_->page_bytes());
  EXPECT_EQ(stats.tokens_in_use, 2 * tokens);
  cache->check_invariants();

  // Both append into their own partial pages: no copy, and neither sees the other's token.
  cache->step(lens({{src, tokens + 1}, {dst, tokens + 1}}));
  write_tokens(*cache, src, tokens, tokens + 1, [](std::size_t) { return 200; });
  write_tokens(*cache, dst, tokens, tokens + 1, [](std::size_t) { return 201; });
  expect_tokens(*cache, src, tokens, tokens + 1, [](std::size_t) { return 200; });
  expect_tokens(*cache, dst, tokens, tokens + 1, [](std::size_t) { return 201; });
  EXPECT_EQ(cache->stats().pages_shared, 2 * regions);
  cache->check_invariants();
}

TEST_P(SharingTest, TheCopiedPartialPageHoldsNothingBeyondTheSharedTokens) {
  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  const std::size_t tokens = tokens_per_page() + 3;
  cache->step(lens({{src, 2 * tokens_per_page()}}));
  write_tokens(*cache, src, 0, 2 * tokens_per_page(), mark(1));
  const std::size_t dst = cache->alloc_reqid();
  cache->share_prefix(src, dst, tokens);
  expect_tokens(*cache, dst, 0, tokens, mark(1));
  expect_tokens(*cache, dst, tokens, 2 * tokens_per_page(), [](std::size_t) { return 0; });
  cache->check_invariants();
}

TEST_P(SharingTest, WritingIntoASharedPageAfterARollbackCopiesIt) {
  auto cache = make_cache();
  const std::size_t regions = layout_->num_regions();
  const std::size_t tokens = 3 * tokens_per_page();
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens}}));
  write_tokens(*cache, src, 0, tokens, mark(1));
  const std::size_t dst = cache->fork(src);
  EXPECT_EQ(cache->stats().pages_shared, 3 * regions);

  // src rolls back into its second page and writes a new token there.
  const std::size_t rollback = tokens_per_page() + 2;
  cache->step(lens({{src, rollback}, {dst, tokens}}));
  cache->step(lens({{src, rollback + 1}, {dst, tokens}}));
  write_tokens(*cache, src, rollback, rollback + 1, [](std::size_t) { return 222; });

  expect_tokens(*cache, dst, 0, tokens, mark(1));  // untouched by src's write
  expect_tokens(*cache, src, 0, rollback, mark(1));
  expect_tokens(*cache, src, rollback, rollback + 1, [](std::size_t) { return 222; });
  EXPECT_EQ(cache->stats().pages_shared, 2 * regions) << "only the page written into was copied";
  cache->check_invariants();

  // Growing back over the third page, still shared, copies it too.
  cache->step(lens({{src, tokens}, {dst, tokens}}));
  EXPECT_EQ(cache->stats().pages_shared, 1 * regions);
  cache->check_invariants();
}

TEST_P(SharingTest, FreeingOneOwnerKeepsTheOthersTokensAndNoPageLeaks) {
  auto cache = make_cache();
  const std::size_t tokens = 2 * tokens_per_page();
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens}}));
  write_tokens(*cache, src, 0, tokens, mark(7));
  const std::size_t dst = cache->fork(src);
  cache->free_reqid(src);
  expect_tokens(*cache, dst, 0, tokens, mark(7));
  EXPECT_EQ(cache->stats().pages_shared, 0u);
  EXPECT_EQ(cache->mapped_pages(src), 0u) << "shared pages leave a freed slot at once";
  cache->check_invariants();

  // The next owner of src's slot sees zeros.
  const std::size_t next = cache->alloc_reqid();
  cache->step(lens({{next, tokens}, {dst, tokens}}));
  expect_tokens(*cache, next, 0, tokens, [](std::size_t) { return 0; });
  cache->free_reqid(dst);
  cache->free_reqid(next);
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_EQ(stats.pages_created, stats.pages_free + stats.pages_mapped);
  cache->check_invariants();
}

TEST_P(SharingTest, ShareIntoASlotWithKeptPagesReplacesThem) {
  auto cache = make_cache();
  const std::size_t old = cache->alloc_reqid();
  cache->step(lens({{old, 4 * tokens_per_page()}}));
  write_tokens(*cache, old, 0, 4 * tokens_per_page(), mark(9));
  cache->free_reqid(old);  // keeps 4 zeroed pages
  const std::size_t src = cache->alloc_reqid();
  ASSERT_EQ(src, old) << "the slot with kept pages comes first";
  const std::size_t other = cache->alloc_reqid();
  cache->step(lens({{src, 0}, {other, 2 * tokens_per_page()}}));
  write_tokens(*cache, other, 0, 2 * tokens_per_page(), mark(3));
  const std::size_t created = cache->stats().pages_created;

  const std::size_t dst = cache->alloc_reqid();
  cache->share_prefix(other, dst, tokens_per_page() + 1);
  expect_tokens(*cache, dst, 0, tokens_per_page() + 1, mark(3));
  EXPECT_LE(cache->stats().pages_created, created + layout_->num_regions());
  cache->check_invariants();
}

TEST_P(SharingTest, ForkAndShareRejectBadCallsWithoutEffect) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, 10}, {b, 5}}));
  EXPECT_THROW(cache->fork(config_.max_batch_size), InvalidArgument);
  EXPECT_THROW(cache->fork(3), InvalidArgument);                     // not allocated
  EXPECT_THROW(cache->share_prefix(a, a, 1), InvalidArgument);       // same slot
  EXPECT_THROW(cache->share_prefix(a, b, 1), InvalidArgument);       // dst holds tokens
  const std::size_t c = cache->alloc_reqid();
  EXPECT_THROW(cache->share_prefix(a, c, 11), InvalidArgument);      // beyond src's seq_len
  EXPECT_THROW(cache->share_prefix(a, 3, 1), InvalidArgument);       // dst not allocated
  cache->alloc_reqid();
  EXPECT_EQ(cache->num_free_slots(), 0u);
  EXPECT_THROW(cache->fork(a), InvalidArgument);                     // no free slot
  EXPECT_EQ(cache->stats().pages_shared, 0u);
  cache->check_invariants();
}

TEST_P(SharingTest, ForkWithoutRoomForThePartialPageFailsAndLeavesNoSlotBehind) {
  auto cache = make_cache(/*budget_pages_per_region=*/2);
  const std::size_t src = cache->alloc_reqid();
  cache->step(lens({{src, tokens_per_page() + 1}}));  // both pages of the budget
  const std::size_t free_before = cache->num_free_slots();
  EXPECT_THROW(cache->fork(src), OutOfMemory);
  EXPECT_EQ(cache->num_free_slots(), free_before);
  EXPECT_EQ(cache->stats().pages_shared, 0u);
  cache->check_invariants();
  // A page-aligned prefix needs no new page at all.
  cache->step(lens({{src, tokens_per_page()}}));
  const std::size_t dst = cache->alloc_reqid();
  cache->share_prefix(src, dst, tokens_per_page());
  EXPECT_EQ(cache->stats().pages_shared, layout_->num_regions());
  cache->check_invariants();
}

TEST_P(SharingTest, SwapOutAndInRestoresTheTokensAndFreesThePagesMeanwhile) {
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

TEST_P(SharingTest, SwappingOutASharingSlotLeavesTheOtherIntact) {
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

TEST_P(SharingTest, TrimReleasesEveryUnclaimedPage) {
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

TEST_P(SharingTest, SetBudgetShrinksToWhatIsClaimedAndGrowsAgain) {
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

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharingTest,
                         ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved)),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace vkv
