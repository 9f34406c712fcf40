// The zero-fill free_reqid() and swap_out() leave to a later call (kv_cache_fill.cpp):
// neither makes a backend call for it, yet a freed slot's pages read zeros before a new
// owner can read them and before anything unmaps them, a call that fails while enqueuing
// it leaves it to the next, and no slot choice depends on when it happened. For both
// layouts on every backend: the deferred host backend runs the fill on a worker thread,
// late, as a GPU stream would, and faults on an unmap under it.
#include <gtest/gtest.h>

#include <chrono>

#include "testing.h"

namespace vkv {
namespace {

using testing::mark;

class DeferredFillTest : public testing::CacheTest {
 protected:
  // Keeps the stream busy, so that a fill enqueued now runs well after the call returns.
  void hold() { testing::hold_stream(*backend_, 0, std::chrono::microseconds(2000)); }
  std::uint64_t zero_fills(KvCache& cache) const { return cache.stats().backend.zero.calls; }
  std::uint64_t event_calls(KvCache& cache) const { return cache.stats().backend.event.calls; }
};

TEST_P(DeferredFillTest, FreeAndSwapOutMakeNoCallForTheZeroFill) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}, {b, tokens(1) + 1}}));
  const CacheStats before = cache->stats();
  cache->free_reqid(a);
  const CacheStats after = cache->stats();
  EXPECT_EQ(after.backend.zero.calls, before.backend.zero.calls);
  EXPECT_EQ(after.backend.event.calls, before.backend.event.calls);
  EXPECT_EQ(after.backend.unmap.calls, before.backend.unmap.calls);
  cache->swap_out(b);
  EXPECT_EQ(zero_fills(*cache), before.backend.zero.calls) << "swap_out copies, and clears nothing yet";
  cache->step(lens({}));
  EXPECT_EQ(zero_fills(*cache), before.backend.zero.calls + 2) << "the next step() enqueues both";
  cache->step(lens({}));
  EXPECT_EQ(zero_fills(*cache), before.backend.zero.calls + 2) << "once";
  cache->check_invariants();
}

// A new owner touches its slot's pages only from its first step() on: alloc_reqid() makes
// no driver call, and the first call that touches the pages enqueues the fill before.
TEST_P(DeferredFillTest, AllocReqidMakesNoCallAndTheNewOwnersFirstCallFillsFirst) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), src = cache->alloc_reqid();
  cache->step(lens({{a, tokens(3)}, {src, tokens(2)}}));
  write_tokens(*cache, a, 0, tokens(3), mark(50));
  write_tokens(*cache, src, 0, tokens(2), mark(60));
  hold();
  cache->free_reqid(a);
  const CacheStats before = cache->stats();
  const std::size_t next = cache->alloc_reqid();
  ASSERT_EQ(next, a);
  EXPECT_EQ(zero_fills(*cache), before.backend.zero.calls);
  EXPECT_EQ(event_calls(*cache), before.backend.event.calls);
  cache->check_invariants();  // allocated, not stepped, its fill still deferred
  // share_prefix() into it: the previous owner's tokens go first, then the shared prefix.
  cache->share_prefix(src, next, tokens(1) + 3);
  EXPECT_EQ(zero_fills(*cache), before.backend.zero.calls + 1);
  cache->step(lens({{src, tokens(2)}, {next, tokens(3)}}));
  expect_tokens(*cache, next, 0, tokens(1) + 3, mark(60));
  expect_tokens(*cache, next, tokens(1) + 3, tokens(3), [](std::size_t) { return std::uint8_t{0}; });
  // A slot handed out with its fill deferred and freed again before any step: the one
  // fill stays deferred, and the next step() enqueues it once.
  const std::size_t c = cache->alloc_reqid();
  cache->step(lens({{src, tokens(2)}, {next, tokens(3)}, {c, tokens(3)}}));
  cache->free_reqid(c);
  const std::size_t again = cache->alloc_reqid();
  ASSERT_EQ(again, c);
  cache->free_reqid(again);
  cache->check_invariants();
  const std::uint64_t fills = zero_fills(*cache);
  cache->step(lens({{src, tokens(2)}, {next, tokens(3)}}));
  EXPECT_EQ(zero_fills(*cache), fills + 1);
  EXPECT_NO_THROW(backend_->synchronize(0));
  cache->check_invariants();
}

