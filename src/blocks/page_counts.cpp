// PageCounts: the counts, the pages that change state, and the partial pages.
#include "page_counts.h"

#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv::detail {

PageCounts::PageCounts(const BlockGeometry& geometry) : geometry_(geometry), users_(geometry.num_pages(), 0) {}

void PageCounts::recount_partial(std::size_t page) {
  if (is_partial(page)) {
    partial_.insert(page);
  } else {
    partial_.erase(page);
  }
}

void PageCounts::add(const std::vector<std::size_t>& pages, std::vector<std::size_t>& became_backed) {
  for (std::size_t page : pages) {
    VKV_ASSERT(users_[page] < geometry_.touching(page));
    if (users_[page]++ == 0) {
      became_backed.push_back(page);
      ++backed_pages_;
    }
    recount_partial(page);
  }
}

void PageCounts::remove(const std::vector<std::size_t>& pages, std::vector<std::size_t>& became_free) {
  for (std::size_t page : pages) {
    VKV_ASSERT(users_[page] > 0);
    if (--users_[page] == 0) {
      became_free.push_back(page);
      --backed_pages_;
    }
    recount_partial(page);
  }
}

void PageCounts::check(const std::vector<std::uint32_t>& expected) const {
  std::size_t backed = 0;
  for (std::size_t page = 0; page < users_.size(); ++page) {
    if (users_[page] != expected[page])
      throw Error(detail::concat("block backing: page ", page, " counts ", users_[page], " backed blocks, but ",
                                 expected[page], " backed blocks touch it"));
    if (is_partial(page) != (partial_.count(page) != 0))
      throw Error(detail::concat("block backing: page ", page, " is ", is_partial(page) ? "" : "not ",
                                 "partial, but the partial pages say otherwise"));
    backed += users_[page] > 0 ? 1 : 0;
  }
  if (backed != backed_pages_)
    throw Error(detail::concat("block backing: ", backed, " pages are backed, but the count says ", backed_pages_));
}

}  // namespace vkv::detail
