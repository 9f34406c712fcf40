// Zero backing (config.zero_page): every page no step() backed reads as zeros, writes
// there still fault, and a mapping that in-flight work may read changes only after it.
#include <gtest/gtest.h>

#include <tuple>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class ZeroPageTest : public ::testing::TestWithParam<std::tuple<BackendKind, LayoutKind>> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(std::get<0>(GetParam()), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(std::get<1>(GetParam()), backend_->page_bytes());
    config_.zero_page = true;
  }
  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }
  // Every byte of `slot` from page `first` to its end, in every region, reads 0.
  void expect_zeros_from(KvCache& cache, std::size_t slot, std::size_t first) {
    const KvLayout& layout = cache.layout();
    const std::size_t bytes = (layout.pages_per_slot() - first) * layout.page_bytes();
    for (std::size_t r = 0; r < layout.num_regions(); ++r)
      EXPECT_TRUE(
          testing::all_zero(testing::read_bytes(*backend_, cache.base() + layout.page_offset(r, slot, first), bytes)))
          << "slot " << slot << " region " << r << " from page " << first;
  }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
};

TEST_P(ZeroPageTest, EveryPageOfEverySlotReadsZerosOnceBacked) {
  KvCache cache(config_, backend_);
  const std::size_t slot = cache.alloc_reqid();  // an allocated slot is backed to its end at once
  expect_zeros_from(cache, slot, 0);
  cache.map_ahead_now();  // what the mapper does in the background where backing costs per page
  for (std::size_t s = 0; s < config_.max_batch_size; ++s) expect_zeros_from(cache, s, 0);
  cache.check_invariants();
}

TEST_P(ZeroPageTest, ReadsBeyondTheTokensReadZerosWhilePagesComeAndGo) {
  config_.memory_budget = 3 * KvLayout(config_, backend_->page_bytes()).num_regions() * backend_->page_bytes();
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(2)}, {b, 1}}));
  for (std::size_t r = 0; r < layout.num_regions(); ++r)
    testing::fill_bytes(*backend_, cache.base() + layout.page_offset(r, a, 0), 2 * layout.page_bytes(), 0x7e);
  expect_zeros_from(cache, a, 2);
  expect_zeros_from(cache, b, 1);
  cache.free_reqid(a);
  cache.step(lens({{b, 1}}));                          // enqueues a's zero-fill, deferred from free_reqid()
  expect_zeros_from(cache, a, 0);                      // zero-filled for the next owner, zero-backed beyond
  cache.step(lens({{b, layout.tokens_in_pages(3)}}));  // takes a's pages: reclaimed, zero-backed again
  EXPECT_EQ(cache.mapped_pages(a), 0u);
  expect_zeros_from(cache, a, 0);
  expect_zeros_from(cache, b, 3);
  cache.check_invariants();
}

TEST_P(ZeroPageTest, WithoutZeroPageNothingIsZeroBacked) {
  config_.zero_page = false;
  KvCache cache(config_, backend_);
  const std::size_t slot = cache.alloc_reqid();
  cache.step(lens({{slot, 1}}));
  cache.map_ahead_now();
  EXPECT_EQ(cache.stats().backend.zero_backing.calls, 0u);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ZeroPageTest,
                         ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::host_deferred,
                                                              BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved)),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

TEST(ZeroPage, WritesBeyondWhatStepBackedStillFault) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.zero_page = true;
  KvCache cache(config, backend);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(4, 0);
  seq_lens[slot] = 1;
  cache.step(seq_lens);
  auto* beyond = reinterpret_cast<volatile std::uint8_t*>(cache.base() + cache.layout().page_offset(0, slot, 1));
  EXPECT_EQ(*beyond, 0);          // reads as zero...
  EXPECT_DEATH(*beyond = 1, "");  // ...but a write is a fault, not silent corruption
}

// With the defaults (zero_page off) the host backend still reads zeros wherever no page is:
// a sum over a whole layer's keys, most of them never backed, is the backed tokens' sum.
TEST(ZeroPage, OffTheHostBackendReadsZerosPastWhatStepBacked) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  ASSERT_FALSE(config.zero_page);
  KvCache cache(config, std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[slot] = 1;
  cache.step(seq_lens);
  const std::size_t first = cache.layout().page_offset(0, slot, 0);
  *reinterpret_cast<volatile std::uint8_t*>(cache.base() + first) = 7;
  std::uint64_t sum = 0;
  const auto* bytes = reinterpret_cast<const volatile std::uint8_t*>(cache.base());
  for (std::size_t i = 0; i < cache.layout().reserved_bytes(); i += 64) sum += bytes[i];
  EXPECT_EQ(sum, 7u) << "every byte but one reads as zero";
  auto* beyond = reinterpret_cast<volatile std::uint8_t*>(cache.base() + cache.layout().page_offset(0, slot, 1));
  EXPECT_EQ(*beyond, 0);
  EXPECT_DEATH(*beyond = 1, "") << "a write where no page is must still fault";
}