TEST_P(DeferredFillTest, TheNextOwnerReadsZerosAndKeepsWhatItWrites) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(3)}}));
  write_tokens(*cache, a, 0, tokens(3), mark(40));
  hold();
  cache->free_reqid(a);
  const std::size_t next = cache->alloc_reqid();
  ASSERT_EQ(next, a) << "the slot that kept the most pages goes out first";
  EXPECT_EQ(cache->mapped_pages(next), 3u);
  cache->step(lens({{next, tokens(3)}}));
  expect_tokens(*cache, next, 0, tokens(3), [](std::size_t) { return std::uint8_t{0}; });
  write_tokens(*cache, next, 0, tokens(2), mark(7));
  // Later calls enqueue nothing over the new owner's tokens.
  const std::size_t other = cache->alloc_reqid();
  cache->step(lens({{next, tokens(3)}, {other, tokens(1)}}));
  cache->free_reqid(other);
  cache->step(lens({{next, tokens(3)}}));
  expect_tokens(*cache, next, 0, tokens(2), mark(7));
  EXPECT_NO_THROW(backend_->synchronize(0));
  cache->check_invariants();
}

TEST_P(DeferredFillTest, AFreedSlotsPagesAreZeroFilledBeforeAnotherSlotGetsThem) {
  auto cache = make_cache(/*budget_pages_per_region=*/4);
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(3)}, {b, tokens(1)}}));
  write_tokens(*cache, a, 0, tokens(3), mark(90));
  hold();
  cache->free_reqid(a);
  cache->step(lens({{b, tokens(4)}}));  // three of a's pages: filled, waited for, unmapped
  EXPECT_EQ(cache->mapped_pages(a), 0u);
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its queued zero-fill";
  expect_tokens(*cache, b, tokens(1), tokens(4), [](std::size_t) { return std::uint8_t{0}; });
  cache->check_invariants();
}

TEST_P(DeferredFillTest, TrimAndSetBudgetReclaimAFreedSlotAfterItsFill) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(3)}, {b, tokens(2)}}));
  write_tokens(*cache, a, 0, tokens(3), mark(60));
  write_tokens(*cache, b, 0, tokens(2), mark(61));
  hold();
  cache->free_reqid(a);
  EXPECT_GT(cache->trim(), 0u);
  EXPECT_EQ(cache->mapped_pages(a), 0u);
  hold();
  cache->swap_out(b);
  cache->set_budget(layout_->page_bytes());  // b's unclaimed pages must go too
  EXPECT_LE(cache->stats().pages_created, 1u);
  EXPECT_LT(cache->mapped_pages(b), 2u);
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its queued zero-fill";
  // Whatever the pool hands out now reads zeros.
  cache->set_budget(8 * regions() * layout_->page_bytes());
  const std::size_t c = cache->alloc_reqid();
  cache->step(lens({{c, tokens(6)}}));
  expect_tokens(*cache, c, 0, tokens(6), [](std::size_t) { return std::uint8_t{0}; });
  cache->swap_in(b);
  expect_tokens(*cache, b, 0, tokens(2), mark(61));
  cache->check_invariants();
}

TEST_P(DeferredFillTest, SwapInCopiesBackAfterTheFillOfItsOwnPages) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2) + 3}}));
  write_tokens(*cache, a, 0, tokens(2) + 3, mark(30));
  hold();
  cache->swap_out(a);
  cache->swap_in(a);  // the fill deferred by swap_out comes first, then the copy back
  expect_tokens(*cache, a, 0, tokens(2) + 3, mark(30));
  cache->step(lens({{a, tokens(2) + 4}}));  // and nothing clears them later
  expect_tokens(*cache, a, 0, tokens(2) + 3, mark(30));
  cache->check_invariants();
}

