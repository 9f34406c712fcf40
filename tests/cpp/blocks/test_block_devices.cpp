// BlockBacking on every backend, CUDA included (skipped without a device): pages backed
// anew read as zeros (on CUDA their zero-fill is the layer's, done before BACKED), bytes
// written through the reservation stay, the scratch page takes writes to unbacked blocks,
// large pages map whole chunks and go back only whole, and everything goes back at the end.
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

// Large pages of 4 (config.large_page_size): a chunk of 4 pages with nothing mapped is
// mapped whole, one create and one map call, over one scratch large page; its pages go back
// only together, once no block is on any, with a scratch large page under them again.
TEST_P(BlockDevices, ChunksAreMappedInLargePagesThatGoBackOnlyWhole) {
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
  EXPECT_EQ(before.zero_backing.units, 0u);     // the scratch under pages 4-23: large pages only
  EXPECT_EQ(backing.stats().pages_parked, 3u);  // block 0's chunk
  backing.submit(nullptr, 0, 10, 0);            // 1-3 parked; chunks 4-7 and 8-11 whole, 11 parked
  backing.wait();
  BackendStats now = backing.stats().backend;
  EXPECT_EQ(now.create.calls - before.create.calls, 2u);
  EXPECT_EQ(now.create.units - before.create.units, 8u);
  EXPECT_EQ(now.map.calls - before.map.calls, 2u);
  EXPECT_EQ(now.zero_backing.units, 0u);
  EXPECT_EQ(backing.stats().pages_parked, 1u);
  for (std::size_t b = 1; b <= 10; ++b) {
    EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, b))) << "block " << b;
    testing::fill_block(backing, b, static_cast<std::uint8_t>(b));
  }
  const std::int64_t five_six[] = {5, 6};
  backing.submit(five_six, 2, 8, 0);  // blocks 4 and 7 keep their large page
  backing.wait();
  EXPECT_EQ(backing.stats().pages_parked, 3u);
  EXPECT_EQ(backing.stats().backend.release.calls, now.release.calls);
  for (std::size_t b : {1, 2, 3, 4, 7, 8, 9, 10})
    EXPECT_EQ(testing::block_bytes(backing, b), std::vector<std::uint8_t>(page, b)) << "block " << b;
  backing.check_invariants();
  const std::int64_t four_seven[] = {4, 7};
  backing.submit(four_seven, 2, 6, 0);  // the last two: the large page goes, once its readers are done
  backing.wait();
  backing.submit(nullptr, 0, 6, 0);
  backing.wait();
  BlockBackingStats stats = backing.stats();
  EXPECT_EQ(stats.pages_parked, 1u);  // page 11
  EXPECT_EQ(stats.pages_pending, 0u);
  EXPECT_EQ(stats.backend.release.units - now.release.units, 4u);
  EXPECT_EQ(stats.backend.zero_backing.units, 0u);  // under it now: a scratch large page again
  testing::fill_block(backing, 5, 0x5a);            // an unbacked block's writes land in scratch
  now = stats.backend;
  backing.submit(nullptr, 0, 8, 0);  // blocks 4 and 5: the chunk whole again
  backing.wait();
  stats = backing.stats();
  EXPECT_EQ(stats.backend.map.calls - now.map.calls, 1u);
  EXPECT_EQ(stats.backend.unmap.calls - now.unmap.calls, 1u);  // the scratch large page, whole
  EXPECT_EQ(stats.backend.zero_backing.units, 0u);
  EXPECT_EQ(stats.pages_parked, 3u);  // 6, 7 and 11
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 4)));
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 5)));
  testing::fill_block(backing, 6, 0x5b);  // on a parked page: zero-filled when it is backed
  backing.submit(nullptr, 0, 9, 0);
  backing.wait();
  EXPECT_TRUE(testing::all_zero(testing::block_bytes(backing, 6)));
  for (std::size_t b : {1, 2, 3, 8, 9, 10})
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
