// The scratch page (config.scratch_page): the zero page made writable, so a caller may
// write its whole reservation (vLLM zero-fills its KV buffer) while most pages are unbacked.
// Writes there land in one shared page; a page step() backs still starts as zeros, and a
// page given back is replaced by the scratch again.
#include <gtest/gtest.h>

#include <tuple>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class ScratchPageTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    backend_ = testing::make_test_backend(GetParam(), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = testing::small_config(LayoutKind::interleaved, backend_->page_bytes());
    config_.zero_page = true;
    config_.scratch_page = true;
    config_.lookahead_tokens = 0;
    config_.eager_tokens = 0;
  }
  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }
  // Page `page` of `slot` in region 0.
  std::vector<std::uint8_t> page_bytes_of(KvCache& cache, std::size_t slot, std::size_t page) {
    const KvLayout& layout = cache.layout();
    return testing::read_bytes(*backend_, cache.base() + layout.page_offset(0, slot, page), layout.page_bytes());
  }
  static bool all_equal(const std::vector<std::uint8_t>& bytes, std::uint8_t value) {
    for (std::uint8_t byte : bytes)
      if (byte != value) return false;
    return true;
  }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
};

TEST_P(ScratchPageTest, WritesOverTheWholeReservationLandInTheScratchAndBackedPagesStartAsZeros) {
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  // Nothing backed yet: every page is the scratch page, writable (no fault).
  testing::fill_bytes(*backend_, cache.base(), layout.reserved_bytes(), 0x5a);
  EXPECT_TRUE(all_equal(page_bytes_of(cache, 1, 0), 0x5a));
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(1)}}));
  EXPECT_TRUE(testing::all_zero(page_bytes_of(cache, a, 0))) << "a backed page reads the scratch's garbage";
  EXPECT_TRUE(all_equal(page_bytes_of(cache, a, 1), 0x5a)) << "beyond what step() backed: the scratch";
  cache.check_invariants();
}

TEST_P(ScratchPageTest, WritesToUnbackedPagesLeaveBackedPagesAlone) {
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(1)}}));
  testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, a, 0), layout.page_bytes(), 0x11);
  const std::size_t other = a == 0 ? 1 : 0;
  testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, other, 0), layout.page_bytes(), 0x22);
  testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, a, 1), layout.page_bytes(), 0x33);
  EXPECT_TRUE(all_equal(page_bytes_of(cache, a, 0), 0x11));
  EXPECT_TRUE(all_equal(page_bytes_of(cache, other, 0), 0x33)) << "one scratch page under every unbacked page";
  cache.check_invariants();
}

TEST_P(ScratchPageTest, AFreedSlotsPagesGoBackToTheScratchAndComeBackAsZeros) {
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(2)}}));
  testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, a, 0), 2 * layout.page_bytes(), 0x44);
  cache.free_reqid(a);
  cache.trim();  // waits for the work that may still write there, then unmaps into the budget
  EXPECT_EQ(cache.mapped_pages(a), 0u);
  const std::size_t other = a == 0 ? 1 : 0;
  testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, other, 0), layout.page_bytes(), 0x66);
  EXPECT_TRUE(all_equal(page_bytes_of(cache, a, 0), 0x66)) << "the freed page is the scratch again";
  const std::size_t b = cache.alloc_reqid();
  cache.step(lens({{b, layout.tokens_in_pages(2)}}));
  EXPECT_TRUE(testing::all_zero(page_bytes_of(cache, b, 0)));
  EXPECT_TRUE(testing::all_zero(page_bytes_of(cache, b, 1)));
  cache.check_invariants();
}

// The mapper's work (lookahead, eager allocation, reclaiming below the watermark) would swap
// pages under the caller's writes: with a scratch page it maps nothing ahead. Before, the
// slot handed out next got a page mapped eagerly; a write meant for the scratch landed in it,
// and the request that got the slot read that write instead of zeros (an H200 run of the
// vLLM worker's GPU test saw it; a write during the swap faulted).
TEST_P(ScratchPageTest, TheMapperMapsNothingAheadUnderWritesToTheScratch) {
  config_.lookahead_tokens = config_.max_context_len;
  config_.eager_tokens = 1;
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(1)}}));
  backend_->synchronize(0);
  cache.map_ahead_now();  // what the mapper thread would do
  EXPECT_EQ(cache.mapped_pages(a), 1u) << "mapped ahead of a's seq_len";
  for (std::size_t s = 0; s < config_.max_batch_size; ++s)
    if (s != a) EXPECT_EQ(cache.mapped_pages(s), 0u) << "slot " << s << " got a page eagerly";
  // The caller writes every page no step() backed, as vLLM's zero-fill does: the scratch.
  for (std::size_t s = 0; s < config_.max_batch_size; ++s)
    if (s != a) testing::fill_bytes(*backend_, cache.base() + layout.page_offset(0, s, 0), layout.page_bytes(), 0x77);
  const std::size_t b = cache.alloc_reqid();
  cache.step(lens({{a, layout.tokens_in_pages(1)}, {b, layout.tokens_in_pages(1)}}));
  backend_->synchronize(0);
  EXPECT_TRUE(testing::all_zero(page_bytes_of(cache, b, 0))) << "slot " << b << " started with the scratch's bytes";
  cache.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ScratchPageTest,
                         ::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                         [](const auto& info) { return testing::backend_label(info.param); });

TEST(ScratchPage, NeedsZeroPage) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.scratch_page = true;
  EXPECT_THROW(validate(config), InvalidArgument);
}

TEST(ScratchPage, HostWritesThroughAnUnbackedAddressDoNotFault) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.zero_page = true;
  config.scratch_page = true;
  KvCache cache(config, backend);
  auto* unbacked = reinterpret_cast<volatile std::uint8_t*>(cache.base() + cache.layout().page_offset(0, 2, 1));
  *unbacked = 7;  // the zero page would fault here (ZeroPage.WritesBeyondWhatStepBackedStillFault)
  EXPECT_EQ(*unbacked, 7);
}

}  // namespace
}  // namespace vkv
