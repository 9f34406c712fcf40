// The background mapper: lookahead, eager allocation, watermark reclamation, ablation
// switches, errors. Deterministic tests drive the work with map_ahead_now(); the
// model-based test (test_model_based.cpp) also runs with the real thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>
#include <tuple>

#include "cache/mapper.h"
#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class MapperTest : public ::testing::TestWithParam<std::tuple<BackendKind, LayoutKind>> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(std::get<0>(GetParam()), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(std::get<1>(GetParam()), backend_->page_bytes());
    config_.eager_tokens = 0;  // each test turns on what it looks at
    config_.lookahead_tokens = 0;
    // These count the mapper's units; its zero backing of free slots (CUDA) and how zero
    // backing restricts mapping ahead are test_zero_page.cpp's.
    config_.zero_page = false;
  }
  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }
  bool slot_reads_zero(KvCache& cache, std::size_t slot, std::size_t first_page, std::size_t pages) {
    for (std::size_t r = 0; r < cache.layout().num_regions(); ++r) {
      const Address address = cache.base() + cache.layout().page_offset(r, slot, first_page);
      if (!testing::all_zero(testing::read_bytes(cache.backend(), address, pages * cache.layout().page_bytes())))
        return false;
    }
    return true;
  }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
};

TEST_P(MapperTest, LookaheadIsMappedBeforeStepNeedsIt) {
  config_.lookahead_tokens = 2 * KvLayout(config_, backend_->page_bytes()).tokens_in_pages(1);
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t slot = cache.alloc_reqid();
  cache.step(lens({{slot, layout.tokens_in_pages(1)}}));
  EXPECT_EQ(cache.mapped_pages(slot), 1u);
  EXPECT_GT(cache.map_ahead_now(), 0u);
  EXPECT_EQ(cache.mapped_pages(slot), 3u);                          // seq_len + two pages' worth of tokens
  EXPECT_EQ(cache.stats().pages_in_use, 1 * layout.num_regions());  // ahead pages are not claimed
  const auto maps = cache.stats().backend.map.calls;
  cache.step(lens({{slot, layout.tokens_in_pages(3)}}));  // two pages further: nothing left to map
  EXPECT_EQ(cache.stats().backend.map.calls, maps);
  EXPECT_TRUE(slot_reads_zero(cache, slot, 1, 2));
  cache.check_invariants();
}

TEST_P(MapperTest, EagerAllocationPreparesTheNextPrefill) {
  const KvLayout probe(config_, backend_->page_bytes());
  config_.eager_tokens = probe.tokens_in_pages(3);
  KvCache cache(config_, backend_);
  cache.map_ahead_now();
  const std::size_t next = 0;  // all slots are alike: the lowest index goes out first
  EXPECT_EQ(cache.mapped_pages(next), 3u);
  EXPECT_EQ(cache.stats().pages_in_use, 0u);
  const auto maps = cache.stats().backend.map.calls;
  ASSERT_EQ(cache.alloc_reqid(), next);
  cache.step(lens({{next, probe.tokens_in_pages(3)}}));  // the prompt finds its pages mapped
  EXPECT_EQ(cache.stats().backend.map.calls, maps);
  cache.map_ahead_now();  // and the following slot is prepared in turn
  EXPECT_EQ(cache.mapped_pages(1), 3u);
  cache.check_invariants();
}

TEST_P(MapperTest, AdaptiveEagerAllocationFollowsPromptLengths) {
  config_.eager_tokens = kAdaptive;
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  EXPECT_EQ(cache.map_ahead_now(), 0u);  // no prompt seen yet
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(2)}}));
  cache.map_ahead_now();
  EXPECT_EQ(cache.mapped_pages(1), 2u);
}

TEST_P(MapperTest, ALeavingRequestDoesNotTakeThePagesMappedForTheNextPrompt) {
  config_.eager_tokens = kAdaptive;
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(3)}, {b, 1}}));  // prompts of 3 pages and 1 page
  cache.map_ahead_now();
  const std::size_t eager = 2;  // the slot handed out next when the mapper planned
  ASSERT_EQ(cache.mapped_pages(eager), 3u) << "a high quantile of the prompts: the longer one";
  cache.free_reqid(b);  // kept 1 page: fewer than the eager slot maps
  EXPECT_EQ(cache.alloc_reqid(), eager) << "the next request gets the pages mapped for it";
  const auto maps = cache.stats().backend.map.calls;
  cache.step(lens({{a, layout.tokens_in_pages(3)}, {eager, layout.tokens_in_pages(3)}}));
  EXPECT_EQ(cache.stats().backend.map.calls, maps) << "its prompt found every page mapped";
  cache.free_reqid(a);  // kept 3 pages: as many as eager allocation maps...
  cache.map_ahead_now();
  EXPECT_EQ(cache.alloc_reqid(), a) << "...so it goes out next, and nothing new was mapped for it";
  cache.check_invariants();
}

