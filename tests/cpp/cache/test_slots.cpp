// Per-slot calls: alloc_reqids (a batch of slots, adjacent on request), seq_lens read
// back, step_slots (a step naming some slots), set_deferred_reclamation.
#include <gtest/gtest.h>

#include <numeric>

#include "testing.h"

namespace vkv {
namespace {

class SlotCallsTest : public ::testing::TestWithParam<testing::BackendKind> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(GetParam(), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(LayoutKind::interleaved, backend_->page_bytes());
    config_.max_batch_size = 8;
  }
  std::unique_ptr<KvCache> make_cache() { return std::make_unique<KvCache>(config_, backend_); }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
};

TEST_P(SlotCallsTest, AllocReqidsHandsOutAdjacentSlotsAllOrNothing) {
  auto cache = make_cache();
  const std::size_t lone = cache->alloc_reqid();  // slot 0
  ASSERT_EQ(lone, 0u);
  const std::vector<std::size_t> block = cache->alloc_reqids(3, /*contiguous=*/true);
  EXPECT_EQ(block, (std::vector<std::size_t>{1, 2, 3}));
  cache->free_reqid(2);  // free now: slots 2, 4, 5, 6, 7
  EXPECT_EQ(cache->alloc_reqids(4, true), (std::vector<std::size_t>{4, 5, 6, 7}));
  // One free slot left (2): neither a run of two nor two slots can be had, and nothing changes.
  EXPECT_THROW(cache->alloc_reqids(2, true), InvalidArgument);
  EXPECT_THROW(cache->alloc_reqids(2, false), InvalidArgument);
  EXPECT_THROW(cache->alloc_reqids(0, false), InvalidArgument);
  EXPECT_EQ(cache->num_free_slots(), 1u);
  EXPECT_EQ(cache->alloc_reqids(1, false), (std::vector<std::size_t>{2}));
  cache->check_invariants();
}

TEST_P(SlotCallsTest, AllocReqidsPrefersTheRunThatKeptPages) {
  auto cache = make_cache();
  const std::vector<std::size_t> all = cache->alloc_reqids(8, false);
  std::vector<std::size_t> lens(8, 0);
  lens[5] = lens[6] = cache->layout().tokens_in_pages(2);
  cache->step(lens);
  for (std::size_t slot : all) cache->free_reqid(slot);
  EXPECT_EQ(cache->alloc_reqids(2, true), (std::vector<std::size_t>{5, 6}));
  EXPECT_EQ(cache->alloc_reqids(2, true), (std::vector<std::size_t>{0, 1}));  // ties: lowest first
}

TEST_P(SlotCallsTest, StepSlotsChangesTheListedSlotsOnly) {
  auto cache = make_cache();
  const std::vector<std::size_t> slots = cache->alloc_reqids(3, true);
  const std::size_t per_page = cache->layout().tokens_in_pages(1);
  std::vector<std::size_t> lens(8, 0);
  lens[slots[0]] = 10;
  lens[slots[1]] = 20;
  lens[slots[2]] = 30;
  cache->step(lens);
  EXPECT_EQ(cache->seq_lens(), lens);

  const std::size_t grow[] = {slots[1]};
  const std::size_t tokens[] = {per_page + 1};
  cache->step_slots(grow, tokens, 1);
  lens[slots[1]] = per_page + 1;
  EXPECT_EQ(cache->seq_lens(), lens);
  EXPECT_EQ(cache->mapped_pages(slots[1]), 2u);
  EXPECT_EQ(cache->mapped_pages(slots[0]), 1u);

  const std::size_t back[] = {slots[1]};
  const std::size_t fewer[] = {5};
  cache->step_slots(back, fewer, 1);  // stepping back keeps the pages
  EXPECT_EQ(cache->seq_lens()[slots[1]], 5u);
  EXPECT_EQ(cache->mapped_pages(slots[1]), 2u);

  const std::size_t twice[] = {slots[0], slots[0]};
  const std::size_t two[] = {1, 2};
  EXPECT_THROW(cache->step_slots(twice, two, 2), InvalidArgument);
  const std::size_t free_slot[] = {7};
  EXPECT_THROW(cache->step_slots(free_slot, two, 1), InvalidArgument);  // not allocated
  const std::size_t out_of_range[] = {8};
  EXPECT_THROW(cache->step_slots(out_of_range, two, 1), InvalidArgument);
  EXPECT_EQ(cache->seq_lens()[slots[0]], 10u);  // nothing changed
  cache->free_reqid(slots[2]);
  EXPECT_EQ(cache->seq_lens()[slots[2]], 0u);
  cache->check_invariants();
}

TEST_P(SlotCallsTest, StepSlotsIsAllOrNothingOnAShortage) {
  CacheConfig config = config_;
  config.memory_budget = 2 * backend_->page_bytes();
  KvCache cache(config, backend_);
  const std::vector<std::size_t> slots = cache.alloc_reqids(2, true);
  const std::size_t per_page = cache.layout().tokens_in_pages(1);
  const std::size_t both[] = {slots[0], slots[1]};
  const std::size_t too_many[] = {per_page, 2 * per_page};
  EXPECT_THROW(cache.step_slots(both, too_many, 2), OutOfMemory);
  EXPECT_EQ(cache.seq_lens(), std::vector<std::size_t>(8, 0));
  EXPECT_EQ(cache.stats().pages_in_use, 0u);
}

TEST_P(SlotCallsTest, DeferredReclamationCanBeTurnedOff) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  std::vector<std::size_t> lens(8, 0);
  lens[slot] = 10;
  cache->step(lens);
  cache->set_deferred_reclamation(false);
  cache->free_reqid(slot);
  EXPECT_EQ(cache->mapped_pages(slot), 0u);
  EXPECT_EQ(cache->stats().pages_created, 0u);  // back to the driver
  cache->set_deferred_reclamation(true);
  const std::size_t again = cache->alloc_reqid();
  lens[slot] = 0;
  lens[again] = 10;
  cache->step(lens);
  cache->free_reqid(again);
  EXPECT_EQ(cache->mapped_pages(again), 1u);  // kept for the next owner
}

INSTANTIATE_TEST_SUITE_P(Backends, SlotCallsTest,
                         ::testing::Values(testing::BackendKind::host, testing::BackendKind::cuda),
                         [](const auto& info) { return testing::backend_label(info.param); });

}  // namespace
}  // namespace vkv