// A failure while enqueuing the fill leaves it deferred: the call changes nothing, and
// the next call enqueues it.
TEST_P(DeferredFillTest, AStepThatFailsToEnqueueTheFillLeavesItToTheNextCall) {
  for (std::size_t failing = 1; failing <= 2; ++failing) {  // the zero-fill, then the event behind it
    SCOPED_TRACE(failing == 1 ? "zero_strided fails" : "record_event fails");
    auto faults = std::make_shared<testing::FaultInjectingBackend>(backend_);
    KvCache cache(config_, faults);
    const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
    cache.step(lens({{a, tokens(2)}, {b, tokens(1)}}));
    write_tokens(cache, a, 0, tokens(2), mark(20));
    write_tokens(cache, b, 0, tokens(1), mark(21));
    cache.free_reqid(a);
    faults->fail_at = faults->calls + failing;
    EXPECT_THROW(cache.step(lens({{b, tokens(1)}})), DriverError);
    EXPECT_EQ(faults->injected, failing == 1 ? "zero_strided" : "record_event");
    cache.check_invariants();
    expect_tokens(cache, b, 0, tokens(1), mark(21));
    cache.step(lens({{b, tokens(1)}}));
    const std::size_t next = cache.alloc_reqid();
    ASSERT_EQ(next, a);
    cache.step(lens({{b, tokens(1)}, {next, tokens(2)}}));
    expect_tokens(cache, next, 0, tokens(2), [](std::size_t) { return std::uint8_t{0}; });
    EXPECT_NO_THROW(backend_->synchronize(0));
    cache.check_invariants();
  }
}

// Tensor-parallel ranks agree on slots because choices follow the calls alone: the same
// calls give the same slots whether the fills were enqueued early (prepare_step, the
// mapper) or late.
TEST_P(DeferredFillTest, SlotChoicesDoNotDependOnWhenTheFillsWereEnqueued) {
  CacheConfig config = config_;
  config.background_mapping = true;
  KvCache eager(config, backend_);
  std::string unused;
  KvCache late(config_, testing::make_test_backend(std::get<0>(GetParam()), &unused));
  std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
  auto both = [&](auto call) {
    const std::size_t first = call(eager, true), second = call(late, false);
    EXPECT_EQ(first, second);
    return first;
  };
  auto alloc = [&](KvCache& cache, bool) { return cache.alloc_reqid(); };
  auto step = [&](KvCache& cache, bool prepare) {
    if (prepare) cache.prepare_step(seq_lens.data(), seq_lens.size());
    cache.step(seq_lens);
    if (prepare) cache.map_ahead_now();
    return std::size_t{0};
  };
  const std::size_t a = both(alloc), b = both(alloc), c = both(alloc);
  seq_lens[a] = tokens(3);
  seq_lens[b] = tokens(1);
  seq_lens[c] = tokens(2);
  both(step);
  both([&](KvCache& cache, bool) {
    cache.free_reqid(b);
    return std::size_t{0};
  });
  both([&](KvCache& cache, bool) {
    cache.swap_out(c);
    return std::size_t{0};
  });
  both([&](KvCache& cache, bool) {
    cache.free_reqid(a);
    return std::size_t{0};
  });
  seq_lens[a] = seq_lens[b] = seq_lens[c] = 0;
  both(step);
  const std::size_t d = both(alloc);
  EXPECT_EQ(d, a) << "a kept the most pages";
  const std::size_t e = both(alloc);
  seq_lens[d] = tokens(1);
  seq_lens[e] = tokens(1);
  both(step);
  both([&](KvCache& cache, bool) {
    cache.free_reqid(c);
    return std::size_t{0};
  });
  both([&](KvCache& cache, bool) {
    cache.free_reqid(e);
    return std::size_t{0};
  });
  both(alloc);
  both(alloc);
  eager.check_invariants();
  late.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, DeferredFillTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