TEST_P(MapperTest, WatermarkReclaimsFreedSlotsOnlyOnceTheirReadersAreDone) {
  auto events = std::make_shared<testing::ControlledEventBackend>(backend_);
  const KvLayout probe(config_, backend_->page_bytes());
  const std::size_t regions = probe.num_regions();
  config_.memory_budget = 4 * regions * backend_->page_bytes();
  config_.reclaim_watermark_pages = 2 * regions;
  KvCache cache(config_, events);
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, probe.tokens_in_pages(3)}, {b, 1}}));
  cache.free_reqid(b);  // freed first: its page is the least recently freed...
  cache.free_reqid(a);  // ...but `a` (more pages kept) is what alloc_reqid() hands out next
  EXPECT_EQ(cache.map_ahead_now(), 0u) << "b's zero-fill is not even enqueued: its page must stay";
  cache.step(lens({}));  // enqueues the zero-fills free_reqid() deferred
  EXPECT_EQ(cache.map_ahead_now(), 0u) << "b's readers may still run: its page must stay";
  events->complete_all();
  EXPECT_EQ(cache.map_ahead_now(), 1u);  // b's page goes back to the pool
  EXPECT_EQ(cache.mapped_pages(b), 0u);
  EXPECT_EQ(cache.mapped_pages(a), 3u) << "the next slot to be handed out keeps its pages";
  for (std::size_t pending : events->pending_at_each_unmap()) EXPECT_EQ(pending, 0u);
  EXPECT_EQ(cache.stats().pages_free, 1 * regions);
  cache.check_invariants();
}

TEST_P(MapperTest, WithoutDeferredReclamationFreedPagesGoBackToTheDriver) {
  config_.deferred_reclamation = false;
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t slot = cache.alloc_reqid();
  cache.step(lens({{slot, layout.tokens_in_pages(2)}}));
  cache.free_reqid(slot);
  const CacheStats stats = cache.stats();
  EXPECT_EQ(stats.pages_mapped, 0u);
  EXPECT_EQ(stats.pages_created, 0u);
  EXPECT_EQ(stats.backend.release.units, 2 * layout.num_regions());
  cache.check_invariants();
}

TEST_P(MapperTest, AnErrorOnTheMapperThreadSurfacesOnTheNextCall) {
  auto failing = std::make_shared<testing::FailingMapBackend>(backend_);
  config_.background_mapping = true;
  config_.eager_tokens = KvLayout(config_, backend_->page_bytes()).tokens_in_pages(1);
  failing->fail_maps = true;
  KvCache cache(config_, failing);
  cache.alloc_reqid();  // the next step() wakes the mapper: it fails to map the next slot's pages
  const bool surfaced = testing::wait_until([&] {
    try {
      cache.step(std::vector<std::size_t>(config_.max_batch_size, 0));
      return false;
    } catch (const DriverError& error) {
      EXPECT_NE(std::string(error.what()).find("injected"), std::string::npos);
      return true;
    }
  });
  EXPECT_TRUE(surfaced);
  cache.stop_background();
  failing->fail_maps = false;
  cache.check_invariants();  // the failed unit left nothing half done
  EXPECT_EQ(cache.stats().pages_mapped, 0u);
}

// The Nth map call fails, and from then on every unmap until heal(): a failed unit whose
// undo fails too.
class FailsTwiceBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::size_t maps() const noexcept { return maps_; }
  void fail_map(std::size_t nth) noexcept { fail_map_at_ = nth; }
  void heal() noexcept {
    fail_map_at_ = 0;
    failing_unmaps_ = false;
  }

  void map(Address address, const PageHandle* pages, std::size_t count) override {
    count_map();
    upstream_->map(address, pages, count);
  }
  void map_large(Address address, PageHandle page, std::size_t pages) override {
    count_map();
    upstream_->map_large(address, page, pages);
  }
  void unmap(Address address, std::size_t bytes) override {
    if (failing_unmaps_) throw DriverError("unmap (injected)", 1, "injected failure");
    upstream_->unmap(address, bytes);
  }

 private:
  void count_map() {
    if (++maps_ != fail_map_at_) return;
    failing_unmaps_ = true;
    throw DriverError("map (injected)", 2, "injected failure");
  }
  std::size_t maps_ = 0;
  std::size_t fail_map_at_ = 0;
  bool failing_unmaps_ = false;
};