// A slot grows into a page that a padded batch of the last iteration may read (below the
// largest seq_len of that step): the swap waits for that iteration's work; a page beyond
// every horizon is mapped without waiting, and the mapper maps ahead only there.
TEST(ZeroPage, APageInReachOfWorkInFlightIsSwappedOnlyAfterIt) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.lookahead_tokens = 0;
  config.eager_tokens = 0;
  config.zero_page = true;
  KvCache cache(config, events);
  const KvLayout& layout = cache.layout();
  const std::size_t page = layout.tokens_in_pages(1);
  const std::size_t longer = cache.alloc_reqid(), shorter = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[longer] = 8 * page;
  seq_lens[shorter] = page;
  cache.step(seq_lens);  // the iteration after this may read pages [0, 8) of both slots
  events->complete_all();
  const std::size_t waits_before = events->waits();

  seq_lens[longer] += 1;  // page 8: beyond every horizon
  cache.step(seq_lens);
  EXPECT_EQ(events->waits(), waits_before) << "a page no work in flight reads needs no wait";

  seq_lens[shorter] = page + 1;  // page 1 of the shorter slot: padded reads of the last iteration reach it
  const std::size_t unmaps_before = events->pending_at_each_unmap().size();
  cache.step(seq_lens);
  EXPECT_GT(events->waits(), waits_before) << "swapped a page in reach of work in flight without waiting";
  const auto pending = events->pending_at_each_unmap();
  ASSERT_GT(pending.size(), unmaps_before);
  for (std::size_t i = unmaps_before; i < pending.size(); ++i)
    EXPECT_EQ(pending[i], 0u) << "unmapped a page in reach while its readers' event was pending";

  // The mapper leaves pages in reach to step(): it maps ahead only beyond the horizon.
  config.lookahead_tokens = 2 * page;
  KvCache ahead(config, events);
  const std::size_t l = ahead.alloc_reqid(), s = ahead.alloc_reqid();
  std::vector<std::size_t> lens(config.max_batch_size, 0);
  lens[l] = 8 * page;
  lens[s] = page;
  ahead.step(lens);
  ahead.map_ahead_now();
  EXPECT_EQ(ahead.mapped_pages(s), 1u) << "mapped ahead into pages in reach of work in flight";
  EXPECT_EQ(ahead.mapped_pages(l), 10u);
  const CacheStats stats = ahead.stats();
  EXPECT_EQ(stats.pages_in_reach, 0u);
  ahead.check_invariants();
}

// set_budget() and trim() may run beside the engine: they leave pages in reach alone.
TEST(ZeroPage, TrimLeavesPagesInReachOfWorkInFlight) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.zero_page = true;
  KvCache cache(config, backend);
  const std::size_t page = cache.layout().tokens_in_pages(1);
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  const std::size_t a = cache.alloc_reqid();
  seq_lens[a] = 4 * page;
  cache.step(seq_lens);
  cache.free_reqid(a);
  seq_lens[a] = 0;
  const std::size_t b = cache.alloc_reqid();  // inherits a's 4 pages, claims 1
  ASSERT_EQ(b, a);
  const std::size_t c = cache.alloc_reqid();
  seq_lens[b] = 1;
  seq_lens[c] = 3 * page;  // the batch reads 3 pages of every slot
  cache.step(seq_lens);
  EXPECT_EQ(cache.stats().pages_in_reach, 2u);  // b's pages 1 and 2: kept; page 3 may go
  cache.trim();
  EXPECT_EQ(cache.mapped_pages(b), 3u);
  cache.check_invariants();
}

TEST(HostBackendMap, AFailedMapKeepsTheFirstErrorAndMapsNothing) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  HostBackend backend(testing::kHostTestPageBytes);
  const std::size_t page = backend.page_bytes();
  const Address base = backend.reserve(2 * page);
  const PageHandle pages[2] = {backend.create_page(), PageHandle{1} << 47};  // the second's offset overflows
  try {
    backend.map(base, pages, 2);
    FAIL() << "mapped a page that does not exist";
  } catch (const DriverError& error) {
    EXPECT_NE(std::string(error.what()).find("mmap(MAP_FIXED | MAP_SHARED) of page 1 of 2"), std::string::npos)
        << error.what();
  }
  EXPECT_DEATH(*reinterpret_cast<volatile std::uint8_t*>(base) = 1, "") << "the first page stayed mapped";
  backend.release_page(pages[0]);
  backend.free_reservation(base, 2 * page);
}

}  // namespace
}  // namespace vkv
