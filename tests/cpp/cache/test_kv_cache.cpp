// KvCache behaviour, for both layouts on every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <tuple>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class KvCacheTest : public ::testing::TestWithParam<std::tuple<BackendKind, LayoutKind>> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(std::get<0>(GetParam()), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(std::get<1>(GetParam()), backend_->page_bytes());
  }

  std::unique_ptr<KvCache> make_cache(std::size_t budget_pages_per_region = 0) {
    CacheConfig config = config_;
    const KvLayout layout(config, backend_->page_bytes());
    config.memory_budget = budget_pages_per_region * layout.num_regions() * backend_->page_bytes();
    return std::make_unique<KvCache>(config, backend_);
  }

  // seq_lens with `tokens` for `slot` and 0 elsewhere.
  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }

  // The bytes `slot` has mapped, region by region.
  std::vector<std::vector<std::uint8_t>> read_slot(KvCache& cache, std::size_t slot) {
    std::vector<std::vector<std::uint8_t>> regions;
    const KvLayout& layout = cache.layout();
    const std::size_t bytes = cache.mapped_pages(slot) * layout.page_bytes();
    for (std::size_t r = 0; r < layout.num_regions(); ++r)
      regions.push_back(testing::read_bytes(cache.backend(), cache.base() + layout.page_offset(r, slot, 0), bytes));
    return regions;
  }

  void fill_slot(KvCache& cache, std::size_t slot, std::uint8_t value) {
    const KvLayout& layout = cache.layout();
    for (std::size_t r = 0; r < layout.num_regions(); ++r)
      testing::fill_bytes(cache.backend(), cache.base() + layout.page_offset(r, slot, 0),
                          cache.mapped_pages(slot) * layout.page_bytes(), value);
  }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
};

TEST_P(KvCacheTest, StepMapsExactlyThePagesNeeded) {
  auto cache = make_cache();
  const KvLayout& layout = cache->layout();
  const std::size_t regions = layout.num_regions();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, 0}}));
  EXPECT_EQ(cache->mapped_pages(slot), 0u);

  cache->step(lens({{slot, layout.tokens_in_pages(2) + 1}}));  // one token into the third page
  EXPECT_EQ(cache->mapped_pages(slot), 3u);
  CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_in_use, 3 * regions);
  EXPECT_EQ(stats.pages_created, 3 * regions);
  EXPECT_EQ(stats.backend.map.units, 3 * regions);
  EXPECT_EQ(stats.backend.map.calls, regions);  // one run per region

  cache->step(lens({{slot, layout.tokens_in_pages(3)}}));  // fills the third page exactly
  EXPECT_EQ(cache->stats().backend.map.units, 3 * regions);
  cache->step(lens({{slot, 1}}));  // shrinking keeps the pages
  EXPECT_EQ(cache->mapped_pages(slot), 3u);
  EXPECT_EQ(cache->stats().tokens_in_use, 1u);
  cache->check_invariants();
}

TEST_P(KvCacheTest, StepBacksEverySlotInOneCall) {
  auto cache = make_cache();
  const KvLayout& layout = cache->layout();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid(), c = cache->alloc_reqid();
  cache->step(lens({{a, 1}, {b, layout.tokens_in_pages(4)}, {c, config_.max_context_len}}));
  EXPECT_EQ(cache->mapped_pages(a), 1u);
  EXPECT_EQ(cache->mapped_pages(b), 4u);
  EXPECT_EQ(cache->mapped_pages(c), layout.pages_per_slot());
  EXPECT_EQ(cache->stats().pages_in_use, (5 + layout.pages_per_slot()) * layout.num_regions());
  cache->check_invariants();
}

