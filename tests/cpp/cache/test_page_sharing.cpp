// PageSharing alone: how many slot addresses map a page, what counts as shared, and what
// a large page weighs.
#include <gtest/gtest.h>

#include "cache/page_sharing.h"

namespace vkv::detail {
namespace {

TEST(PageSharing, APageMappedOnceIsNotCounted) {
  PageSharing sharing;
  EXPECT_TRUE(sharing.empty());
  EXPECT_EQ(sharing.mappings(7), 1u);
  EXPECT_FALSE(sharing.is_shared(7));
  EXPECT_TRUE(sharing.drop_mapping(7)) << "its one mapping was its last";
}

TEST(PageSharing, MappingsAreCountedUntilTheLastOneGoes) {
  PageSharing sharing;
  sharing.add_mapping(7);  // a second slot maps page 7
  sharing.add_mapping(7);  // and a third
  EXPECT_TRUE(sharing.is_shared(7));
  EXPECT_EQ(sharing.mappings(7), 3u);
  EXPECT_EQ(sharing.shared_pages(), 1u);
  EXPECT_EQ(sharing.duplicate_mappings(), 2u);
  EXPECT_FALSE(sharing.drop_mapping(7));
  EXPECT_FALSE(sharing.drop_mapping(7)) << "one slot still maps it";
  EXPECT_FALSE(sharing.is_shared(7));
  EXPECT_EQ(sharing.duplicate_mappings(), 0u);
  EXPECT_TRUE(sharing.drop_mapping(7));
  EXPECT_TRUE(sharing.empty());
}

TEST(PageSharing, ALargePageWeighsItsPages) {
  PageSharing sharing;
  sharing.add_mapping(100, /*pages=*/4);
  sharing.add_mapping(3);
  EXPECT_EQ(sharing.shared_pages(), 5u);
  EXPECT_EQ(sharing.duplicate_mappings(), 5u);
  sharing.add_mapping(100, 4);
  EXPECT_EQ(sharing.duplicate_mappings(), 9u) << "each extra mapping of the large page counts its 4 pages";
}

}  // namespace
}  // namespace vkv::detail