// A unit that fails to map its second region, then fails to unmap its first, leaves those
// pages mapped where they are and out of the pool (handed to another request, its tokens
// would show at the first slot's addresses) until a later call unmaps them; then the
// first slot grows over that range as if nothing had happened.
TEST_P(MapperTest, PagesAFailedUnitCannotUnmapStayOutOfThePoolUntilUnmapped) {
  if (config_.layout == LayoutKind::interleaved) config_.layers_per_group = 2;  // two regions
  const KvLayout layout(config_, backend_->page_bytes());
  config_.lookahead_tokens = layout.tokens_in_pages(2);
  auto failing = std::make_shared<FailsTwiceBackend>(backend_);
  KvCache cache(config_, failing);
  const std::size_t first = cache.alloc_reqid();
  cache.step(lens({{first, layout.tokens_in_pages(1)}}));
  failing->fail_map(failing->maps() + 2);  // the unit's second region
  EXPECT_THROW(cache.map_ahead_now(), DriverError);
  failing->heal();
  EXPECT_EQ(cache.mapped_pages(first), 1u);
  CacheStats stats = cache.stats();
  EXPECT_EQ(stats.pages_created - stats.pages_free - stats.pages_mapped, 2u)
      << "the first region's two pages are neither free nor in the books";
  cache.check_invariants();

  // The next step unmaps them: every page is free or mapped again, and both slots hold
  // their own tokens, the first over the range that was stranded.
  const std::size_t second = cache.alloc_reqid();
  const std::size_t page_bytes = layout.page_bytes();
  cache.step(lens({{first, layout.tokens_in_pages(3)}, {second, layout.tokens_in_pages(2)}}));
  stats = cache.stats();
  EXPECT_EQ(stats.pages_created, stats.pages_free + stats.pages_mapped);
  for (std::size_t r = 0; r < layout.num_regions(); ++r) {
    testing::fill_bytes(cache.backend(), cache.base() + layout.page_offset(r, first, 0), 3 * page_bytes, 0x11);
    testing::fill_bytes(cache.backend(), cache.base() + layout.page_offset(r, second, 0), 2 * page_bytes, 0x22);
  }
  for (std::size_t r = 0; r < layout.num_regions(); ++r) {
    const auto mine =
        testing::read_bytes(cache.backend(), cache.base() + layout.page_offset(r, first, 0), 3 * page_bytes);
    EXPECT_EQ(std::count(mine.begin(), mine.end(), std::uint8_t{0x11}), static_cast<long>(mine.size()))
        << "region " << r;
  }
  cache.check_invariants();
}

TEST_P(MapperTest, TheThreadMapsAheadOnItsOwnAndStopsOnRequest) {
  config_.background_mapping = true;
  config_.lookahead_tokens = KvLayout(config_, backend_->page_bytes()).tokens_in_pages(2);
  KvCache cache(config_, backend_);
  const std::size_t slot = cache.alloc_reqid();
  cache.step(lens({{slot, 1}}));
  testing::wait_until([&] { return cache.mapped_pages(slot) >= 3; });
  EXPECT_EQ(cache.mapped_pages(slot), 3u);
  cache.stop_background();
  cache.stop_background();                                        // idempotent
  cache.step(lens({{slot, cache.layout().tokens_in_pages(4)}}));  // the cache goes on without it
  EXPECT_EQ(cache.mapped_pages(slot), 4u);
  cache.check_invariants();
}

// map_ahead_now() while the mapper thread is in the middle of a unit on a slot (which the
// plan skips): it waits for that unit and does what is left, so that on return the slot
// holds every page it is due, whoever mapped them.
TEST_P(MapperTest, MapAheadNowWaitsForTheUnitTheThreadIsIn) {
  config_.background_mapping = true;
  auto gated = std::make_shared<testing::GatedMapBackend>(backend_);
  KvCache cache(config_, gated);
  const std::size_t slot = cache.alloc_reqid();
  cache.step(lens({{slot, 1}}));
  gated->closed = true;  // the thread's next map() waits
  cache.expect_tokens(slot, cache.layout().tokens_in_pages(4));
  if (!testing::wait_until([&] { return gated->entered.load(); })) {
    gated->closed = false;
    FAIL() << "the mapper thread did not start mapping the expected tokens in 30 s";
  }
  auto done = std::async(std::launch::async, [&] { return cache.map_ahead_now(); });
  const bool returned_early = done.wait_for(std::chrono::milliseconds(100)) == std::future_status::ready;
  gated->closed = false;
  done.get();
  EXPECT_FALSE(returned_early) << "map_ahead_now() returned while the thread was in a unit";
  EXPECT_EQ(cache.mapped_pages(slot), 4u);
  cache.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, MapperTest,
                         ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved)),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

TEST(Mapper, RunsWorkUntilNoneIsLeftAndKeepsErrors) {
  int calls = 0;
  std::atomic<int> left{3};
  Mapper mapper([&] {
    ++calls;
    if (left == 1) {
      --left;
      throw Error("boom");
    }
    return left > 0 && --left > 0;
  });
  mapper.wake();
  std::exception_ptr error;
  testing::wait_until([&] { return static_cast<bool>(error = mapper.take_error()); });
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), Error);
  EXPECT_FALSE(mapper.take_error());  // reported once
  mapper.stop();
  EXPECT_GE(calls, 2);
}

}  // namespace
}  // namespace vkv
