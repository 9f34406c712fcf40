// BlockGeometry: a block's pages over one run, over ranges per layer region, straddling
// pages, larger than pages; the blocks on a page; the per-page counts; the checks.
#include <gtest/gtest.h>

#include "block_testing.h"
#include "blocks/block_geometry.h"

namespace vkv {
namespace {

using detail::BlockGeometry;

constexpr std::size_t kPage = 4096;

BlockBackingConfig config_of(std::size_t num_blocks, std::vector<BlockRange> ranges, std::size_t reserved = 0) {
  BlockBackingConfig config;
  config.num_blocks = num_blocks;
  config.ranges = std::move(ranges);
  config.reserved_bytes = reserved;
  return config;
}

std::vector<std::size_t> pages(const BlockGeometry& geometry, std::size_t block, bool* narrow = nullptr) {
  std::vector<std::size_t> out;
  const bool is_narrow = geometry.pages_of(block, out);
  if (narrow != nullptr) *narrow = is_narrow;
  return out;
}

TEST(BlockGeometry, OneRunSharesAndStraddlesPages) {
  const BlockGeometry geometry(config_of(10, {{0, 1536, 1536}}), kPage);  // 2.67 blocks a page
  EXPECT_EQ(geometry.num_pages(), 4u);                                    // 15360 bytes
  EXPECT_EQ(geometry.reserved_bytes(), 4 * kPage);
  EXPECT_EQ(pages(geometry, 0), (std::vector<std::size_t>{0}));
  EXPECT_EQ(pages(geometry, 2), (std::vector<std::size_t>{0, 1}));  // [3072, 4608): straddles
  EXPECT_EQ(pages(geometry, 9), (std::vector<std::size_t>{3}));
  EXPECT_EQ(geometry.touching(0), 3u);  // blocks 0, 1, 2
  EXPECT_EQ(geometry.touching(1), 4u);  // blocks 2, 3, 4, 5
  EXPECT_EQ(geometry.first_range_blocks_on(1), (std::pair<std::size_t, std::size_t>{2, 6}));
}

TEST(BlockGeometry, BlocksLargerThanPagesAreNarrowOnlyOnTwoPages) {
  const BlockGeometry geometry(config_of(4, {{0, 3 * kPage, 3 * kPage}}), kPage);
  bool narrow = true;
  EXPECT_EQ(pages(geometry, 1, &narrow), (std::vector<std::size_t>{3, 4, 5}));
  EXPECT_FALSE(narrow);  // page 4 is the block's alone
  const BlockGeometry two(config_of(4, {{100, kPage, kPage}}), kPage);
  EXPECT_EQ(pages(two, 1, &narrow), (std::vector<std::size_t>{1, 2}));
  EXPECT_TRUE(narrow);
}

TEST(BlockGeometry, LayerOutermostRangesUnionTheirPagesOnce) {
  // Two regions of 8 blocks of 1 KiB; a third range that shares a page with the first.
  const BlockGeometry geometry(config_of(8, {{0, 1024, 1024}, {8192, 1024, 1024}, {512, 256, 1024}}), kPage);
  EXPECT_EQ(pages(geometry, 0), (std::vector<std::size_t>{0, 2}));
  EXPECT_EQ(pages(geometry, 5), (std::vector<std::size_t>{1, 3}));
  EXPECT_EQ(geometry.touching(0), 4u);  // blocks 0-3, each once although two of its ranges are there
  EXPECT_TRUE(geometry.in_first_range(1));
  EXPECT_FALSE(geometry.in_first_range(2));
}

TEST(BlockGeometry, FirstRangeBlocksOnAPageMatchAScan) {
  for (const testing::BlockShape& shape : testing::block_shapes(kPage)) {
    const BlockGeometry geometry(config_of(shape.num_blocks, shape.ranges), kPage);
    for (std::size_t page = 0; page < geometry.num_pages(); ++page) {
      std::size_t first = shape.num_blocks, last = 0, touching = 0;
      const BlockRange& range = shape.ranges[0];
      for (std::size_t b = 0; b < shape.num_blocks; ++b) {
        const auto block_pages = pages(geometry, b);
        touching += std::count(block_pages.begin(), block_pages.end(), page);
        const std::size_t begin = range.start + b * range.stride;
        if (begin / kPage <= page && (begin + range.length - 1) / kPage >= page) {
          first = std::min(first, b);
          last = b + 1;
        }
      }
      const auto [from, to] = geometry.first_range_blocks_on(page);
      if (last == 0) {
        EXPECT_EQ(from, to) << shape.name << " page " << page;
      } else {
        EXPECT_EQ(from, first) << shape.name << " page " << page;
        EXPECT_EQ(to, last) << shape.name << " page " << page;
      }
      EXPECT_EQ(geometry.touching(page), touching) << shape.name << " page " << page;
      EXPECT_EQ(geometry.in_first_range(page), last > 0) << shape.name << " page " << page;
    }
  }
}

TEST(BlockGeometry, ReservedBytesRoundUpAndBoundTheRanges) {
  EXPECT_EQ(BlockGeometry(config_of(4, {{0, 1000, 1000}}, 5000), kPage).reserved_bytes(), 2 * kPage);
  const std::string message = testing::message_of<InvalidArgument>([] {
    BlockGeometry(config_of(4, {{0, 1000, 1000}}, 3000), kPage);
  });
  EXPECT_TRUE(testing::contains(message, "reserved_bytes = 3000")) << message;
  EXPECT_TRUE(testing::contains(message, "end at byte 4000")) << message;
}

TEST(BlockGeometry, RefusesBadRangesNamingThem) {
  auto refused = [](std::size_t num_blocks, std::vector<BlockRange> ranges) {
    return testing::message_of<InvalidArgument>([&] { BlockGeometry(config_of(num_blocks, ranges), kPage); });
  };
  EXPECT_TRUE(testing::contains(refused(0, {{0, 1, 1}}), "num_blocks = 0"));
  EXPECT_TRUE(testing::contains(refused(4, {}), "ranges is empty"));
  EXPECT_TRUE(testing::contains(refused(4, {{0, 8, 8}, {0, 0, 8}}), "ranges[1].length = 0"));
  EXPECT_TRUE(testing::contains(refused(4, {{0, 8, 4}}), "ranges[0].stride = 4 is less than its length 8"));
  EXPECT_TRUE(testing::contains(refused(4, {{0, 8, std::size_t{1} << 62}}), "does not fit"));
}

TEST(BlockGeometry, DigestTellsGeometriesApart) {
  const BlockGeometry a(config_of(8, {{0, 1024, 1024}}), kPage);
  EXPECT_EQ(a.digest(), BlockGeometry(config_of(16, {{0, 1024, 1024}}), kPage).digest());  // not the block count
  EXPECT_NE(a.digest(), BlockGeometry(config_of(8, {{0, 1024, 2048}}), kPage).digest());
  EXPECT_NE(a.digest(), BlockGeometry(config_of(8, {{0, 1024, 1024}}), 2 * kPage).digest());
}

}  // namespace
}  // namespace vkv
