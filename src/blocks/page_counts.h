// PageCounts: per page, how many backed blocks have bytes on it. A page is backed while its
// count is above 0: it goes back when the last such block is released. It also keeps the
// partial pages -- some backed and some unbacked block touch them, and some block's first
// range does -- where the unbacked blocks whose pages are all backed (costless) are found.
//
// Internal. Thread-safety: none; the layer's mutex serializes every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "block_geometry.h"

namespace vkv::detail {

class PageCounts {
 public:
  /// Every count 0. `geometry` must outlive it.
  explicit PageCounts(const BlockGeometry& geometry);

  std::uint32_t users(std::size_t page) const noexcept { return users_[page]; }
  bool backed(std::size_t page) const noexcept { return users_[page] > 0; }
  /// Pages with a count above 0.
  std::size_t backed_pages() const noexcept { return backed_pages_; }
  /// One more backed block on each of `pages` (a block's, once each); appends to
  /// `became_backed` those whose count went from 0 to 1.
  void add(const std::vector<std::size_t>& pages, std::vector<std::size_t>& became_backed);
  /// One fewer on each of `pages`; appends to `became_free` those whose count went to 0.
  void remove(const std::vector<std::size_t>& pages, std::vector<std::size_t>& became_free);
  /// Pages some backed and some unbacked block touch, in some block's first range; ascending.
  const std::set<std::size_t>& partial() const noexcept { return partial_; }

  /// Checks the counts against `expected` (recounted by the caller) and the partial pages
  /// against their definition. @throws Error naming the first page that differs.
  void check(const std::vector<std::uint32_t>& expected) const;

 private:
  bool is_partial(std::size_t page) const noexcept {
    return users_[page] > 0 && users_[page] < geometry_.touching(page) && geometry_.in_first_range(page);
  }
  void recount_partial(std::size_t page);

  const BlockGeometry& geometry_;
  std::vector<std::uint32_t> users_;
  std::size_t backed_pages_ = 0;
  std::set<std::size_t> partial_;
};

}  // namespace vkv::detail
