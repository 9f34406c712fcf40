// BlockBacking on every backend, CUDA included (skipped without a device): pages backed
// anew read as zeros (on CUDA their zero-fill is the layer's, done before BACKED), bytes
// written through the reservation stay, the scratch page takes writes to unbacked blocks,
// large pages map runs whole and go back only whole, and everything goes back at the end.
#include <gtest/gtest.h>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class BlockDevices : public ::testing::TestWithParam<BackendKind> {};

TEST_P(BlockDevices, PagesBackedAnewAreZerosAndWrittenBytesStay) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  BlockBackingConfig config;
  config.num_blocks = 12;
  config.ranges = {{0, page / 2, page / 2}, {8 * page, page / 4, page / 4}};  // two regions, blocks sharing pages
  config.scratch_page = true;
  config.background = true;
  config.permanent_blocks = {0};
  BlockBacking backing(config, nullptr, std::nullopt, backend);
  testing::fill_block(backing, 7, 0x33);  // unbacked: the scratch page takes it
  backing.submit(nullptr, 0, 8, 0);
  backing.wait();
  for (std::size_t b = 1; b <= 8; ++b) {
    EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, b))) << "block " << b;
    testing::fill_block(backing, b, static_cast<std::uint8_t>(b));
  }
  const std::int64_t release[] = {3, 4, 5};
  backing.submit(release, 3, 6, 0);
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 6u);
  for (std::size_t b : {1, 2, 6, 7, 8})
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(page / 2 + page / 4, b)) << "block " << b;
  backing.submit(nullptr, 0, 9, 0);  // 3 and 9 (on pages still backed), then 4
  backing.wait();
  EXPECT_TRUE(backing.is_backed(4));
  // Its first range's page went back and came back as zeros (its second one stayed, with 6 and 7).
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend, backing.base() + 4 * (page / 2), page / 2)));
  backing.check_invariants();
  const BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.backend.zero.calls > 0, !backend->traits().fresh_pages_are_zero);
}

// Runs of fresh pages mapped in large pages of 4 (config.large_page_size): one create and
// one map call each; a large page's pages go back only together, once no block is on any.
TEST_P(BlockDevices, RunsAreMappedInLargePagesThatGoBackOnlyWhole) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  BlockBackingConfig config;
  config.num_blocks = 24;
  config.ranges = {{0, page, page}};  // block b on page b
  config.scratch_page = true;
  config.background = true;
  config.permanent_blocks = {0};
  config.large_page_size = 4 * page;
  BlockBacking backing(config, nullptr, std::nullopt, backend);
  const BackendStats before = backing.stats().backend;
  backing.submit(nullptr, 0, 10, 0);  // pages 1-10: large pages 1-4 and 5-8, then 9 and 10 in one run
  backing.wait();
  BackendStats now = backing.stats().backend;
  EXPECT_EQ(now.create.calls - before.create.calls, 4u);
  EXPECT_EQ(now.create.units - before.create.units, 10u);
  EXPECT_EQ(now.map.calls - before.map.calls, 3u);
  for (std::size_t b = 1; b <= 10; ++b) {
    EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, b))) << "block " << b;
    testing::fill_block(backing, b, static_cast<std::uint8_t>(b));
  }
  const std::int64_t two_three[] = {2, 3};
  backing.submit(two_three, 2, 8, 0);  // blocks 1 and 4 keep their large page
  backing.wait();
  EXPECT_EQ(backing.stats().pages_parked, 2u);
  EXPECT_EQ(backing.stats().backend.release.calls, now.release.calls);
  for (std::size_t b : {1, 4, 5, 6, 7, 8, 9, 10})
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(page, b)) << "block " << b;
  backing.check_invariants();
  const std::int64_t one_four[] = {1, 4};
  backing.submit(one_four, 2, 6, 0);  // the last two: the large page goes, once its readers are done
  backing.wait();
  backing.submit(nullptr, 0, 6, 0);
  backing.wait();
  const BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_parked + stats.pages_pending, 0u);
  EXPECT_EQ(stats.backend.release.units - now.release.units, 4u);
  // Under it now: a scratch large page, in one map call, not the scratch page page by page.
  EXPECT_EQ(stats.backend.zero_backing.units, now.zero_backing.units);
  testing::fill_block(backing, 3, 0x5a);  // an unbacked block's writes land in scratch
  backing.submit(nullptr, 0, 7, 0);       // block 1 again, on a fresh page: the scratch large page
  backing.wait();                         // is unmapped whole, pages 2-4 get the scratch page again
  EXPECT_EQ(backing.stats().backend.zero_backing.units - stats.backend.zero_backing.units, 3u);
  testing::fill_block(backing, 3, 0x5b);
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 1)));
  for (std::size_t b = 5; b <= 10; ++b)
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(page, b)) << "block " << b;
  backing.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Backends, BlockDevices,
                         ::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return testing::backend_label(info.param);
                         });

}  // namespace
}  // namespace vkv
