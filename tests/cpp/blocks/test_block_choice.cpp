// The choice and the page counts against their definitions (block_testing.h's plain scan)
// on random schedules over every shape: the blocks back_some() takes are the reference's
// (costless first by id, then the lowest ids; the lowest only without prefer_costless),
// and every block's backed pages are what the reference counts.
#include <gtest/gtest.h>

#include <random>

#include "block_testing.h"
#include "blocks/page_counts.h"

namespace vkv {
namespace {

using testing::BlockShape;
using testing::kHostTestPageBytes;

class BlockChoice : public ::testing::TestWithParam<std::tuple<std::size_t, bool>> {};

TEST_P(BlockChoice, EqualsAPlainScanOnRandomSchedules) {
  const auto [shape_index, prefer_costless] = GetParam();
  const BlockShape shape = testing::block_shapes(kHostTestPageBytes).at(shape_index);
  BlockBackingConfig config = testing::block_config(shape);
  config.prefer_costless = prefer_costless;
  BlockBacking backing(config, nullptr, std::nullopt, std::make_shared<HostBackend>(kHostTestPageBytes));
  const testing::BlockReference reference = testing::reference_of(backing);
  std::mt19937 random(static_cast<unsigned>(shape_index * 2 + prefer_costless));
  for (int round = 0; round < 60; ++round) {
    // Give back a few, sometimes many, scattered as an engine's free list scatters them.
    std::vector<std::int64_t> held;
    for (std::size_t b = 1; b < shape.num_blocks; ++b)
      if (backing.is_backed(b)) held.push_back(static_cast<std::int64_t>(b));
    std::shuffle(held.begin(), held.end(), random);
    const std::size_t counts[] = {0, 1, 2, 3, 5, 40};
    held.resize(std::min(held.size(), counts[random() % 6]));
    backing.release(held.data(), held.size(), 0);
    const std::size_t want = std::vector<std::size_t>{1, 2, 3, 4, 8, 40}[random() % 6];
    const std::size_t num_pages = backing.reserved_bytes() / kHostTestPageBytes;
    const std::vector<std::size_t> expected =
        reference.choice(testing::backed_of(backing), num_pages, want, prefer_costless);
    const std::vector<std::int64_t> chosen = backing.back_some(want);
    ASSERT_EQ(std::vector<std::size_t>(chosen.begin(), chosen.end()), expected) << shape.name << " round " << round;
    const std::vector<std::size_t> users = reference.counts(testing::backed_of(backing), num_pages);
    for (std::size_t b = 0; b < shape.num_blocks; ++b) {
      const auto block_pages = reference.pages(b).first;
      ASSERT_EQ(backing.pages_in(b), block_pages.size()) << shape.name << " block " << b;
      const auto mapped = static_cast<std::size_t>(
          std::count_if(block_pages.begin(), block_pages.end(), [&](std::size_t p) { return users[p] > 0; }));
      ASSERT_EQ(backing.mapped_pages(b), mapped) << shape.name << " block " << b;
    }
    backing.check_invariants();  // the layer's counts against its own recount, its partial pages
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BlockChoice,
                         ::testing::Combine(::testing::Range<std::size_t>(0, 6), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<std::size_t, bool>>& info) {
                           return testing::block_shapes(kHostTestPageBytes).at(std::get<0>(info.param)).name +
                                  (std::get<1>(info.param) ? "_costless_first" : "_lowest_ids");
                         });

TEST(PageCounts, APageIsPartialWhileSomeButNotAllOfItsBlocksAreBacked) {
  BlockBackingConfig config;
  config.num_blocks = 8;
  config.ranges = {{0, 1024, 1024}};
  const detail::BlockGeometry geometry(config, 4096);  // four blocks a page
  detail::PageCounts counts(geometry);
  std::vector<std::size_t> changed;
  counts.add({0}, changed);
  EXPECT_EQ(changed, (std::vector<std::size_t>{0}));
  EXPECT_EQ(counts.partial(), (std::set<std::size_t>{0}));
  for (int i = 0; i < 3; ++i) counts.add({0}, changed);
  EXPECT_TRUE(counts.partial().empty()) << "every block of page 0 is backed";
  changed.clear();
  counts.remove({0}, changed);
  EXPECT_TRUE(changed.empty()) << "three blocks keep page 0";
  EXPECT_EQ(counts.partial(), (std::set<std::size_t>{0}));
  for (int i = 0; i < 3; ++i) counts.remove({0}, changed);
  EXPECT_EQ(changed, (std::vector<std::size_t>{0}));
  EXPECT_TRUE(counts.partial().empty());
  EXPECT_EQ(counts.backed_pages(), 0u);
}

}  // namespace
}  // namespace vkv
