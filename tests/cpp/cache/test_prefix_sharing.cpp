// PrefixSharing alone, on the host backend: a prefix's whole pages mapped at both slots,
// the page it ends inside of copied up to its last token, all or nothing under every
// injected failure, and the checks of fork() and share_prefix() in the caller's words.
#include <gtest/gtest.h>

#include <mutex>

#include "cache/prefix_sharing.h"
#include "cache/slot_parts.h"

namespace vkv {
namespace {

class PrefixSharingTest : public testing::SourceParts {
 protected:
  PrefixSharingTest() {
    for (std::size_t s : {0, 1}) slots_.mark_allocated(s, 0);
    grow(0, 3);
    for (std::size_t r = 0; r < regions(); ++r)
      testing::fill_bytes(*backend_, mappings_.address(r, 0, 0), 3 * page(), 7);
    slots_.set_tokens(0, 3 * tokens_per_page(), 3);
    for (std::size_t s = 0; s < slots_.size(); ++s) slots_.set_backed_end(s, layout_.pages_per_slot());
    for (std::size_t s = 1; s < slots_.size(); ++s) mappings_.back_with_zeros(s, layout_.pages_per_slot());
  }
  ~PrefixSharingTest() override {
    for (std::size_t r = 0; r < regions(); ++r) {  // the shared pages go back once, with src's
      std::vector<PageHandle> own;
      for (PageHandle handle : slots_[1].pages[r]) {
        if (sharing_.is_shared(handle)) {
          sharing_.drop_mapping(handle);
        } else {
          own.push_back(handle);
        }
      }
      slots_.set_pages(1, r, own);
    }
  }
  std::size_t tokens_per_page() const { return page() / layout_.token_bytes(); }
  std::size_t regions() const { return layout_.num_regions(); }
  void share(std::size_t tokens) {
    detail::UndoLog undo(detail::waits_for_stream(*backend_, 0));
    sharing_parts_.share_into(0, 1, tokens, 0, undo);
    undo.commit();
  }

  detail::PrefixSharing sharing_parts_{cache_, mappings_, readers_, source_};
};

TEST_F(PrefixSharingTest, TheShapeOfAPrefixThatEndsInsideAPage) {
  const detail::PrefixSharing::Shape shape = sharing_parts_.shape(0, 1, 2 * tokens_per_page() + 3);
  EXPECT_EQ(shape.full, 2u);
  EXPECT_EQ(shape.partial_bytes, 3 * layout_.token_bytes());
  EXPECT_EQ(shape.aliased, 2u);
  EXPECT_EQ(shape.replaced, 0u);
  EXPECT_EQ(shape.fresh, 1u);  // the page it ends in
  EXPECT_FALSE(shape.keeps_tail);
}

TEST_F(PrefixSharingTest, WholePagesAreMappedAtBothAndThePartialPageCopiedUpToTheLastToken) {
  const std::size_t tokens = 2 * tokens_per_page() + 3;
  share(tokens);
  EXPECT_EQ(slots_[1].mapped(), 3u);
  EXPECT_EQ(slots_[1].claimed, 3u);
  EXPECT_EQ(slots_[1].seq_len, tokens);
  for (std::size_t r = 0; r < regions(); ++r) {
    EXPECT_EQ(slots_[1].pages[r][0], slots_[0].pages[r][0]);
    EXPECT_NE(slots_[1].pages[r][2], slots_[0].pages[r][2]);
    const auto partial = testing::read_bytes(*backend_, mappings_.address(r, 1, 2), page());
    const std::size_t copied = 3 * layout_.token_bytes();
    EXPECT_EQ(std::vector<std::uint8_t>(partial.begin(), partial.begin() + copied),
              std::vector<std::uint8_t>(copied, 7));
    EXPECT_TRUE(testing::all_zero(std::vector<std::uint8_t>(partial.begin() + copied, partial.end())));
  }
  EXPECT_TRUE(sharing_.is_shared(slots_[0].pages[0][1]));
  EXPECT_TRUE(slots_[0].shared_a_page && slots_[1].shared_a_page);
}

TEST_F(PrefixSharingTest, AFailedShareLeavesBothSlotsAsTheyWere) {
  for (std::size_t fail_at = 1;; ++fail_at) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    backend_->calls = 0;
    backend_->fail_at = fail_at;
    try {
      share(2 * tokens_per_page() + 3);
    } catch (const DriverError&) {
      backend_->fail_at = 0;
      ASSERT_EQ(slots_[1].mapped(), 0u);
      ASSERT_EQ(slots_[1].seq_len, 0u);
      ASSERT_TRUE(sharing_.empty());
      ASSERT_EQ(pool_.handed_out_pages(), 3 * regions());
      ASSERT_TRUE(testing::all_zero(testing::read_bytes(*backend_, mappings_.address(0, 1, 0), 3 * page())));
      continue;
    }
    backend_->fail_at = 0;
    EXPECT_GT(fail_at, 1u);
    break;
  }
}

TEST_F(PrefixSharingTest, BadArgumentsAreNamedInTheCallersWords) {
  EXPECT_THROW(sharing_parts_.expect_valid_fork(2), InvalidArgument);  // not allocated
  EXPECT_NO_THROW(sharing_parts_.expect_valid_fork(0));
  EXPECT_THROW(sharing_parts_.expect_valid_share(0, 0, 1), InvalidArgument);
  try {
    sharing_parts_.expect_valid_share(0, 1, slots_[0].seq_len + 1);
    FAIL() << "shared more tokens than src holds";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("share_prefix: tokens"), std::string::npos) << error.what();
  }
  EXPECT_NO_THROW(sharing_parts_.expect_valid_share(0, 1, 5));
}

}  // namespace
}  // namespace vkv