TEST_P(KvCacheTest, AllocPrefersTheSlotThatKeptItsPages) {
  auto cache = make_cache();
  const KvLayout& layout = cache->layout();
  EXPECT_EQ(cache->alloc_reqid(), 0u);  // lowest index among equals
  const std::size_t b = cache->alloc_reqid();
  EXPECT_EQ(b, 1u);
  cache->step(lens({{b, layout.tokens_in_pages(2)}}));
  cache->free_reqid(b);
  const auto creates = cache->stats().backend.create.units;
  const auto maps = cache->stats().backend.map.units;
  EXPECT_EQ(cache->stats().pages_cached, 2 * layout.num_regions());
  EXPECT_EQ(cache->alloc_reqid(), b);  // deferred reclamation: the mapped slot goes out first
  cache->step(lens({{b, layout.tokens_in_pages(2)}}));
  EXPECT_EQ(cache->stats().backend.create.units, creates);
  EXPECT_EQ(cache->stats().backend.map.units, maps);  // nothing to map: the pages never left
  cache->check_invariants();
}

TEST_P(KvCacheTest, AReusedSlotReadsZeros) {
  auto cache = make_cache();
  const KvLayout& layout = cache->layout();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, layout.tokens_in_pages(2)}}));
  for (const auto& region : read_slot(*cache, slot)) EXPECT_TRUE(testing::all_zero(region)) << "fresh pages";
  fill_slot(*cache, slot, 0xab);
  cache->free_reqid(slot);
  ASSERT_EQ(cache->alloc_reqid(), slot);
  cache->step(lens({{slot, 1}}));
  ASSERT_EQ(cache->mapped_pages(slot), 2u);
  for (const auto& region : read_slot(*cache, slot)) EXPECT_TRUE(testing::all_zero(region)) << "reused pages";
}

TEST_P(KvCacheTest, PagesReclaimedFromAFreedSlotReadZerosInTheirNewSlot) {
  auto cache = make_cache(/*budget_pages_per_region=*/3);
  const KvLayout& layout = cache->layout();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, layout.tokens_in_pages(3)}}));
  fill_slot(*cache, a, 0xcd);
  const std::size_t b = cache->alloc_reqid();  // not a: a is still allocated
  cache->free_reqid(a);
  cache->step(lens({{b, layout.tokens_in_pages(2)}}));  // the budget is spent: two of a's pages move to b
  EXPECT_EQ(cache->mapped_pages(a), 1u);
  EXPECT_EQ(cache->mapped_pages(b), 2u);
  EXPECT_EQ(cache->stats().pages_created, 3 * layout.num_regions());
  for (const auto& region : read_slot(*cache, b)) EXPECT_TRUE(testing::all_zero(region));
  cache->check_invariants();
}

TEST_P(KvCacheTest, InheritedPagesANewOwnerDoesNotNeedAreReclaimedBeforeItsNeighboursStarve) {
  auto cache = make_cache(/*budget_pages_per_region=*/4);
  const KvLayout& layout = cache->layout();
  const std::size_t regions = layout.num_regions();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, layout.tokens_in_pages(4)}}));
  cache->free_reqid(a);
  ASSERT_EQ(cache->alloc_reqid(), a);  // a short request inherits a long one's four pages
  cache->step(lens({{a, 1}}));
  EXPECT_EQ(cache->stats().pages_in_use, 1 * regions);
  EXPECT_EQ(cache->stats().pages_cached, 3 * regions);
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, 1}, {b, layout.tokens_in_pages(3)}}));  // only a's surplus can back b
  EXPECT_EQ(cache->mapped_pages(a), 1u);
  EXPECT_EQ(cache->mapped_pages(b), 3u);
  EXPECT_EQ(cache->stats().pages_in_use, 4 * regions);
  cache->check_invariants();
}

