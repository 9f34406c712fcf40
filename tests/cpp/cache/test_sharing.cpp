// fork / share_prefix / copy-on-write: several slots on one physical page, for both
// layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>

#include "testing.h"

namespace vkv {
namespace {

using testing::mark;

class SharingTest : public testing::CacheTest {};

// Holds every copy back on its stream while `delay` is set, so that a copy is still queued
// when the call that queued it goes on to its next backend call.
class DelayedCopyBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::atomic<bool> delay{false};

  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override {
    if (delay) testing::hold_stream(*upstream_, stream, std::chrono::milliseconds(20));
    upstream_->copy(destination, source, bytes, stream);
  }
};

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

// Three slots share a page and two of them write into it in one step: each copy comes
// from the slot that keeps the page, never from one that the same step gives its own
// copy next (that unmaps the page under the copy still queued to read it).
TEST_P(SharingTest, CopyOnWriteReadsOnlyFromTheSlotThatKeepsThePage) {
  auto delayed = std::make_shared<DelayedCopyBackend>(backend_);
  backend_ = delayed;
  auto cache = make_cache();
  const std::size_t tokens = 2 * tokens_per_page();
  const std::size_t first = cache->alloc_reqid();
  cache->step(lens({{first, tokens}}));
  write_tokens(*cache, first, 0, tokens, mark(1));
  const std::size_t second = cache->fork(first);
  const std::size_t third = cache->fork(first);
  ASSERT_LT(second, third);  // the slot copied second lies between the first and the keeper

  const std::size_t rollback = tokens_per_page() + 2;  // into the second page
  cache->step(lens({{first, rollback}, {second, rollback}, {third, tokens}}));
  delayed->delay = true;
  cache->step(lens({{first, rollback + 1}, {second, rollback + 1}, {third, tokens}}));
  delayed->delay = false;

  for (std::size_t slot : {first, second}) expect_tokens(*cache, slot, 0, rollback, mark(1));
  expect_tokens(*cache, third, 0, tokens, mark(1));
  EXPECT_EQ(cache->stats().pages_shared, regions()) << "the first page is still shared by all three";
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

// Whichever backend call of share_prefix() fails, none of src's bytes stay where they do
// not belong: in dst (which claims nothing again; the partly filled page may be one dst
// kept from its previous owner, or a fresh one) or in the pages a new request gets.
TEST_P(SharingTest, AFailedShareLeavesNoneOfTheSourcesBytesBehind) {
  const auto zeros = [](std::size_t) { return std::uint8_t{0}; };
  for (const bool kept : {false, true}) {
    SCOPED_TRACE(kept ? "dst kept pages" : "dst gets fresh pages");
    std::size_t share_calls = 0;  // fallible backend calls share_prefix() makes, from the run without failure
    for (std::size_t fail_at = 0; fail_at == 0 || fail_at <= share_calls; ++fail_at) {
      SCOPED_TRACE("failing call " + std::to_string(fail_at));
      auto faults = std::make_shared<testing::FaultInjectingBackend>(backend_);
      KvCache cache(config_, faults);
      const std::size_t src = cache.alloc_reqid();
      cache.step(lens({{src, 2 * tokens_per_page() + 5}}));
      write_tokens(cache, src, 0, 2 * tokens_per_page() + 5, mark(70));
      if (kept) {  // a previous owner leaves 3 pages in the slot dst gets
        const std::size_t previous = cache.alloc_reqid();
        cache.step(lens({{src, 2 * tokens_per_page() + 5}, {previous, tokens(3)}}));
        write_tokens(cache, previous, 0, tokens(3), mark(80));
        cache.free_reqid(previous);
      }
      const std::size_t dst = cache.alloc_reqid();
      ASSERT_EQ(cache.mapped_pages(dst), kept ? 3u : 0u);
      const std::size_t before = faults->calls;
      faults->fail_at = fail_at == 0 ? 0 : before + fail_at;
      try {
        cache.share_prefix(src, dst, tokens_per_page() + 3);
      } catch (const DriverError&) {
        ASSERT_GT(fail_at, 0u);
      }
      if (fail_at == 0) {
        share_calls = faults->calls - before;
        continue;
      }
      cache.check_invariants();
      EXPECT_EQ(cache.seq_lens()[dst], 0u);
      expect_tokens(cache, src, 0, 2 * tokens_per_page() + 5, mark(70));
      // dst's owner reads its pages from its first step() on: by then no byte of src's, nor
      // of the previous owner's (whose fill the failed call may have left deferred).
      cache.step(lens({{src, 2 * tokens_per_page() + 5}}));
      expect_tokens(cache, dst, 0, tokens(cache.mapped_pages(dst)), zeros);
      const std::size_t next = cache.alloc_reqid();
      cache.step(lens({{src, 2 * tokens_per_page() + 5}, {next, tokens(layout_->pages_per_slot())}}));
      expect_tokens(cache, next, 0, tokens(layout_->pages_per_slot()), zeros);
    }
    EXPECT_GT(share_calls, 2u);
  }
}

TEST_P(SharingTest, ForkAndShareRejectBadCallsWithoutEffect) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, 10}, {b, 5}}));
  EXPECT_THROW(cache->fork(config_.max_batch_size), InvalidArgument);
  EXPECT_THROW(cache->fork(3), InvalidArgument);                // not allocated
  EXPECT_THROW(cache->share_prefix(a, a, 1), InvalidArgument);  // same slot
  EXPECT_THROW(cache->share_prefix(a, b, 1), InvalidArgument);  // dst holds tokens
  const std::size_t c = cache->alloc_reqid();
  EXPECT_THROW(cache->share_prefix(a, c, 11), InvalidArgument);  // beyond src's seq_len
  EXPECT_THROW(cache->share_prefix(a, 3, 1), InvalidArgument);   // dst not allocated
  cache->alloc_reqid();
  EXPECT_EQ(cache->num_free_slots(), 0u);
  EXPECT_THROW(cache->fork(a), InvalidArgument);  // no free slot
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

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharingTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
