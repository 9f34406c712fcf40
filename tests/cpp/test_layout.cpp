// KvLayout: offsets, shapes, strides and page counts for both layouts.
#include <gtest/gtest.h>

#include "testing.h"

namespace vkv {
namespace {

constexpr std::size_t kPage = 64 << 10;

TEST(Layout, PerLayerHasOneRegionPerLayerAndKv) {
  const KvLayout layout(testing::small_config(LayoutKind::per_layer, kPage), kPage);
  EXPECT_EQ(layout.num_regions(), 8u);
  EXPECT_EQ(layout.token_bytes(), 2u * 64 * 2);
  EXPECT_EQ(layout.slot_bytes(), 8 * kPage);
  EXPECT_EQ(layout.region_bytes(), 4 * 8 * kPage);
  EXPECT_EQ(layout.reserved_bytes(), 8 * 4 * 8 * kPage);
  for (std::size_t layer = 0; layer < 4; ++layer) {
    const TensorView key = layout.key_view(layer);
    const TensorView value = layout.value_view(layer);
    EXPECT_EQ(key.offset_bytes, 2 * layer * layout.region_bytes());
    EXPECT_EQ(value.offset_bytes, (2 * layer + 1) * layout.region_bytes());
    EXPECT_EQ(key.shape, (std::array<std::int64_t, 4>{4, 2048, 2, 64}));
    // Contiguous within a slot: token stride = heads * head_dim.
    EXPECT_EQ(key.strides, (std::array<std::int64_t, 4>{static_cast<std::int64_t>(8 * kPage / 2), 128, 64, 1}));
  }
}

TEST(Layout, InterleavedPutsEveryLayerOfATokenSideBySide) {
  const KvLayout layout(testing::small_config(LayoutKind::interleaved, kPage), kPage);
  EXPECT_EQ(layout.num_regions(), 1u);
  EXPECT_EQ(layout.token_bytes(), 4u * 2 * 2 * 64 * 2);  // layers * {K,V} * heads * dim * dtype
  for (std::size_t layer = 0; layer < 4; ++layer) {
    EXPECT_EQ(layout.key_view(layer).offset_bytes, (2 * layer) * 256);
    EXPECT_EQ(layout.value_view(layer).offset_bytes, (2 * layer + 1) * 256);
    EXPECT_EQ(layout.key_view(layer).strides[1], 4 * 2 * 2 * 64);  // one token, in elements
  }
  // Token t of slot s, layer l's V, head h, element d, in bytes:
  const TensorView v = layout.value_view(2);
  const std::size_t s = 3, t = 17, h = 1, d = 5;
  const std::size_t by_strides =
      v.offset_bytes + 2 * (s * v.strides[0] + t * v.strides[1] + h * v.strides[2] + d * v.strides[3]);
  EXPECT_EQ(by_strides, s * layout.slot_bytes() + t * layout.token_bytes() + (2 * 2 + 1) * 256 + h * 128 + d * 2);
}

TEST(Layout, GroupsOfLayersMakeSeveralInterleavedRegions) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, kPage);
  config.layers_per_group = 2;
  const KvLayout layout(config, kPage);
  EXPECT_EQ(layout.num_regions(), 2u);
  EXPECT_EQ(layout.token_bytes(), 2u * 2 * 256);
  EXPECT_EQ(layout.key_view(3).offset_bytes, layout.region_bytes() + 2 * 256);
}

TEST(Layout, PagesForTokensRoundsUpAndCoversAStraddlingToken) {
  CacheConfig config = testing::small_config(LayoutKind::per_layer, kPage);
  config.head_dim = 96;  // 384-byte tokens: token 170 straddles pages 0 and 1
  const KvLayout layout(config, kPage);
  EXPECT_EQ(layout.pages_for_tokens(0), 0u);
  EXPECT_EQ(layout.pages_for_tokens(1), 1u);
  EXPECT_EQ(layout.pages_for_tokens(170), 1u);  // 65280 bytes
  EXPECT_EQ(layout.pages_for_tokens(171), 2u);  // token 170 ends at 65664
  EXPECT_EQ(layout.tokens_in_pages(1), 170u);
  EXPECT_EQ(layout.slot_bytes() % kPage, 0u);
  EXPECT_GE(layout.slot_bytes(), config.max_context_len * 384);
}

TEST(Layout, PageOffsetsFollowRegionSlotPage) {
  const KvLayout layout(testing::small_config(LayoutKind::per_layer, kPage), kPage);
  EXPECT_EQ(layout.page_offset(0, 0, 0), 0u);
  EXPECT_EQ(layout.page_offset(1, 2, 3), layout.region_bytes() + 2 * layout.slot_bytes() + 3 * kPage);
}

TEST(Layout, RejectsALayerOutOfRange) {
  const KvLayout layout(testing::small_config(LayoutKind::interleaved, kPage), kPage);
  EXPECT_THROW(layout.key_view(4), InvalidArgument);
}

TEST(Layout, Llama3_8BShapesMatchTheDesign) {
  CacheConfig config = llama3_8b_config(/*max_batch_size=*/32, /*max_context_len=*/8192);
  const std::size_t page = 2 << 20;
  config.layout = LayoutKind::interleaved;
  EXPECT_EQ(KvLayout(config, page).tokens_in_pages(1), 16u);
  config.layout = LayoutKind::per_layer;
  const KvLayout per_layer(config, page);
  EXPECT_EQ(per_layer.tokens_in_pages(1), 1024u);
  EXPECT_EQ(per_layer.num_regions(), 64u);
}

}  // namespace
}  // namespace vkv