TEST_P(KvCacheTest, AShortageThrowsTheMissingPagesAndChangesNothing) {
  auto cache = make_cache(/*budget_pages_per_region=*/4);
  const KvLayout& layout = cache->layout();
  const std::size_t regions = layout.num_regions();
  const std::size_t a = cache->alloc_reqid(), b = cache->alloc_reqid();
  cache->step(lens({{a, layout.tokens_in_pages(2)}}));
  const CacheStats before = cache->stats();
  try {
    cache->step(lens({{a, layout.tokens_in_pages(3)}, {b, layout.tokens_in_pages(2)}}));  // 5 per region > 4
    FAIL() << "step overcommitted the budget";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), regions);
    EXPECT_EQ(error.missing_bytes(), regions * layout.page_bytes());
    EXPECT_NE(std::string(error.what()).find("budget"), std::string::npos) << error.what();
  }
  const CacheStats after = cache->stats();
  EXPECT_EQ(cache->mapped_pages(a), 2u);
  EXPECT_EQ(cache->mapped_pages(b), 0u);
  EXPECT_EQ(after.pages_created, before.pages_created);
  EXPECT_EQ(after.pages_in_use, before.pages_in_use);
  EXPECT_EQ(after.tokens_in_use, before.tokens_in_use);
  EXPECT_EQ(after.backend.map.calls, before.backend.map.calls);
  cache->check_invariants();
  // Preempting b (as an engine would) lets a grow.
  cache->step(lens({{a, layout.tokens_in_pages(4)}}));
  EXPECT_EQ(cache->mapped_pages(a), 4u);
}

TEST_P(KvCacheTest, EveryBadInputRaisesAndChangesNothing) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, 5}}));
  const CacheStats before = cache->stats();
  auto expect_invalid = [&](auto call, const char* fragment) {
    try {
      call();
      ADD_FAILURE() << "accepted: " << fragment;
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
  };
  expect_invalid([&] { cache->step(std::vector<std::size_t>(config_.max_batch_size - 1, 0)); }, "max_batch_size = 4");
  expect_invalid([&] { cache->step(lens({{slot, config_.max_context_len + 1}})); }, "exceeds max_context_len");
  expect_invalid([&] { cache->step(lens({{slot, 1}, {slot + 1, 1}})); }, "is not allocated");
  expect_invalid([&] { cache->free_reqid(config_.max_batch_size); }, "out of range");
  expect_invalid([&] { cache->free_reqid(slot + 1); }, "double free");
  expect_invalid([&] { cache->is_allocated(99); }, "slot = 99");
  expect_invalid([&] { cache->mapped_pages(99); }, "slot = 99");
  const CacheStats after = cache->stats();
  EXPECT_EQ(after.tokens_in_use, before.tokens_in_use);
  EXPECT_EQ(after.active_slots, 1u);
  EXPECT_EQ(after.pages_mapped, before.pages_mapped);
  cache->free_reqid(slot);
  expect_invalid([&] { cache->free_reqid(slot); }, "double free");
  for (std::size_t i = 0; i < config_.max_batch_size; ++i) cache->alloc_reqid();
  expect_invalid([&] { cache->alloc_reqid(); }, "no free slot");
  cache->check_invariants();
}

TEST_P(KvCacheTest, StatsCountBackendCallsAndTime) {
  auto cache = make_cache();
  const KvLayout& layout = cache->layout();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, layout.tokens_in_pages(3)}}));
  const CacheStats stats = cache->stats();
  EXPECT_EQ(stats.backend.create.units, 3 * layout.num_regions());
  EXPECT_EQ(stats.backend.map.units, 3 * layout.num_regions());
  EXPECT_GT(stats.backend.map.nanoseconds, 0u);
  EXPECT_EQ(stats.backend.reserve.units, layout.reserved_bytes());
  EXPECT_EQ(stats.reserved_bytes, layout.reserved_bytes());
  EXPECT_EQ(stats.pages_created, stats.pages_free + stats.pages_mapped);
  EXPECT_EQ(stats.active_slots, 1u);
}

TEST_P(KvCacheTest, DestructionUnmapsAndReleasesEveryPage) {
  auto counted = std::make_shared<StatisticsBackend>(backend_);
  {
    KvCache cache(config_, counted);
    const KvLayout& layout = cache.layout();
    const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
    cache.step(lens({{a, layout.tokens_in_pages(2)}, {b, 1}}));
    cache.free_reqid(a);
  }
  const BackendStats stats = counted->stats();
  EXPECT_GT(stats.create.units, 0u);
  EXPECT_EQ(stats.release.units, stats.create.units);
  // Every mapping made, real or zero-backed, was unmapped once.
  EXPECT_EQ(stats.unmap.units, stats.map.units + stats.zero_backing.units);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, KvCacheTest,
                         ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved)),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

TEST(KvCacheReclamation, UnmapsAFreedSlotOnlyAfterItsEventCompleted) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.memory_budget = 4 * testing::kHostTestPageBytes;
  config.zero_page = false;  // its read windows have events of their own (test_zero_page.cpp)
  KvCache cache(config, events);
  const KvLayout& layout = cache.layout();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  const std::size_t a = cache.alloc_reqid();
  seq_lens[a] = layout.tokens_in_pages(4);
  cache.step(seq_lens);
  const std::size_t b = cache.alloc_reqid();
  cache.free_reqid(a);  // a's readers may still run; its zero-fill waits for the next step()
  seq_lens[a] = 0;
  EXPECT_EQ(events->pending(), 0u);
  seq_lens[b] = layout.tokens_in_pages(2);
  cache.step(seq_lens);  // needs two of a's pages: enqueues the fill, waits for its event
  EXPECT_EQ(events->waits(), 1u);
  const auto pending = events->pending_at_each_unmap();
  ASSERT_FALSE(pending.empty());
  for (std::size_t count : pending) EXPECT_EQ(count, 0u) << "unmapped while a free event was pending";
  cache.check_invariants();
}

TEST(KvCacheReclamation, TheNewOwnersFirstStepOrdersItAfterTheZeroFill) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  CacheConfig config = testing::small_config(LayoutKind::per_layer, testing::kHostTestPageBytes);
  config.zero_page = false;  // its read windows have events of their own (test_zero_page.cpp)
  KvCache cache(config, events);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(4, 0);
  seq_lens[slot] = 10;
  cache.step(seq_lens);
  cache.free_reqid(slot);
  EXPECT_EQ(events->pending(), 0u);      // the zero-fill waits for the call that needs it:
  EXPECT_EQ(cache.alloc_reqid(), slot);  // not this one, which hands the pages to a new owner
  EXPECT_EQ(events->pending(), 0u);      // that touches nothing before its first step(),
  cache.step(seq_lens);                  // which enqueues it ahead of the owner's kernels
  EXPECT_EQ(events->pending(), 1u);
  EXPECT_EQ(events->stream_waits(), 0u);  // on the step's own stream: ordered without a wait
  EXPECT_EQ(events->waits(), 0u);         // and without blocking the caller
  cache.free_reqid(slot);                 // the owner leaves before the first zero-fill completed
  seq_lens[slot] = 0;
  cache.step(seq_lens);                   // enqueues the second, after the first
  EXPECT_EQ(events->pending(), 1u);       // one event, behind both zero-fills
  EXPECT_EQ(events->stream_waits(), 0u);  // the same stream orders the second after the first
  // Freed on one stream, stepped on another: the step's stream waits for the fill.
  const Stream other = 42;  // the host backend runs all work on one stream: any id will do
  EXPECT_EQ(cache.alloc_reqid(), slot);
  seq_lens[slot] = 10;
  cache.step(seq_lens);
  cache.free_reqid(slot, other);
  EXPECT_EQ(cache.alloc_reqid(), slot);
  const std::size_t waits = events->stream_waits();
  cache.step(seq_lens, /*stream=*/0);
  EXPECT_EQ(events->stream_waits(), waits + 2);  // the fill after the last one, the step after the fill
  EXPECT_EQ(events->waits(), 0u);
  events->complete_all();
}

}  // namespace
}  // namespace vkv
